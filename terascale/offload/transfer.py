"""The host step's copies on an accelerator: gradients down, new parameters up, overlapped.

[Note: the host step's transfers]
With ``offload_optimizer`` on a machine with an accelerator, the optimizer steps its runs
on the host ([Note: host Adam]) while the gradient shards and the parameter shards stay
on the device. Done naively, every run copies its gradient pieces to pageable host memory
with a blocking copy, steps, and copies its new values back with another blocking copy:
the device idles through all of it and the copies run at pageable speed. Here the step
is a pipeline over its runs, in the order it steps them:

- **down**: the gradient pieces of run k+1 are copied into a page-locked staging buffer
  on a copy stream of their own (after the compute stream's work so far: the reduced
  gradients), while the host steps run k; the host waits only for the run it steps next;
- **up**: the host step narrows each piece's new values into a page-locked staging buffer
  of the parameters' dtype (per cached chunk, fused with the update), and the copy to the
  device shard is issued on the copy stream at once; the compute stream is made to wait
  for it there (device-side), so whatever reads the shard next (the persistent groups'
  re-gather, the next forward) sees it, and the host goes on to the next run;
- two staging buffers each way (double buffering): a buffer is reused only once the copy
  that last used it has finished (its event);
- **ahead**: on the window's last backward the copy down does not wait for the step. A
  run's gradients are final once the reductions of its groups are done ([Note: reduce
  what a backward touched]), and :class:`GradientsAhead`, told of each final shard,
  starts the run's copy then, into a page-locked buffer of the run's own (kept from
  step to step: the rank's gradient shard once more on the host, as DeepSpeed's
  ZeRO-Offload keeps its fp32 gradients there). The copies run under the rest of
  backward; the step finds them done. Whatever changes a gradient between backward and
  the step (tied gradients summed across pipeline stages, ``safe_set_*_grad``,
  ``zero_grad``) drops the copies made ahead (:meth:`HostStepTransfers.forget_ahead`),
  and the step copies those runs as above.

Nothing in the step blocks but the waits for each run's gradients, whose copies ran
behind the previous run's update. The same code runs on a CPU machine, where torch's
``torch.cpu`` stream and event stand-ins make every wait immediate; the engine uses it
only where the shards and the host are apart (an accelerator), and the tests run it on
the CPU to keep its bookkeeping checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from terascale.offload.host_buffers import aligned_empty


def new_stream(device: torch.device):
    """A stream of ``device``'s own (the CPU's stand-in on a CPU)."""
    module = torch.get_device_module(device)
    return module.Stream(device=device) if device.type != "cpu" else module.Stream()


def current_stream(device: torch.device):
    """The stream work on ``device`` is queued on now (the CPU's stand-in on a CPU)."""
    module = torch.get_device_module(device)
    return module.current_stream(device) if device.type != "cpu" else module.current_stream()


class _Staging:
    """Page-locked (where there is an accelerator) host buffers of one dtype, each with the
    event of the last copy that used it."""

    def __init__(self, count: int, dtype: torch.dtype, pin: bool) -> None:
        self.dtype = dtype
        self.pin = pin
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.events: list[object | None] = [None] * count
        self.next = 0

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        """The next buffer (round robin), at least ``numel`` long, once its last copy is done."""
        k = self.next
        self.next = (k + 1) % len(self.buffers)
        event = self.events[k]
        if event is not None:
            event.synchronize()
            self.events[k] = None
        buf = self.buffers[k]
        if buf is None or buf.numel() < numel:
            buf = self.buffers[k] = aligned_empty(numel, self.dtype, pin_memory=self.pin)
        return k, buf[:numel]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)


class HostStepTransfers:
    """The copies of one rank's host optimizer step (see [Note: the host step's transfers]).

    Use per step: :meth:`begin` with the runs in the order they will be stepped and a
    function giving a run's device gradient pieces; then, for each run in that order,
    :meth:`host_grads` (its gradients on the host), :meth:`outputs` (host buffers the step
    writes the new parameter values into) and :meth:`upload` (send them to the shards);
    :meth:`finish` at the end. The staging buffers are kept from step to step.
    """

    def __init__(self, device: torch.device, *, pin_memory: bool, grad_dtype: torch.dtype, param_dtype: torch.dtype) -> None:
        self.device = device
        self._module = torch.get_device_module(device)
        self._stream = new_stream(device)
        self._down = _Staging(2, grad_dtype, pin_memory)
        self._up = _Staging(2, param_dtype, pin_memory)
        self._after: dict[tuple[int, ...], tuple[int, ...]] = {}  # run -> the run stepped after it
        self._grads_of: Callable[[list[int]], list[torch.Tensor]] | None = None
        self._pending: dict[tuple[int, ...], tuple[list[torch.Tensor], object]] = {}
        self._staged: dict[tuple[int, ...], tuple[int, list[torch.Tensor]]] = {}
        # Copies started under backward ("ahead"), and each run's own buffer for them.
        self._ahead: dict[tuple[int, ...], tuple[list[torch.Tensor], object]] = {}
        self._ahead_buffers: dict[tuple[int, ...], torch.Tensor] = {}
        self._pin = pin_memory
        self._grad_dtype = grad_dtype
        self.ahead_runs = 0  # runs the last step found copied ahead (for tests and benchmarks)

    @property
    def active(self) -> bool:
        """Whether a step is under way (between :meth:`begin` and :meth:`finish`)."""
        return self._grads_of is not None

    @staticmethod
    def needed(device: torch.device) -> bool:
        """Whether the shards on ``device`` are apart from the host (an accelerator)."""
        return device.type != "cpu"


    # -- a step ----------------------------------------------------------------------------

    def begin(self, order: Sequence[Sequence[int]], grads_of: Callable[[list[int]], list[torch.Tensor]]) -> None:
        """The step will step ``order``'s runs in that order; start the first run's copy down."""
        assert not self._pending and not self._staged, "finish() the previous step first"
        runs = [tuple(r) for r in order]
        self._after = dict(zip(runs, runs[1:]))
        self._grads_of = grads_of
        self._pending, self._ahead = self._ahead, {}  # copied under backward: nothing to start
        self.ahead_runs = len(self._pending)
        self._stream.wait_stream(current_stream(self.device))  # the reduced gradients are written before this
        if runs and runs[0] not in self._pending:
            self._download(runs[0])

    def host_grads(self, run: Sequence[int]) -> list[torch.Tensor]:
        """Run ``run``'s gradient pieces on the host (waiting for their copy); the next
        run's copy starts before this returns."""
        key = tuple(run)
        if key not in self._pending:
            self._download(key)
        after = self._after.get(key)
        if after is not None and after not in self._pending:
            self._download(after)
        views, event = self._pending.pop(key)
        event.synchronize()
        return views

    def outputs(self, run: Sequence[int], numels: Sequence[int]) -> list[torch.Tensor]:
        """Host buffers for run ``run``'s new parameter values (pieces of ``numels``)."""
        k, buf = self._up.take(sum(numels))
        views, at = [], 0
        for n in numels:
            views.append(buf[at : at + n])
            at += n
        self._staged[tuple(run)] = (k, views)
        return views

    def upload(self, run: Sequence[int], destinations: Sequence[torch.Tensor]) -> None:
        """Copy run ``run``'s :meth:`outputs` into ``destinations`` (device shard slices),
        non-blocking; the compute stream waits for the copies device-side."""
        k, views = self._staged.pop(tuple(run))
        with self._module.stream(self._stream):
            for src, dst in zip(views, destinations):
                dst.copy_(src, non_blocking=True)
        event = self._event()
        self._up.events[k] = event
        current_stream(self.device).wait_event(event)

    def download_ahead(self, run: Sequence[int], pieces: Sequence[torch.Tensor]) -> None:
        """Start copying run ``run``'s final gradient ``pieces`` down now, under backward,
        into the run's own buffer; the next :meth:`begin` takes the copy over."""
        key = tuple(run)
        dropped = self._ahead.pop(key, None)
        if dropped is not None:  # copied ahead once already: its buffer is written again
            dropped[1].synchronize()
        numel = sum(p.numel() for p in pieces)
        buf = self._ahead_buffers.get(key)
        if buf is None or buf.numel() != numel:
            buf = self._ahead_buffers[key] = aligned_empty(numel, self._grad_dtype, pin_memory=self._pin)
        self._stream.wait_stream(current_stream(self.device))  # after the reduction's last work
        self._ahead[key] = (self._copy_into(buf, pieces), self._event())

    def forget_ahead(self) -> None:
        """Drop the copies made ahead (the gradients changed since): the step copies again."""
        for _views, event in self._ahead.values():
            event.synchronize()  # their buffers may be written again
        self._ahead.clear()

    def finish(self) -> None:
        """End the step: nothing left in flight that the host must wait for (uploads are
        ordered before the compute stream's next work by :meth:`upload`)."""
        for _views, event in self._pending.values():  # read ahead for a run not stepped
            event.synchronize()
        self._pending.clear()
        assert not self._staged, "a run's outputs were never uploaded"
        self._after, self._grads_of = {}, None

    def nbytes(self) -> int:
        """Host bytes of the staging buffers."""
        ahead = sum(b.numel() * b.element_size() for b in self._ahead_buffers.values())
        return self._down.nbytes() + self._up.nbytes() + ahead

    def pinned(self) -> bool:
        """Whether every staging buffer made so far is page-locked."""
        staging = [b for st in (self._down, self._up) for b in st.buffers if b is not None]
        return all(b.is_pinned() for b in staging + list(self._ahead_buffers.values()))

    # -- internals -------------------------------------------------------------------------

    def _event(self):
        """An event marking the copy stream's work so far."""
        event = self._module.Event()
        event.record(self._stream)
        return event

    def _download(self, run: tuple[int, ...]) -> None:
        assert self._grads_of is not None, "begin() first"
        pieces = self._grads_of(list(run))
        k, buf = self._down.take(sum(p.numel() for p in pieces))
        views = self._copy_into(buf, pieces)
        event = self._event()
        self._down.events[k] = event
        self._pending[run] = (views, event)

    def _copy_into(self, buf: torch.Tensor, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy ``pieces`` back to back into host buffer ``buf`` on the copy stream."""
        views, at = [], 0
        with self._module.stream(self._stream):
            for p in pieces:
                view = buf[at : at + p.numel()].view(p.shape)
                view.copy_(p, non_blocking=True)
                views.append(view)
                at += p.numel()
        return views


class GradientsAhead:
    """Starts each host run's gradient copy as soon as its groups' shards are final on the
    window's last backward (see [Note: the host step's transfers]): the
    :class:`~terascale.zero.grads.FinalGradients` listener of the gradients while armed.

    ``runs`` are the runs stepped on the host, ``pieces`` every piece's ``(group, lo, hi)``
    in its group's gradient shard."""

    def __init__(self, transfers: HostStepTransfers, runs: Sequence[Sequence[int]], pieces: Sequence[tuple[int, int, int]]) -> None:
        self.transfers = transfers
        self.runs = [list(r) for r in runs]
        self._pieces = pieces
        self._groups = [sorted({pieces[i][0] for i in run}) for run in self.runs]
        self._runs_of: dict[int, list[int]] = {}
        for r, groups in enumerate(self._groups):
            for g in groups:
                self._runs_of.setdefault(g, []).append(r)
        self._final: dict[int, torch.Tensor] = {}

    def arm(self) -> None:
        """The window's last backward starts: no shard of it is final yet."""
        self.forget()

    def forget(self) -> None:
        """The gradients changed (or are dropped) after their copies started: forget them."""
        self._final.clear()
        self.transfers.forget_ahead()

    def receive(self, g: int) -> torch.Tensor | None:
        return None  # shards that go to disk are not copied ahead

    def final(self, g: int, shard: torch.Tensor) -> None:
        self._final[g] = shard
        for r in self._runs_of.get(g, ()):
            if all(h in self._final for h in self._groups[r]):
                run = self.runs[r]
                parts = [self._final[grp][lo:hi] for grp, lo, hi in (self._pieces[i] for i in run)]
                self.transfers.download_ahead(run, parts)

    def poll(self) -> None:
        pass
