"""``health``: terascale's monitors that run during training (none of them is DeepSpeed's).

```json
"health": {
  "watchdog":   {"enabled": true, "timeout_s": 600},
  "straggler":  {"enabled": true, "every_n_steps": 50, "threshold": 1.5},
  "non_finite": {"policy": "skip", "max_rollbacks": 3}
}
```

* ``watchdog``: a rank blocked in one collective for ``timeout_s`` ends its process with a
  message naming the operation, the group and the peers that did not arrive
  (``terascale.health.watchdog``). On by default where there is more than one rank.
* ``straggler``: every ``every_n_steps`` optimizer steps the ranks compare their compute
  time (forward and backward, less time blocked in communication); a rank slower than
  ``threshold`` x the median of its peers is named in the log and the monitors.
* ``non_finite``: what a NaN/Inf in the loss or the gradients does: ``skip`` the step,
  ``stop`` the run with an error, or ``rollback`` to the last checkpoint in
  ``checkpoint.save_dir``; ``none`` (default) leaves it to fp16's loss scaler, if any.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from terascale.config.section import Section


class WatchdogConfig(Section):
    """``health.watchdog``: hang detection in collectives."""

    enabled: bool = True
    # NCCL's default process-group timeout; below gloo's (30 min), so on gloo this message,
    # which names the operation and the late peer, comes before gloo's own error.
    timeout_s: float = Field(600.0, gt=0)


class StragglerConfig(Section):
    """``health.straggler``: names ranks whose compute time lags their peers'."""

    enabled: bool = False
    every_n_steps: int = Field(50, ge=1)
    threshold: float = Field(1.5, gt=1.0)


class NonFiniteConfig(Section):
    """``health.non_finite``: the policy for NaN/Inf losses and gradients."""

    policy: Literal["none", "skip", "stop", "rollback"] = "none"
    # Consecutive rollbacks without a finite step in between before the run stops: data
    # that is bad twice in a row after a rollback is not a transient.
    max_rollbacks: int = Field(3, ge=1)


class HealthConfig(Section):
    """``health``: see the module docstring."""

    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    straggler: StragglerConfig = Field(default_factory=StragglerConfig)
    non_finite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
