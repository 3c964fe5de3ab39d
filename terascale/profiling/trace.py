"""The trace window (``profiler``): a torch.profiler trace of whole optimizer steps.

[Note: trace window]
``TraceWindow`` runs ``torch.profiler.profile`` over optimizer steps ``start_step`` to
``start_step + num_steps - 1`` (CPU activity, and CUDA where the device is a GPU) and
writes ``<output_dir>/rank<r>.trace.json`` (Chrome trace format, which Perfetto and
``chrome://tracing`` open) when the window closes, or at :meth:`close` if training ends
inside it. Every thread is profiled where torch can (``profile_all_threads``), so the
swap I/O threads and a background checkpoint writer show up beside the training thread.
Each step of the window is a range ``terascale::iteration <step>``.

terascale marks its phases with named ranges (:func:`named_range`), so overlap of
communication, I/O and compute can be read off the trace:

- ``terascale::gather group <k>``: the all-gather of flat parameter group k being
  issued (ZeRO-3 before use, prefetches, and every stage's re-gathers after the step);
  ``terascale::gather wait group <k>``: blocked until it has arrived;
- ``terascale::reduce_scatter group <k>`` (``terascale::all_reduce group <k>`` with
  ``reduce_scatter: false``): group k's gradient reduction being issued;
  ``terascale::reduce wait group <k>``: blocked until it is done;
  ``terascale::all_reduce bucket <b>``: stage 0's gradient bucket b;
- ``terascale::optimizer run <k>``: the optimizer step of run k (the pieces of flat
  groups updated by one optimizer call, an offload swap unit);
- ``terascale::swap read`` / ``terascale::swap write``: one transfer of NVMe offload
  (parameters, optimizer state, gradients, activations) on its I/O thread;
- ``terascale::checkpoint write``: writing this rank's checkpoint shard file.

The engine adds ``terascale::forward`` / ``backward`` / ``step``. A range costs a check
of torch's profiler flag while no profiler runs (about 0.1 us; ``record_function`` itself
would cost several microseconds, see :func:`named_range`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from terascale.comm.ops import named_range
from terascale.config.profiling import TraceConfig

__all__ = ["TraceWindow", "named_range"]

logger = logging.getLogger("terascale")


class TraceWindow:
    """A torch.profiler window over whole optimizer steps (see [Note: trace window]).

    Call :meth:`step_begins` before the first micro-step of each optimizer step and
    :meth:`step_ends` after its update, with the step's number (1 for the first); the
    profiler starts at ``config.start_step`` (or at the first step inside the window, when
    training resumes there) and stops and writes ``path`` after step ``last_step``.
    ``config.enabled`` false makes every call a no-op. Nothing is communicated: each rank
    writes its own file.
    """

    def __init__(self, config: TraceConfig, rank: int, device: torch.device | str) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(device)
        self.path = Path(config.output_dir) / f"rank{rank}.trace.json"
        self.written: Path | None = None  # the trace file, once written
        self._profiler: profile | None = None
        self._step_range: Any = None
        self._step: int | None = None

    @property
    def last_step(self) -> int:
        return self.config.start_step + self.config.num_steps - 1

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def step_begins(self, step: int) -> None:
        """Optimizer step ``step`` begins: start the profiler if it is the window's first."""
        if not self.config.enabled or self.written is not None:
            return
        if self._profiler is None and self.config.start_step <= step <= self.last_step:
            self._profiler = profile(**self._profile_args())
            self._profiler.__enter__()
        if self._profiler is not None and self._step is None:
            self._step = step
            self._step_range = record_function(f"terascale::iteration {step}")
            self._step_range.__enter__()

    def step_ends(self, step: int) -> Path | None:
        """Optimizer step ``step`` is done: after the window's last step, stop the profiler
        and write the trace; return its path then (None otherwise)."""
        if self._profiler is None:
            return None
        self._end_step_range()
        if step >= self.last_step:
            return self._stop()
        return None

    def close(self) -> Path | None:
        """Stop a window still open (training ended inside it) and write what it holds."""
        if self._profiler is None:
            return None
        self._end_step_range()
        return self._stop()

    # -- internals -------------------------------------------------------------------------------

    def _profile_args(self) -> dict[str, Any]:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        args: dict[str, Any] = {"activities": activities}
        try:  # every thread, not just this one, where torch can (else this thread only)
            from torch._C._profiler import _ExperimentalConfig

            args["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
        except (ImportError, TypeError):
            pass
        return args

    def _end_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
        self._step_range, self._step = None, None

    def _stop(self) -> Path:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels still running belong in the trace
        profiler.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        self.written = self.path
        logger.info(
            "rank %d: trace of steps %d-%d written to %s", self.rank, self.config.start_step, self.last_step, self.path
        )
        return self.path
