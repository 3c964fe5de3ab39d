"""ZeRO++ (Wang et al., 2023): what stage 3 communicates, made cheaper across nodes.

The three options are independent and change only collectives, never the full-precision
masters, gradients or optimizer states (so checkpoints are unaffected):

- ``quantized_weights`` (qwZ): parameter gathers send int8 block codes ([Note: ZeRO++ gathers]);
- ``hpz_size`` (hpZ): a secondary copy of the parameters partitioned over blocks of
  ``hpz_size`` ranks (one node), so the backward's re-gathers stay in the node;
- ``quantized_gradients`` (qgZ): the gradient reduce-scatter reduces inside the node first
  and sends int4 codes across nodes ([Note: the hierarchical quantized reduce-scatter]).

:class:`ZeroPPComm` holds the process groups they need, built once per model state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm.hierarchy import NodeGroups, block_group, node_groups
from terascale.comm.quant import BlockQuant

log = logging.getLogger(__name__)

# qwZ: int8 over blocks of 2048 weights (scales add 0.2% to the codes); qgZ: int4 over
# blocks of 256 gradients (1.6%): gradients are coded twice and need the finer scale.
WEIGHT_QUANT = BlockQuant(bits=8, block=2048)
GRAD_QUANT = BlockQuant(bits=4, block=256)


@dataclass(frozen=True)
class ZeroPPPolicy:
    """Which ZeRO++ options are on (``zero_optimization``'s ``zero_quantized_weights``,
    ``zero_hpz_partition_size``, ``zero_quantized_gradients``)."""

    quantized_weights: bool = False
    hpz_size: int = 1
    quantized_gradients: bool = False
    weight_quant: BlockQuant = WEIGHT_QUANT
    grad_quant: BlockQuant = GRAD_QUANT

    @property
    def enabled(self) -> bool:
        return self.quantized_weights or self.hpz_size > 1 or self.quantized_gradients


@dataclass(frozen=True)
class ZeroPPComm:
    """The groups and codes a stage-3 state over ``group`` uses for ZeRO++: ``secondary``
    (hpZ; None when off), ``nodes`` (qgZ; None when off or on one node)."""

    weight_quant: BlockQuant | None
    secondary: ProcessGroup | None
    nodes: NodeGroups | None
    grad_quant: BlockQuant

    @staticmethod
    def build(policy: ZeroPPPolicy, group: ProcessGroup) -> ZeroPPComm:
        """Create the groups ``policy`` needs. Collective over the default group. Raises
        ``ValueError`` when ``hpz_size`` does not divide ``group``."""
        world = dist.get_world_size(group)
        secondary = None
        hpz = policy.hpz_size
        if hpz > world:
            # A config written for big nodes, run on fewer ranks (a smaller test cluster): the
            # secondary partition spans every rank, as if they were one node.
            log.info("zero_hpz_partition_size %d is more than the %d ranks; the secondary partition spans all %d",
                     hpz, world, world)  # fmt: skip
            hpz = world
        if hpz > 1:
            if world % hpz:
                raise ValueError(
                    f"zero_hpz_partition_size {hpz} does not divide the {world} ranks that ZeRO "
                    "shards over; set it to the number of ranks a node has (a divisor of the world)"
                )
            secondary = block_group(group, hpz)
        nodes = None
        if policy.quantized_gradients:
            nodes = node_groups(group)
            if nodes.num_nodes == 1:
                # Nothing crosses a node: the plain reduce-scatter is exact and as cheap.
                log.info("zero_quantized_gradients: all %d ranks are on one node; gradients are reduced "
                         "unquantized", world)  # fmt: skip
                nodes = None
            elif dist.get_rank() == 0:
                log.info("zero_quantized_gradients: %d nodes x %d ranks, int4 codes across nodes",
                         nodes.num_nodes, nodes.local_size)  # fmt: skip
        return ZeroPPComm(policy.weight_quant if policy.quantized_weights else None, secondary, nodes, policy.grad_quant)
