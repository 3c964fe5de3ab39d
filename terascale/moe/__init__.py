"""Mixture of experts: routing tokens to experts (``gating``), moving them to the ranks
that hold their experts and back (``dispatch``), the experts a rank holds (``experts``),
expert-parallel groups (``groups``), DeepSpeed's ``MoE`` layer (``layer``) and its
optimizer-group helpers (``utils``).

``deepspeed.moe.layer.MoE`` is read as an attribute after ``import deepspeed``, so the
layer and the helpers are imported with the package.
"""

from terascale.moe import experts, gating, groups, layer, utils
from terascale.moe.layer import MoE

__all__ = ["MoE", "experts", "gating", "groups", "layer", "utils"]
