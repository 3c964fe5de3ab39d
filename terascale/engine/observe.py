"""The engine's side of observability: what a user sees of where a run's time goes.

The engine calls :meth:`Observer.phase` around forward, backward and the optimizer step
and :meth:`Observer.step_ends` after each optimizer step. The observer then

* times the phases (``StepTimers``; synchronised with the device only when
  ``wall_clock_breakdown`` asks, as that costs overlap) and names them as
  ``terascale::forward/backward/step`` ranges for traces;
* after every step writes its loss, lr and (fp16) loss scale to the monitors, where any
  listen (the window's loss is read from the device only then, or at a print step);
* every ``steps_per_print`` steps logs one line and writes the same numbers to the
  monitors: loss, lr, grad norm, loss scale, skipped steps, samples/s, tokens/s, TFLOP/s
  per rank (measured by the flops profiler's count at ``profile_step``, and by the GPT
  formula for GPT-like models), MFU (in words instead of a number where no peak is known or
  the peak is below what was achieved), memory of every rank (device allocated and peak, host
  RSS) and the wall-clock breakdown, including the time blocked in parameter gathers,
  gradient reduction and offload I/O;
* runs the flops profiler over step ``flops_profiler.profile_step``, keeps the comms
  logger active during the phases, and drives the trace window (``profiler``).

[Note: what the print line costs]
Nothing here synchronises a device or communicates except at print steps, where the ranks
all-gather three numbers (their memory), and where the profiled step runs under
``FlopCounterMode``. The throughput is wall time between print steps, so it includes
everything the training loop does, as a user's stopwatch would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist
from torch import nn

from terascale.comm import DistributedContext
from terascale.comm import ops as comm_ops
from terascale.config import Config
from terascale.engine.model_state import ModelState
from terascale.engine.monitor import Reporter, StepTimers
from terascale.engine.train_state import TrainState
from terascale.profiling.throughput import gpt_flops_per_token, model_shape, peak_flops, tokens_in, utilisation

if TYPE_CHECKING:
    from terascale.profiling.comms import CommsLogger

logger = logging.getLogger("terascale")

_GB = 1e9
# ModelState.wait_breakdown's causes: (key, word in the line, monitor name).
_WAITS = (("param_gather", "gather", "param_gather"), ("grad_reduce", "reduce", "grad_reduce"),
          ("offload_io", "io", "offload_wait"))  # fmt: skip


class Observer:
    """Timers, the per-print throughput/utilisation/memory report, the flops profiler, the
    comms logger and the trace window of one engine's training of ``module``.

    ``train_batch_size`` turns step times into samples/s; ``recompute``: checkpointed
    blocks run their forward twice (the GPT formula's count of FLOPs).
    """

    def __init__(
        self,
        config: Config,
        dist_ctx: DistributedContext,
        module: nn.Module,
        model_state: ModelState,
        train_state: TrainState,
        reporter: Reporter,
        *,
        compute_dtype: torch.dtype,
        train_batch_size: int,
        recompute: bool,
    ) -> None:
        self._config, self._dist, self._module = config, dist_ctx, module
        self._state, self._train, self._reporter = model_state, train_state, reporter
        self._dtype, self._batch, self._recompute = compute_dtype, train_batch_size, recompute
        self.timers = StepTimers(config.wall_clock_breakdown, dist_ctx.device)
        self._step_open = False
        self._profiler: Any = None  # a FlopsProfiler while the profiled step runs
        self.flops_per_step: float | None = None  # this rank's, measured at profile_step
        self.last_profile: Any = None  # the FlopsProfiler of profile_step, once it ran
        self._shape = model_shape(module)
        self._tokens = 0  # this rank's tokens since the last print
        self._seq_len = 0
        self._comms: Any = None
        if config.comms_logger.enabled:
            from terascale.profiling.comms import CommsLogger

            self._comms = CommsLogger(config.comms_logger, dist_ctx.rank)
        self._trace: Any = None
        if config.profiler.enabled:
            from terascale.profiling.trace import TraceWindow

            self._trace = TraceWindow(config.profiler, dist_ctx.rank, dist_ctx.device)
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._waits = model_state.wait_breakdown()
        self._peak: tuple[float, str] | None = None

    # -- during the step -------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str, inputs: Any = None) -> Iterator[None]:
        """Time phase ``name`` (forward/backward/step), mark it as a trace range and keep the
        comms logger recording; ``inputs`` of a training forward count its tokens."""
        # An evaluation forward (eval mode or no grad) neither opens a step nor counts tokens.
        training = name != "forward" or (self._module.training and torch.is_grad_enabled())
        if training and not self._step_open:
            self._step_begins()
        if inputs is not None and training:
            tokens, seq = tokens_in(inputs)
            self._tokens += tokens
            self._seq_len = seq or self._seq_len
        self.timers.start(name)
        with comm_ops.named_range(f"terascale::{name}"), self._comms.active() if self._comms is not None else nullcontext():
            yield
        self.timers.stop(name)

    def _step_begins(self) -> None:
        self._step_open = True
        step = self._train.global_steps + 1
        if self._trace is not None:
            self._trace.step_begins(step)
        profile = self._config.flops_profiler
        if profile.enabled and step == profile.profile_step:
            from terascale.profiling.flops import FlopsProfiler

            # At stage 3 the module's parameters are shards: count the full sizes.
            numels = {name: info.numel for name, info in self._state.checkpoint_params().items()}
            self._profiler = FlopsProfiler(self._module, param_numel=numels, device=self._dist.device)
            self._step_started = time.perf_counter()
            self._profiler.start()

    def step_ends(self, lr: float, loss_scale: float | None) -> None:
        """After an optimizer step (the train state already counts it, and still holds the
        window's summed loss): close the profiled step and the trace window's step, write
        the step's metrics (``loss_scale`` with fp16, else None) and at print steps the
        line. Collective at print steps."""
        self._step_open = False
        self._window_steps += 1
        if self._profiler is not None:
            self._finish_profile()
        if self._trace is not None:
            self._trace.step_ends(self._train.global_steps)
        every = self._config.steps_per_print
        want_print = bool(every) and self._train.global_steps % every == 0  # the same on every rank
        if not (want_print or self._reporter.writes):
            return
        value = float(self._train.window_loss) / self._train.gradient_accumulation_steps
        metrics = {"Train/Samples/train_loss": value, "Train/Samples/lr": lr}
        if loss_scale is not None:
            metrics["Train/Samples/loss_scale"] = loss_scale
        self._reporter.write(metrics)
        if want_print:
            self._report(value, lr, loss_scale)

    def _finish_profile(self) -> None:
        profiler, self._profiler = self._profiler, None
        self.last_profile = profiler
        self._sync()
        elapsed = time.perf_counter() - self._step_started
        profiler.stop()
        self.flops_per_step = float(profiler.total_flops())
        profile = self._config.flops_profiler
        if self._reporter.reports:
            text = profiler.report(module_depth=profile.module_depth, top_modules=profile.top_modules,
                                   detailed=profile.detailed, step_time_s=elapsed)  # fmt: skip
            if profile.output_file:
                with open(profile.output_file, "w") as f:
                    f.write(text)
                logger.info("flops profile of step %d written to %s", self._train.global_steps, profile.output_file)
            else:
                print(text, flush=True)

    # -- reports ---------------------------------------------------------------------------------

    def _report(self, loss: float, lr: float, loss_scale: float | None) -> None:
        """At a print step (every rank: collective): the line and the monitor events."""
        train = self._train
        elapsed = time.perf_counter() - self._window_start
        steps = max(self._window_steps, 1)
        memory = self._memory_of_every_rank()
        waits = self._state.wait_breakdown()
        waited = {k: (waits[k] - self._waits[k]) / steps for k in waits}
        timed = self.timers.take()
        step_s = elapsed / steps
        tokens = self._tokens / steps * self._dist.dp_world_size
        self._window_start, self._window_steps, self._tokens, self._waits = time.perf_counter(), 0, 0, waits
        if not self._reporter.reports:
            return
        samples = self._batch / step_s
        measured = self.flops_per_step / step_s if self.flops_per_step else None
        formula = None
        if self._shape is not None and self._seq_len and tokens:
            per_token = gpt_flops_per_token(*self._shape, self._seq_len, recompute=self._recompute)
            formula = per_token * tokens / step_s / self._dist.world_size
        mfu, mfu_text = None, ""
        achieved = measured or formula
        if achieved:
            peak, source = self._device_peak()
            mfu = utilisation(achieved, peak)
            mfu_text = _mfu_text(mfu, peak, source)
        parts = [f"step={train.global_steps} skipped={train.skipped_steps} loss={loss:.5f}", f"lr={lr:.4g}"]
        if train.last_grad_norm is not None:
            parts.append(f"grad_norm={train.last_grad_norm:.4g}")
        if loss_scale is not None:
            parts.append(f"loss_scale={loss_scale:g}")
        speed = f"| {samples:,.1f} samples/s"
        if tokens:
            speed += f", {tokens / step_s:,.0f} tokens/s"
        if measured:
            speed += f", {measured / 1e12:.3g} TFLOP/s per rank (counted"
            speed += f"; GPT formula {formula / 1e12:.3g})" if formula else ")"
        elif formula:
            speed += f", {formula / 1e12:.3g} TFLOP/s per rank (GPT formula)"
        if mfu_text:
            speed += f", {mfu_text}"
        parts.append(speed)
        parts.append("| memory (max over ranks): " + _memory_text(memory))
        if self.timers.enabled:
            parts.append("| ms/step: " + " ".join(f"{k} {v / steps * 1e3:.1f}" for k, v in timed.items())
                         + " | waits: " + " ".join(f"{short} {waited[k] * 1e3:.1f}" for k, short, _ in _WAITS))  # fmt: skip
        logger.info(" ".join(parts))
        if self._reporter.writes:
            self._write(samples, tokens / step_s, measured or formula, mfu, memory, timed, waited, steps)

    def _write(self, samples: float, tokens: float, flops: float | None, mfu: float | None,
               memory: list[tuple[float, float, float]], timed: dict[str, float],
               waited: dict[str, float], steps: int) -> None:  # fmt: skip
        metrics = {"Throughput/samples_per_s": samples}
        if tokens:
            metrics["Throughput/tokens_per_s"] = tokens
        if flops:
            metrics["Throughput/tflops"] = flops / 1e12
        if mfu is not None:
            metrics["Throughput/mfu"] = mfu
        if self._train.last_grad_norm is not None:
            metrics["Train/Samples/grad_norm"] = self._train.last_grad_norm
        for r, (allocated, peak, rss) in enumerate(memory):
            metrics.update({f"Memory/rank{r}/device_allocated_gb": allocated, f"Memory/rank{r}/device_peak_gb": peak,
                            f"Memory/rank{r}/host_rss_gb": rss})  # fmt: skip
        if self.timers.enabled:
            metrics.update({f"Time/{k}_ms": v / steps * 1e3 for k, v in timed.items()})
            metrics.update({f"Time/{name}_ms": waited[k] * 1e3 for k, _, name in _WAITS})
        if self._comms is not None:
            for op, stats in self._comms.totals().items():
                metrics[f"Comms/{op}/busbw_gbps"] = stats["busbw_gbps"]
                metrics[f"Comms/{op}/algbw_gbps"] = stats["algbw_gbps"]
        self._reporter.write(metrics)

    @property
    def comms(self) -> CommsLogger | None:
        return self._comms

    def comms_summary(self) -> str:
        if self._comms is None:
            raise ValueError("engine.comms_summary() needs the comms logger: set comms_logger.enabled: true")
        return self._comms.summary()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
        if self._comms is not None and self._reporter.reports:
            logger.info("communication summary:\n%s", self._comms.summary())

    # -- helpers ---------------------------------------------------------------------------------

    def _memory_of_every_rank(self) -> list[tuple[float, float, float]]:
        """(device allocated, device peak, host RSS) in GB of every rank (collective)."""
        device = self._dist.device
        mine = [0.0, 0.0, psutil.Process().memory_info().rss / _GB]
        if device.type == "cuda":
            mine[:2] = torch.cuda.memory_allocated(device) / _GB, torch.cuda.max_memory_allocated(device) / _GB
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return [tuple(mine)]  # type: ignore[list-item]
        everyone = [torch.empty_like(local) for _ in range(world)]
        comm_ops.all_gather(everyone, local)
        return [tuple(t.tolist()) for t in everyone]  # type: ignore[misc]

    def _device_peak(self) -> tuple[float, str]:
        if self._peak is None:
            self._peak = peak_flops(self._dist.device, self._dtype)
        return self._peak

    def _sync(self) -> None:
        if self._dist.device.type == "cuda":
            torch.cuda.synchronize(self._dist.device)


def _mfu_text(mfu: float | None, peak: float, source: str) -> str:
    """The line's MFU: a percentage only where it is one (see ``utilisation``), else why not."""
    if mfu is not None:
        return f"MFU {mfu * 100:.1f}%"
    if peak <= 0:
        return f"MFU n/a (no peak known: {source})"
    return f"MFU n/a (achieved above the peak of {peak / 1e12:.3g} TFLOP/s, {source})"


def _memory_text(memory: list[tuple[float, float, float]]) -> str:
    allocated, peak, rss = (max(column) for column in zip(*memory))
    text = f"rss {rss:.2f} GB"
    if peak:
        text += f", allocated {allocated:.2f} GB, peak {peak:.2f} GB"
    return text
