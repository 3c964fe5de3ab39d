"""ZeRO: parameters, gradients and optimizer state partitioned over the data-parallel ranks.

The building block is :class:`FlatParamGroup` (see ``[Note: flat shards]``). Stages 1-3
are wired into the engine by the ZeRO issue; until then the config rejects them.
"""

from terascale.zero.flat_group import FlatLayout, FlatParamGroup, Fragment, ParamSlot, ShardState

__all__ = ["FlatLayout", "FlatParamGroup", "Fragment", "ParamSlot", "ShardState"]
