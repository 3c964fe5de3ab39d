"""ZeRO: parameters, gradients and optimizer state partitioned over the data-parallel ranks.

``wrap`` decides the groups, ``flat_group`` holds one group's flat buffer and shards,
``grads`` reduce-scatters gradients, ``masters`` holds the fp32 master shards the
optimizer steps, ``schedule`` gathers and frees groups around their use (stage 3), and
``sharded`` puts them together as the engine's model state for stages 1-3, and ``tiling``
splits huge linear layers into tiles that are groups of their own.
``Init`` builds a model already partitioned; ``GatheredParameters`` reads or changes
sharded parameters in full. ``register_external_parameter`` and the leaf-module marks
(``set_z3_leaf_modules``, ...) are DeepSpeed's ways to tell ZeRO-3 how a model uses its
parameters (``external`` and ``leaf``).
"""

from terascale.zero.external import ExternalParameterError, register_external_parameter, unregister_external_parameter
from terascale.zero.flat_group import FlatLayout, FlatParamGroup, Fragment, ParamSlot, ShardState
from terascale.zero.gather import GatheredParameters
from terascale.zero.init import Init
from terascale.zero.leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from terascale.zero.options import ZeroOptions
from terascale.zero.sharded import ShardedState
from terascale.zero.tiling import TiledLinear, tile_linears
from terascale.zero.wrap import GroupPlan, WrapPolicy

__all__ = [
    "ExternalParameterError",
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
    "get_z3_leaf_modules",
    "register_external_parameter",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "tile_linears",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
