"""Model parallelism: the process-group topology (pp x dp x tp) and Megatron's mpu over it.

``topology`` names the groups; ZeRO shards over its ``dp`` group when its
:meth:`~terascale.parallel.Topology.mpu` is passed to ``terascale.initialize``.
"""

from terascale.parallel.topology import DIMS, MegatronMpu, Topology, grid_sizes

__all__ = ["DIMS", "MegatronMpu", "Topology", "grid_sizes"]
