"""Loss scaling for fp16: static, or dynamic with DeepSpeed's window and hysteresis rules."""

from __future__ import annotations

from dataclasses import dataclass


class StaticLossScaler:
    """A constant loss scale (``fp16.loss_scale > 0``, or 1.0 for bf16/fp32)."""

    dynamic = False
    dynamic_loss_scale = False  # DeepSpeed's names (its LossScaleConfig) for what follows
    cur_iter = 0
    last_overflow_iter = None
    scale_window = scale_factor = min_loss_scale = None

    def __init__(self, scale: float = 1.0, use_grad_scaling: bool = False) -> None:
        self.scale = float(scale)
        self.use_grad_scaling = use_grad_scaling  # fp16: gradients carry the scale

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name of the scale (``optimizer.loss_scaler.cur_scale``)."""
        return self.scale

    loss_scale = cur_scale

    def update(self, overflow: bool) -> None:
        """A static scale never changes; an overflowing step is still skipped by the engine."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


@dataclass
class DynamicLossScaler:
    """Dynamic loss scaling as DeepSpeed does it.

    On an overflowing step the scale is divided by ``scale_factor`` once ``hysteresis``
    overflows have been absorbed (never below ``min_scale``); at a clean step that follows
    ``scale_window`` clean steps since the last overflow (or the start) it is multiplied by
    ``scale_factor``, and again every ``scale_window`` steps.
    Without ``consecutive_hysteresis`` the hysteresis budget is refilled only when the scale
    grows; with it, every clean step refills it.
    """

    scale: float = 2.0**16
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    dynamic = True
    dynamic_loss_scale = True
    use_grad_scaling = True

    def __post_init__(self) -> None:
        self._iter = 0
        self._last_overflow_iter = -1
        self._hysteresis_left = self.hysteresis

    # DeepSpeed's names for the state (``optimizer.loss_scaler.cur_scale``, ``cur_iter``, ...),
    # which programs log and test.
    @property
    def cur_scale(self) -> float:
        return self.scale

    loss_scale = cur_scale

    @property
    def cur_iter(self) -> int:
        """Optimizer steps seen, overflowing ones included."""
        return self._iter

    @property
    def last_overflow_iter(self) -> int:
        return self._last_overflow_iter

    @property
    def cur_hysteresis(self) -> int:
        return self._hysteresis_left

    @property
    def min_loss_scale(self) -> float:
        return self.min_scale

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step that did (``overflow``) or did not overflow."""
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left == 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow_iter = self._iter
        else:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            # DeepSpeed's rule (0.19): grow once ``scale_window`` clean steps came before
            # this one since the last overflow, and every ``scale_window`` steps after that.
            stable = self._iter - self._last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                self.scale *= self.scale_factor
        self._iter += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "iter": self._iter,
            "last_overflow_iter": self._last_overflow_iter,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._iter = int(state["iter"])
        self._last_overflow_iter = int(state["last_overflow_iter"])
        self._hysteresis_left = int(state["hysteresis_left"])


LossScaler = StaticLossScaler | DynamicLossScaler


def build_loss_scaler(fp16, zero_stage: int = 1, enabled: bool | None = None) -> LossScaler:
    """The scaler for a config's ``fp16`` section (a unit static scaler when fp16 is off;
    ``enabled`` overrides that: an fp16 ``torch_autocast`` scales by the section's keys).
    Without ZeRO (stage 0) every overflow lowers the scale, ``hysteresis`` notwithstanding:
    DeepSpeed's fp16 optimizer for that case has no hysteresis, its ZeRO optimizers do."""
    if not (fp16.enabled if enabled is None else enabled):
        return StaticLossScaler(1.0)
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale, use_grad_scaling=True)
    return DynamicLossScaler(
        scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis if zero_stage > 0 else 1,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )
