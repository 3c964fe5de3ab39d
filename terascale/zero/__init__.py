"""ZeRO: parameters, gradients and optimizer state partitioned over the data-parallel ranks.

``wrap`` decides the groups, ``flat_group`` holds one group's flat buffer and shards,
``grads`` reduce-scatters gradients, ``masters`` holds the fp32 master shards the
optimizer steps, ``schedule`` gathers and frees groups around their use (stage 3), and
``sharded`` puts them together as the engine's model state for stages 1-3, and ``tiling``
splits huge linear layers into tiles that are groups of their own.
``Init`` builds a model already partitioned; ``GatheredParameters`` reads or changes
sharded parameters in full.
"""

from terascale.zero.flat_group import FlatLayout, FlatParamGroup, Fragment, ParamSlot, ShardState
from terascale.zero.gather import GatheredParameters
from terascale.zero.init import Init
from terascale.zero.sharded import ShardedState, ZeroOptions
from terascale.zero.tiling import TiledLinear, tile_linears
from terascale.zero.wrap import GroupPlan, WrapPolicy

__all__ = [
    "FlatLayout",
    "FlatParamGroup",
    "Fragment",
    "GatheredParameters",
    "GroupPlan",
    "Init",
    "ParamSlot",
    "ShardState",
    "ShardedState",
    "TiledLinear",
    "WrapPolicy",
    "ZeroOptions",
    "tile_linears",
]
