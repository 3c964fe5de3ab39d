"""The pipeline runner: executes one stage's schedule for a batch of micro-batches.

[Note: pipeline runner]
The runner walks this stage's instruction list (:mod:`terascale.pipe.schedule`): a
forward runs a chunk on its inputs (the micro-batch's ``inputs`` on virtual stage 0, an
activation received from the previous virtual stage elsewhere) and, on the last virtual
stage, ``loss_fn(outputs, labels)``; a backward runs from that loss, or from the chunk's
outputs with the gradients the next virtual stage sent; runs of transfers go to
:class:`~terascale.pipe.p2p.StageComm` as one batch. What a chunk keeps for its backward
(its received inputs, its outputs) is dropped once the backward has run.

The runner does no arithmetic on gradients itself. Forward and backward go through a
:class:`StageDriver`, which the engine implements: it moves inputs to the device, scales
the loss (accumulation, fp16) and brackets every backward with its model state's hooks
(``sync`` is set on the last backward of the schedule on this stage, which ends the
accumulation window: ZeRO-1 and stage 0 reduce then; ZeRO-2/3 reduce after every
backward the groups it gave gradients, see [Note: reduce what a backward touched] in
:mod:`terascale.zero.grads`; ZeRO-3 gathers around every chunk);
:meth:`StageDriver.finish_window` then steps the optimizer once. The pipe package thus never imports the engine.

Data: ``data_iter`` yields ``(inputs, labels)`` per micro-batch (DeepSpeed's convention).
Only the ranks holding the first or the last virtual stage read it, once per micro-batch
in order; other stages may pass an iterator or None.

Timing: each run records the stage's busy time (forward and backward computes, loss
included, measured with device events where the device has them) and its wall time;
``bubble = 1 - busy / wall`` compares with ``(p - 1) / (v m + p - 1)``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.engine.data import to_device
from terascale.pipe.p2p import Partitioning, Payload, StageComm, float_tensors, handoff
from terascale.pipe.schedule import Instr, Op, StageGrid, forward_only, last_backward, train_schedule

_MAX_DIMS = 8  # of the outputs eval_batch averages when the model has no loss_fn (their shape is broadcast)


class StageDriver(Protocol):
    """What the runner needs from the engine (see [Note: pipeline runner])."""

    def forward_chunk(self, chunk: int, inputs: Payload) -> Payload:
        """Run local chunk ``chunk`` of the model on ``inputs`` (moved to the device)."""
        ...

    def backward_chunk(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, sync: bool) -> None:
        """Backward from ``tensors`` with ``grads``; ``grads=None``: ``tensors`` is one
        unscaled micro-batch loss, to be scaled for accumulation and fp16 first. ``sync``:
        the last backward of the window on this stage."""
        ...

    def finish_window(self, loss: torch.Tensor) -> None:
        """Every backward of the window has run: count its micro-steps and step once;
        ``loss`` is the window's mean loss (for reporting)."""
        ...


@dataclass
class RunStats:
    """Timings of the last run on this stage, in seconds."""

    step_s: float = 0.0
    busy_s: float = 0.0
    micro_batches: int = 0
    stages: int = 1
    chunks: int = 1
    sent_act_bytes: int = 0  # activation bytes this rank sent to the next stages
    sent_grad_bytes: int = 0  # gradient bytes this rank sent to the previous stages

    def as_dict(self) -> dict[str, float]:
        p, v, m = self.stages, self.chunks, self.micro_batches
        return {
            "step_s": self.step_s,
            "busy_s": self.busy_s,
            "bubble": 1.0 - self.busy_s / self.step_s if self.step_s > 0 else 0.0,
            "ideal_bubble": (p - 1) / (v * m + p - 1) if m else 0.0,
            "micro_batches": float(m),
            "sent_act_bytes": float(self.sent_act_bytes),
            "sent_grad_bytes": float(self.sent_grad_bytes),
        }


class _BusyClock:
    """Sums the time of compute regions; on an accelerator with device events, as the
    device measured them (read once at the end of a run)."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type != "cpu" and hasattr(torch, "Event")
        self.device = device
        self._pairs: list[tuple[Any, Any]] = []
        self._seconds = 0.0

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self.events:
            start, end = torch.Event(self.device, enable_timing=True), torch.Event(self.device, enable_timing=True)
            start.record()
            yield
            end.record()
            self._pairs.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0

    def total(self) -> float:
        if self._pairs:
            self._pairs[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._pairs) / 1000.0
            self._pairs = []
        return self._seconds


@dataclass
class _Run:
    """The state of one schedule run."""

    schedule: list[Instr]
    data: Iterator[Any] | None
    training: bool
    compute_loss: bool = True
    keep_outputs: bool = False
    batches: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # mb -> (inputs, labels)
    read: int = 0
    inbox: dict[Instr, Any] = field(default_factory=dict)  # received, by the compute that uses them
    outbox: dict[Instr, Any] = field(default_factory=dict)  # to send, by the transfer
    saved: dict[tuple[int, int], tuple[list[torch.Tensor], Any]] = field(default_factory=dict)  # inputs, outputs
    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)


class PipelineRunner:
    """Runs this stage's schedules (see [Note: pipeline runner]).

    ``loss_fn(outputs, labels)`` is the model's loss (None: the last stage's output is
    the loss). ``pp_group`` joins the stages (ranks in stage order), ``dp_group`` the
    replicas of this stage (the loss is averaged over them); ``partitioning`` names the
    tensor-parallel group that activations and gradients between stages are split over
    (see [Note: partitioned boundaries] in :mod:`terascale.pipe.p2p`).
    """

    def __init__(
        self,
        loss_fn: Any,
        grid: StageGrid,
        stage: int,
        pp_group: ProcessGroup,
        dp_group: ProcessGroup,
        device: torch.device,
        partitioning: Partitioning | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.grid = grid
        self.stage = stage
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.device = device
        self.comm = StageComm(pp_group, grid, stage, device, partitioning)
        self.stats = RunStats(stages=grid.stages, chunks=grid.chunks)
        self.reads_data = grid.is_first(stage, 0) or grid.is_last(stage, grid.chunks - 1)

    # -- the two kinds of run -------------------------------------------------------------------

    def train(self, driver: StageDriver, data_iter: Iterator[Any] | None, micro_batches: int) -> torch.Tensor:
        """Forward and backward ``micro_batches`` micro-batches, step once; returns the mean
        loss over the micro-batches and the data-parallel replicas, on every stage."""
        run = _Run(train_schedule(self.grid.stages, self.stage, micro_batches, self.grid.chunks), data_iter, True)
        self._execute(driver, run, micro_batches)
        loss = self._mean_loss(run.losses, micro_batches)
        driver.finish_window(loss)
        return loss

    def evaluate(
        self,
        driver: StageDriver,
        data_iter: Iterator[Any] | None,
        micro_batches: int,
        compute_loss: bool = True,
        return_logits: bool = False,
    ) -> tuple[torch.Tensor | None, Any]:
        """Forward ``micro_batches`` micro-batches without gradients. Returns (mean loss on
        every stage, or None without ``compute_loss``; the last stage's outputs of the
        micro-batches, concatenated along dim 0 when they are tensors, with
        ``return_logits`` on the last stage, else None)."""
        run = _Run(forward_only(self.grid.stages, self.stage, micro_batches, self.grid.chunks), data_iter, False)
        run.compute_loss, run.keep_outputs = compute_loss, return_logits
        with torch.no_grad():
            self._execute(driver, run, micro_batches)
            loss = self._mean_loss(run.losses, micro_batches, scalar=False) if compute_loss else None
        logits = None
        if return_logits and run.outputs:
            logits = torch.cat(run.outputs) if all(isinstance(o, torch.Tensor) for o in run.outputs) else run.outputs
        return loss, logits

    # -- execution ------------------------------------------------------------------------------

    def _execute(self, driver: StageDriver, run: _Run, micro_batches: int) -> None:
        if self.reads_data and run.data is None:
            raise ValueError(
                f"pipeline stage {self.stage} reads the data (it holds the first or the last layers): pass "
                "data_iter, an iterator of (inputs, labels) micro-batches, or give initialize() training_data"
            )
        self.comm.begin_run()
        clock = _BusyClock(self.device)
        last = last_backward(run.schedule)
        start = time.perf_counter()
        i = 0
        while i < len(run.schedule):
            ins = run.schedule[i]
            if ins.is_compute:
                with clock.compute():
                    if ins.op is Op.FORWARD:
                        self._forward(driver, run, ins)
                    else:
                        self._backward(driver, run, ins, sync=i == last)
                i += 1
                continue
            j = i
            while j < len(run.schedule) and not run.schedule[j].is_compute:
                j += 1
            batch = run.schedule[i:j]
            received = self.comm.exchange(batch, {b: run.outbox.pop(b) for b in batch if b in run.outbox}, run.training)
            for ins_, payload in received.items():
                op = Op.FORWARD if ins_.op is Op.RECV_ACT else Op.BACKWARD
                run.inbox[Instr(op, ins_.mb, ins_.chunk)] = payload
            i = j
        self.comm.finish_sends()
        busy = clock.total()
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        sent = self.comm.sent_bytes
        self.stats = RunStats(time.perf_counter() - start, busy, micro_batches, self.grid.stages, self.grid.chunks,
                              sent["act"], sent["grad"])  # fmt: skip
        assert not run.inbox and not run.outbox and not run.saved, "a schedule left transfers or activations behind"

    def _batch(self, run: _Run, mb: int) -> tuple[Any, Any]:
        """Micro-batch ``mb``'s ``(inputs, labels)``, read in order from the iterator."""
        while run.read <= mb:
            assert run.data is not None
            try:
                item = next(run.data)
            except StopIteration:
                raise ValueError(f"data_iter ran out after {run.read} micro-batches of this batch") from None
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(
                    "a pipeline's data_iter must yield (inputs, labels) pairs, one per micro-batch "
                    f"(DeepSpeed's convention); got {type(item).__name__}"
                )
            run.batches[run.read] = (item[0], item[1])
            run.read += 1
        return run.batches[mb]

    def _forward(self, driver: StageDriver, run: _Run, ins: Instr) -> None:
        first, last = self.grid.is_first(self.stage, ins.chunk), self.grid.is_last(self.stage, ins.chunk)
        if first:
            inputs = self._batch(run, ins.mb)[0]
            if not last:
                run.batches.pop(ins.mb)  # this stage needs no labels
            received: list[torch.Tensor] = []
        else:
            inputs = run.inbox.pop(ins)
            # The leaves keep the gradients to send back; the chunk gets aliases it may
            # modify in place (see [Note: in-place first layers] in terascale.pipe.p2p).
            received = float_tensors(inputs)
            if run.training:
                inputs = handoff(inputs)
        outputs = driver.forward_chunk(ins.chunk, inputs)
        if last:
            labels = self._batch(run, ins.mb)[1]
            run.batches.pop(ins.mb)
            loss = outputs
            if run.compute_loss and self.loss_fn is not None:
                loss = self.loss_fn(outputs, to_device(labels, self.device))
            if run.keep_outputs:
                run.outputs.append(outputs)
            if run.compute_loss:
                # Evaluating, a model without a loss_fn gives its outputs, averaged as the loss
                # is (DeepSpeed's eval_batch does the same); training needs a scalar.
                if not (isinstance(loss, torch.Tensor) and (loss.dim() == 0 or not run.training)):
                    raise ValueError(
                        "the pipeline's loss must be a scalar tensor: give PipelineModule a loss_fn(outputs, labels) "
                        "or make the last layer return the loss"
                    )
                run.losses.append(loss.detach())
            outputs = loss
        else:
            run.outbox[Instr(Op.SEND_ACT, ins.mb, ins.chunk)] = outputs
        if run.training:
            run.saved[(ins.mb, ins.chunk)] = (received, outputs)

    def _backward(self, driver: StageDriver, run: _Run, ins: Instr, sync: bool) -> None:
        inputs, outputs = run.saved.pop((ins.mb, ins.chunk))
        if self.grid.is_last(self.stage, ins.chunk):
            driver.backward_chunk([outputs], None, sync)
        else:
            grads = run.inbox.pop(ins)
            pairs = [(t, g) for t, g in zip(float_tensors(outputs), grads) if t.requires_grad]
            driver.backward_chunk([t for t, _ in pairs], [g for _, g in pairs], sync)
        if not self.grid.is_first(self.stage, ins.chunk):
            run.outbox[Instr(Op.SEND_GRAD, ins.mb, ins.chunk)] = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs
            ]

    def _mean_loss(self, losses: list[torch.Tensor], micro_batches: int, scalar: bool = True) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, averaged over its data-parallel
        replicas and broadcast from the last stage to every stage. ``scalar=False`` (evaluating):
        the losses may be outputs of any one shape, averaged elementwise; the shape goes first."""
        out = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            out = torch.stack([loss.float() for loss in losses]).sum(0) / micro_batches
            if dist.get_world_size(self.dp_group) > 1:
                ops.all_reduce(out, group=self.dp_group)
                out /= dist.get_world_size(self.dp_group)
        if self.grid.stages > 1:
            src = dist.get_process_group_ranks(self.pp_group)[-1]
            if not scalar:
                shape = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
                if losses:
                    assert out.dim() <= _MAX_DIMS, out.shape
                    shape[0] = out.dim()
                    shape[1 : 1 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
                ops.broadcast(shape, src=src, group=self.pp_group)
                if not losses:
                    out = torch.zeros(shape[1 : 1 + int(shape[0])].tolist(), dtype=torch.float32, device=self.device)
            ops.broadcast(out, src=src, group=self.pp_group)
        return out
