"""What a ZeRO stage means, as data: the options the model state is built from.

The engine builds them from the config's ``zero_optimization`` section
(``terascale.engine.prepare.zero_options``); nothing under ``terascale.zero`` reads the
config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from terascale.offload import OptimizerOffload
from terascale.offload.policy import ParamOffload
from terascale.zero.grads import GradPolicy
from terascale.zero.masters import MasterPrecision
from terascale.zero.schedule import SchedulePolicy
from terascale.zero.wrap import WrapPolicy
from terascale.zero.zeropp import ZeroPPPolicy


@dataclass(frozen=True)
class ZeroOptions:
    """Everything a stage means, as data (the engine builds it from ``zero_optimization``:
    ``terascale.engine.prepare.zero_options``)."""

    stage: int
    grads: GradPolicy
    wrap: WrapPolicy = field(default_factory=WrapPolicy)
    schedule: SchedulePolicy = field(default_factory=SchedulePolicy)
    persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    allgather_bucket_numel: int = 500_000_000
    offload_optimizer: OptimizerOffload = field(default_factory=OptimizerOffload)
    offload_param: ParamOffload = field(default_factory=ParamOffload)
    allow_untested_optimizer: bool = False  # zero_allow_untested_optimizer
    zeropp: ZeroPPPolicy = field(default_factory=ZeroPPPolicy)
    masters: MasterPrecision = field(default_factory=MasterPrecision)  # bf16 masters / optimizer states

    def __post_init__(self) -> None:
        assert self.stage in (1, 2, 3), self.stage
        assert self.stage == 3 or not self.offload_param.enabled, "parameter offload needs stage 3"
        assert self.stage == 3 or not self.zeropp.enabled, "ZeRO++ needs stage 3"
