"""Model parallelism: the process-group topology (pp x dp x tp) and Megatron's mpu over it.

``topology`` names the groups; ZeRO shards over its ``dp`` group when its
:meth:`~terascale.parallel.Topology.mpu` is passed to ``terascale.initialize``.
``slicing`` says which part of each full parameter a tensor-parallel rank holds;
``terascale.parallel.tensor`` has the tensor-parallel layers and ``auto_tp`` (imported
from there, so that importing this package stays light).
"""

from terascale.parallel.slicing import TensorSlice, join_slices, sliced_parameters, take_slice
from terascale.parallel.topology import DIMS, MegatronMpu, Topology, grid_sizes

__all__ = [
    "DIMS",
    "MegatronMpu",
    "TensorSlice",
    "Topology",
    "grid_sizes",
    "join_slices",
    "sliced_parameters",
    "take_slice",
]
