"""The host optimizer step run behind the next micro-steps: one step of parameter staleness.

[Note: the overlapped host step]
With ``offload_optimizer`` the update is the host's work (or the disk's, on NVMe), and the
device waits for it at every boundary ([Note: host Adam], [Note: optimizer swapping]).
With ``zero_optimization.offload_optimizer.overlap_step`` (the name of ZenFlow's switch
for the same thing) ``engine.step()`` does not wait: it hands this window's gradients to
a background thread that steps the masters on the host while the device runs the next
window's forwards and backwards, on parameters one step old. That is ZeRO-Offload's
delayed parameter update (DPU). Written out, with ``p`` the masters and ``g_t`` the
gradients of window t:

    window t computes g_t on the parameters the model holds: p_{t-2}
    engine.step() of window t:  wait for the host step of t-1, install p_{t-1} into the
                                parameter shards (re-gathering the persistent groups),
                                then start p_t = update(p_{t-1}, g_t) in the background

so each update is applied to the newest masters with a gradient one step older. The first
window is computed on p_0, like the second. The rules that keep this exact and safe:

- **Nothing is shared with the running model.** The step takes the window's gradient
  shards over at ``engine.step()``, without a copy where it can: gradient swap files
  ([Note: gradient swapping]) come in two sets, one window writing one while the step
  reads the other; shards in host memory (a CPU device, stages 2-3) are exchanged with
  the storage the last step held; otherwise (an accelerator, or stage 1's views of the
  full buffers) they are copied to a host buffer, on an accelerator behind the next
  forward on a copy stream, and the next backward waits for that copy before it writes
  the shards again. The new values are narrowed into host staging buffers of the
  parameters' dtype, fused with the update, and copied into the shards (or their tier)
  at the next boundary, by the training thread; a shard in a swap file ([Note: parameter
  offload]) has a second file instead, which the step writes while the window's gathers
  read the first, and the boundary switches the two. Masters never alias the shards.
- **The checks come first.** Clipping's norm, fp16's overflow check and the non-finite
  policy look at this window's gradients, which are complete at ``engine.step()``: they
  are decided there, before anything starts, so a step that fails them is never started
  and nothing needs rolling back (a skipped step leaves the previous update pending until
  the next boundary that steps). Speculation only pays where the update starts before the
  gradients are complete ([Note: the optimizer step under backward]).
- **Options are the boundary's.** The background step uses a snapshot of the optimizer's
  param-group options (learning rate, betas, ...) taken at ``engine.step()``, before the
  LR scheduler changes them for the next step, so the update is the one a synchronous
  ``engine.step()`` would take with the same gradients and masters.
- **Collectives stay in the training thread**: the re-gathers run at install; the
  background thread touches only the masters, the optimizer state and their swap files.
- **Whatever reads the state waits.** A checkpoint save or load and the full parameters
  (``save_16bit_model``, ``GatheredParameters``, the consolidated state dict) first finish
  the pending update and install it (a collective, on every rank, as those calls are):
  they see the newest parameters, and the next forward uses them too, so a run that saves
  and the run resumed from its checkpoint continue alike. (``remove_hooks`` only waits:
  the state is going away.)
  The module's own ``state_dict()`` at stages 1-2 is not such a point: it reads the
  parameters the model holds, one update behind.

The trajectory is deterministic (the same inputs give the same bits whatever the timing)
and differs from the synchronous one only by the delay. What it costs: a second set of
this rank's gradient shards (in memory, or their second swap files) and the staged new
parameters of its shards in memory (on disk: their second files, written from two run
buffers); 6 bytes per element of a shard in memory with fp32 gradients and bf16
parameters. The memory planner counts them.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import psutil
import torch
import torch.distributed as dist

from terascale.comm import ops
from terascale.offload.host_buffers import ALIGNMENT, aligned_empty, round_up
from terascale.offload.policy import can_pin_memory
from terascale.offload.transfer import HostStepTransfers, current_stream, new_stream
from terascale.zero.run_step import Regathers, RunStep

if TYPE_CHECKING:
    from terascale.offload.grads import GradSwapper
    from terascale.offload.params import OffloadedParams
    from terascale.zero.masters import Piece
    from terascale.zero.sharded import ShardedState


logger = logging.getLogger("terascale")

class OverlappedStep:
    """``state``'s optimizer step, run in a background thread behind the next window (see
    the note). :meth:`step` at each boundary; :meth:`settle` before anything reads the
    state; :meth:`before_backward` as each backward starts. ``grad_files``: where the
    gradient shards go to swap files, a second set for the window after the one stepped.
    The first ``warmup`` steps are installed at once, as the synchronous step would."""

    def __init__(self, state: ShardedState, grad_files: GradSwapper | None = None, warmup: int = 0) -> None:
        self.state = state
        self.warmup = warmup  # steps installed at once (synchronous) before the overlap starts
        masters = state.masters
        assert not any(masters.shares_storage), "overlapped masters alias the parameter shards"
        self._pieces = masters.pieces
        params = state.params
        # Groups whose shards live in swap files: the update writes their second files, unless
        # their new values fit easily in host memory (a quarter of what is available now).
        # Staged in memory they are written at the boundary and kept as the next forward's
        # fetches ([Note: staged shards]); in second files the forward reads them all back
        # (on the 16.8M GPT of bench/step_time.py at stage 3 all on NVMe: 527 ms a step
        # against 368 ms staged in memory).
        on_disk = sorted({p.group for p in self._pieces if params is not None and params.on_disk(p.group)})
        staged = sum((p.hi - p.lo) * state.groups[p.group].dtype.itemsize for p in self._pieces if p.group in on_disk)
        if staged <= host_room():
            on_disk = []
        self._files = NextShardFiles(params, on_disk, self._pieces) if on_disk else None
        if on_disk and dist.get_rank() == 0:
            logger.warning(
                "zero_optimization.offload_optimizer.overlap_step: the update's new parameter values (%.1f GB on "
                "this rank) exceed a quarter of the available host memory, so it writes them into second swap "
                "files, which every forward then reads back: where the disk bounds the step this is slower than "
                "the synchronous step (measured 2.68x against 1.36x the disk floor on a 4B model, bench/RESULTS.md)",
                staged / 1e9,
            )
        in_memory = [i for i, p in enumerate(self._pieces) if self._files is None or p.group not in self._files.groups]
        self._offsets, total = {}, 0
        for i in in_memory:
            self._offsets[i], total = total, total + self._pieces[i].hi - self._pieces[i].lo
        # Copies to and from the host on a stream of their own where the shards are apart
        # from it (the same switch as the host step's transfers; the CPU's stand-ins in tests).
        self._module = torch.get_device_module(state.device)
        apart = HostStepTransfers.needed(state.device)
        self._copies = new_stream(state.device) if apart else None
        pin = can_pin_memory() and apart
        # This window's gradients: in swap files (``grad_files``, exchanged with the next
        # window's); where the shards are host memory already (a CPU device, stages 2-3) the
        # shards themselves, exchanged with the storage the last step held; else a copy.
        self._grad_files = grad_files
        self._grad_at = [0]  # piece i's place in the gradient copy: [_grad_at[i], _grad_at[i + 1])
        for p in self._pieces:
            self._grad_at.append(self._grad_at[-1] + p.hi - p.lo)
        numel = self._grad_at[-1]
        self._grads = aligned_empty(numel, state.options.grads.dtype, pin_memory=pin) if apart and grad_files is None else None
        self._held: list[torch.Tensor | None] = [None] * len(state.groups)  # shards taken over
        self._piece_grads: list[torch.Tensor] | None = None  # None: read from grad_files
        param_dtype = state.groups[0].dtype if state.groups else torch.float32
        self._values = aligned_empty(total, param_dtype, pin_memory=pin)  # new parameters of shards in memory
        self._piece_at = {(p.group, p.lo): i for i, p in enumerate(self._pieces)}
        self._down: object | None = None  # the event of the gradient copy to the host
        self._up: object | None = None  # the event of the last install's copies to the device
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.steps = 0  # background steps started
        self._warm = False  # past the warm-up (for good: counts only grow)
        self.blocked_s = 0.0  # seconds the training thread waited for a background step

    # -- the views a run steps with --------------------------------------------------------------

    def _grad_view(self, i: int) -> torch.Tensor:
        return self._grads[self._grad_at[i] : self._grad_at[i + 1]]

    def _output(self, i: int) -> torch.Tensor:
        """Where piece ``i``'s new values go: the staging buffer of shards in memory, or the
        piece's place in the buffer its next file is written from."""
        if i not in self._offsets:
            return self._files.view(i)
        at = self._offsets[i]
        return self._values[at : at + self._pieces[i].hi - self._pieces[i].lo]

    def _stage(self, group: int, lo: int, values: torch.Tensor) -> None:
        """A master written out whole (an optimizer without a fused host step): narrowed
        into its staging place, not into the live shard."""
        self._output(self._piece_at[(group, lo)]).copy_(values)

    # -- the boundary ---------------------------------------------------------------------------

    @property
    def copies_apart(self) -> bool:
        """Whether gradients and parameters go through host buffers on a copy stream (the
        shards apart from the host), not by exchanging the shards in place."""
        return self._copies is not None

    @property
    def second_files(self) -> int:
        """How many groups' shards the update writes into second swap files."""
        return 0 if self._files is None else len(self._files.groups)

    @property
    def pending(self) -> bool:
        """Whether an update has been started and not installed yet."""
        return self._thread is not None

    def step(self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor) -> None:
        """``engine.step()``: install the previous update, start this window's."""
        self.settle()
        warming = self._warming_up(optimizer)
        self._start(optimizer, multiplier)
        if warming:  # the update goes in now, as the synchronous step's would
            self.settle()

    def _warming_up(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the update about to start is one of the first ``warmup``: counted by the
        optimizer's own step count (so a resumed run warms up as the run it resumes did),
        the same on every rank (the install is collective); the process's own count for an
        optimizer that keeps none (SGD)."""
        if self._warm or self.warmup == 0:
            return False
        masters = self.state.masters.masters
        count = optimizer.state.get(masters[0], {}).get("step") if masters else None
        taken = torch.tensor([-1.0 if count is None else float(count)], device=self.state.device)
        dist.all_reduce(taken, op=dist.ReduceOp.MAX, group=self.state.group)
        updates = self.steps if taken.item() < 0 else int(taken.item())
        self._warm = updates >= self.warmup
        return not self._warm

    def settle(self) -> None:
        """Finish the pending update, if any, and install it (collective: every rank)."""
        if self._thread is None:
            return
        started = time.perf_counter()
        with ops.named_range("terascale::overlapped step wait"):
            self._thread.join()
        self.blocked_s += time.perf_counter() - started
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                "the optimizer step running behind the last window (zero_optimization.offload_optimizer."
                f"overlap_step) failed: {error}"
            ) from error
        self._install()

    def before_backward(self) -> None:
        """A backward starts: it writes the gradient shards the last copy to the host read
        (an accelerator: the compute stream waits for that copy there, on the device)."""
        if self._down is not None and self._copies is not None:
            current_stream(self.state.device).wait_event(self._down)

    def _install(self) -> None:
        """The update's new values into the parameter shards (or their tier: shards in swap
        files switch to the files it wrote); the persistent groups re-gathered behind them."""
        state = self.state
        params = state.params
        if params is not None:
            if self._files is not None:
                params.switch_files(self._files.groups)  # settles too: drops what was read of the old files
            else:
                params.settle()
        for i in self._offsets:
            p, values = self._pieces[i], self._output(i)
            if params is not None:
                params.write_piece(p.group, p.lo, values)
            else:
                state.groups[p.group].shard[p.lo : p.hi].copy_(values, non_blocking=self._copies is not None)
        if self._copies is not None:  # the next update writes the staging buffers after these copies
            self._up = self._module.Event()
            self._up.record(current_stream(self.state.device))
        if params is not None:
            params.finish_step()
        regathers = Regathers(state.groups, state.options.allgather_bucket_numel)
        regathers.finish()
        state.invalidate_secondaries()

    def _start(self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor) -> None:
        state = self.state
        grad_files = None
        if self._grad_files is not None:  # the window's gradient files are the step's now
            # (given back as the next window's at the next exchange, once this step is done)
            grad_files = self._grad_files = state.grads.exchange_swapper(self._grad_files)
            multiplier, _ = self._copy_to_host(multiplier, [])
            self._piece_grads = None
        elif self._copies is None and (taken := state.grads.exchange_shards(self._held)) is not None:
            self._held = taken  # the window's shards are the step's now
            self._piece_grads = state.masters.grad_pieces(taken)
        else:
            multiplier, self._piece_grads = self._copy_to_host(multiplier, state.masters.grad_pieces(state.grads.shards))
        swapper = state.swapper
        swapped = set() if swapper is None else {i for run in swapper.runs for i in run}
        order = [*([] if swapper is None else swapper.runs), *(r for r in state.masters.sub_groups() if r[0] not in swapped)]
        self._thread = threading.Thread(
            target=self._run, args=(_with_options_now(optimizer), multiplier, order, grad_files),
            name="terascale-overlapped-step", daemon=True,
        )  # fmt: skip
        self.steps += 1
        self._thread.start()

    def _copy_to_host(
        self, multiplier: torch.Tensor, pieces: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The multiplier and the window's gradient pieces copied to the host (on an
        accelerator on the copy stream, after what the compute stream has queued: the
        reductions; reading them in the background thread on the default stream would
        wait for the next forward queued meanwhile too)."""
        if self._grads is None and pieces:
            self._grads = aligned_empty(self._grad_at[-1], self.state.options.grads.dtype)
        views = [self._grad_view(i) for i in range(len(pieces))]
        if self._copies is None:
            for view, g in zip(views, pieces):
                view.copy_(g)
            return multiplier.cpu(), views
        self._copies.wait_stream(current_stream(self.state.device))
        host = torch.empty((), dtype=multiplier.dtype, pin_memory=can_pin_memory())
        with self._module.stream(self._copies):
            host.copy_(multiplier, non_blocking=True)
            for view, g in zip(views, pieces):
                view.copy_(g, non_blocking=True)
            self._down = self._module.Event()
            self._down.record(self._copies)
        return host, views

    def _run(
        self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor, order: Sequence[list[int]],
        grad_files: GradSwapper | None,
    ) -> None:  # fmt: skip
        """The background thread: every run stepped (in ``order``: the swapped runs first),
        its new values staged or written to the next files."""
        reader = None
        try:
            with torch.no_grad():
                for event in (self._down, self._up):
                    if event is not None:
                        event.synchronize()
                if grad_files is not None:  # each run's gradients read one run ahead
                    pieces = self._pieces
                    reader = grad_files.reader([[(pieces[i].group, pieces[i].lo, pieces[i].hi) for i in r] for r in order])
                    index = {run[0]: k for k, run in enumerate(order)}
                    grads_of = lambda run: reader.get(index[run[0]])  # noqa: E731
                else:
                    grads_of = lambda run: [self._piece_grads[i] for i in run]  # noqa: E731
                step_run = RunStep(
                    self.state.masters, optimizer, multiplier, grads_of, write=self._stage, offloaded=True,
                    precision=self.state.options.masters, rounding=self.state.rounding, transfers=None,
                    outputs=self._output,
                )  # fmt: skip

                def step_and_write(run: list[int]) -> None:
                    if self._files is not None:
                        self._files.begin(run)
                    step_run(run)
                    if self._files is not None:
                        self._files.write(run)

                swapper = self.state.swapper
                if swapper is not None:
                    swapper.step(optimizer, step_and_write)
                for run in order[0 if swapper is None else len(swapper.runs) :]:
                    step_and_write(run)
                if self._files is not None:
                    self._files.finish()
        except BaseException as error:  # re-raised in the training thread by settle()
            self._error = error
        finally:
            if reader is not None:
                reader.close()

    def nbytes_in_memory(self) -> int:
        """Host bytes of the gradients the step holds (a copy, or shards taken over), the
        staged parameters and the buffers the next files are written from."""
        held = [t for t in (self._grads, self._values, *self._held) if t is not None]
        files = 0 if self._files is None else self._files.nbytes_in_memory()
        grads = 0 if self._grad_files is None else self._grad_files.nbytes_in_memory()
        return sum(t.numel() * t.element_size() for t in held) + files + grads

    def nbytes_on_disk(self) -> int:
        """Bytes of the second set of gradient files (the parameter tier counts its own)."""
        return 0 if self._grad_files is None else self._grad_files.nbytes_on_disk()

    def close(self) -> None:
        """Wait for a running update (its values are not installed: the state is going away);
        remove the second gradient files."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._error = None
        if self._grad_files is not None:
            self._grad_files.close()


class NextShardFiles:
    """The update's new values of shards in swap files, written into each group's second
    file ([Note: the overlapped host step]) from two aligned buffers in turn: run by run,
    each piece placed as misaligned as its offset in the file, so all of it but an
    unaligned head and tail is written ``O_DIRECT``. Used by the background thread only."""

    def __init__(self, params: OffloadedParams, groups: Sequence[int], pieces: Sequence[Piece]) -> None:
        self.params = params
        self.groups = list(groups)
        self._on_disk = set(self.groups)
        self._pieces = pieces
        params.add_second_files(self.groups)
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._writes: list[list] = [[], []]
        self._turn = 0
        self._views: dict[int, torch.Tensor] = {}

    def begin(self, run: Sequence[int]) -> None:
        """Place run ``run``'s pieces of on-disk groups in the next buffer (once its last writes are done)."""
        k = self._turn
        for handle in self._writes[k]:
            handle.wait()
        self._writes[k] = []
        pieces = self._disk_pieces(run)
        need = sum(ALIGNMENT + (p.hi - p.lo) * self._itemsize(p.group) for _, p in pieces)
        if self._buffers[k] is None or self._buffers[k].numel() < need:
            self._buffers[k] = aligned_empty(need, torch.uint8)
        buf, at = self._buffers[k], 0
        self._views = {}
        for i, p in pieces:
            size = self._itemsize(p.group)
            offset = p.lo * size
            at = round_up(at) + offset % ALIGNMENT
            self._views[i] = buf[at : at + (p.hi - p.lo) * size].view(self.params.groups[p.group].dtype)
            at += (p.hi - p.lo) * size

    def view(self, i: int) -> torch.Tensor:
        return self._views[i]

    def write(self, run: Sequence[int]) -> None:
        """Start writing run ``run``'s placed pieces into their groups' next files."""
        k = self._turn
        for i, p in self._disk_pieces(run):
            values = self._views[i]
            data = values.view(torch.uint8)
            self._writes[k].append(self.params.aio.write(data, self.params.next_file(p.group), p.lo * values.element_size()))
        self._turn = 1 - k

    def finish(self) -> None:
        """Wait for every write (raising a failed one)."""
        for k in (0, 1):
            for handle in self._writes[k]:
                handle.wait()
            self._writes[k] = []

    def _disk_pieces(self, run: Sequence[int]) -> list[tuple[int, Piece]]:
        pieces = self._pieces
        return [(i, pieces[i]) for i in run if pieces[i].group in self._on_disk]

    def _itemsize(self, g: int) -> int:
        return self.params.groups[g].dtype.itemsize

    def nbytes_in_memory(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)


def host_room() -> float:
    """Bytes of new parameter values the update may stage in host memory: a quarter of
    what is available."""
    return psutil.virtual_memory().available / 4


def _with_options_now(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` with its param groups' options as they are now: the same object in all
    but its ``param_groups``, copies of them (sharing the parameter lists) that the LR
    scheduler, changing the originals for the next step, does not touch. State, defaults
    and hooks are shared."""
    shadow = copy.copy(optimizer.__dict__)
    # A torch LR scheduler wraps ``step`` on the instance, bound to the original (whose
    # param groups it would read): the class's own step is the one to take.
    shadow.pop("step", None)
    view = object.__new__(type(optimizer))
    view.__dict__.update(shadow)
    view.param_groups = [dict(group) for group in optimizer.param_groups]
    return view
