"""The optimizer step under backward: each optimizer run stepped as soon as its gradients are final.

[Note: the optimizer step under backward]
With the optimizer state on NVMe the step is bound by the disk: every run's masters and
moments are read, updated and written back ([Note: optimizer swapping]). After backward
that is all the step has left to do, while through the second half of backward the disk
sat idle (``bench/RESULTS.md``, issue 18). Yet a run's update needs only its own
gradients, and on the window's last backward the gradient shard of a group is final as
soon as its last reduce-scatter completes ([Note: reduce what a backward touched]):
nothing changes it after that, and an elementwise optimizer gives the same update
whenever it runs. So with ``zero_optimization.offload_optimizer.step_in_backward`` the
runs are stepped during the window's last backward, in the order their gradients
become final (the groups in backward's reduction order, last group first; a group's
runs in their own order):

- the swap files of the runs are read ahead in that order from the start of the last
  backward; a run is stepped at the first gradient hook after its gradients are final
  *and* its read has finished, so backward never waits for the disk, except when the final
  gradient shards waiting in memory for their runs would outgrow two groups' (then it
  steps the next run, waiting for its read: the disk is busy anyway);
- the stepped run is written back behind, and its new parameter values go to the
  parameter shards (or their NVMe files, [Note: staged shards]) at once;
- gradient shards that would be swapped to disk ([Note: gradient swapping]) are handed
  to the optimizer from memory on the last micro-step instead: the write and the
  step's read of them are gone (earlier micro-steps of a window still accumulate on disk).

``engine.step()`` then does what is left: the runs not stepped yet (blocking, as the step
did before), the re-gathers of persistent groups, the LR scheduler and the counters. The
update is the step's bit for bit: the same gradients and multiplier, the learning rate
and options ``engine.step()`` would use (checked there: changing them in between is an
error), and an elementwise update of each run on its own.

It applies only where nothing is decided about the update after backward, which the
engine checks at ``initialize`` (``"auto"``: on where allowed; ``true``: an error naming
what is in the way; ``false``: off): ZeRO stage 2 or 3 (gradients reduced during
backward) with ``offload_optimizer.device: nvme``; no ``gradient_clipping`` (its
coefficient needs the global norm of all gradients), no fp16 (its overflow check decides
after backward whether the step is taken, with a static loss scale too), no
``health.non_finite`` policy; an optimizer stepped run by run (Adam, AdamW, SGD, compact
states, ...), not Lamb, whose trust ratios need whole-parameter norms over all runs; no
layers tied across pipeline stages (their gradients are summed after backward). Within a
window it steps only the runs whose groups the last backward reduces (a pipeline with
virtual stages may leave some to the window's end): ``engine.step()`` steps the others.

Writing a run's new values under backward (into a stage-2 group's gathered buffer, a
stage-3 shard or its file) is safe because a group's gradient is final only after
autograd accumulated the gradients of all its parameters, which it does after every node
that uses them has run, and because a group holds only trainable or only frozen
parameters (the group plan splits them, ``terascale/zero/wrap.py``): nothing left in
backward reads the buffer written (unless a model reads a parameter's value in
backward behind autograd's back, e.g. a ``.detach()``-ed copy used after the parameter's
gradient is done: set ``step_in_backward`` to false for such a model).

Between the window's last backward and ``engine.step()`` the update has happened and the
gradients are consumed, so whatever reads or changes them then raises and says so
(DeepSpeed's ``safe_get_full_grad``/``safe_get_full_fp32_param``/``safe_set_*``, a
checkpoint save, ``GatheredParameters``, ``engine.zero_grad()``). The gradient norm
still works (``engine.window_grad_norm()``): it is taken from the shards as they become
final.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from terascale.offload.host_buffers import aligned_empty

if TYPE_CHECKING:
    from terascale.zero.sharded import ShardedState

# Final gradient shards a window may hold in memory waiting for their runs, in groups.
HELD_GROUPS = 2


class EarlyStep:
    """Steps ``state``'s optimizer runs under the window's last backward (see the note).

    ``begin()`` is called when a window arms it (the window's last backward starts): the
    engine lets go of anything reading the state (a background checkpoint write) and
    returns the gradient multiplier of the update (1 / the static loss scale).
    It is the :class:`~terascale.zero.grads.FinalGradients` listener of ``state.grads``
    while armed.
    """

    def __init__(
        self, state: ShardedState, optimizer: torch.optim.Optimizer, begin: Callable[[], torch.Tensor]
    ) -> None:
        self.state = state
        self.optimizer = optimizer
        self._begin = begin
        masters = state.masters
        self.runs = masters.runs
        self._groups = [sorted({masters.pieces[i].group for i in run}) for run in self.runs]
        self._runs_of: dict[int, list[int]] = {}
        for r, groups in enumerate(self._groups):
            for g in groups:
                self._runs_of.setdefault(g, []).append(r)
        swapper = state.swapper
        self._swap_index = {} if swapper is None else {run[0]: k for k, run in enumerate(swapper.runs)}
        # Writing a persistent group's new values changes its gathered buffer under backward:
        # right only if nothing left in backward reads it (see the note).
        assert all(all(k >= 0 for k in plan.opt_group) or all(k < 0 for k in plan.opt_group) for plan in state.plans), (
            "a group mixes trainable and frozen parameters"
        )
        grads = state.grads.swapper
        largest = 0 if grads is None else max(grads.shard_numel, default=0) * grads.dtype.itemsize
        self._held_limit = float("inf") if grads is None else HELD_GROUPS * largest
        # Memory for handed-over shards, kept from window to window (filling fresh memory
        # costs its page faults every time): up to one group more than are held.
        self._spare: list[torch.Tensor] = []
        self._spare_limit = (HELD_GROUPS + 1) * largest
        self._disarm()

    def _disarm(self) -> None:
        self.armed = False
        self.stepped = 0  # runs stepped under this window's backward
        self._queue: list[int] = []  # runs to step under backward, in order
        self._done: set[int] = set()
        self._takes: frozenset[int] = frozenset()
        self._needed: dict[int, int] = {}  # group -> runs of the queue still needing its gradient
        self._final: dict[int, torch.Tensor] = {}  # group -> its final gradient shard, while needed
        self._received: set[int] = set()  # groups whose shard is ours (handed over instead of swapped)
        self._multiplier: torch.Tensor | None = None
        self._options: list[dict[str, Any]] | None = None
        self._step_run: Callable[[list[int]], None] | None = None
        if self.state.grads.listener is self:
            self.state.grads.listener = None

    # -- the window's last backward ------------------------------------------------------------

    def arm(self, scope: Sequence[int]) -> list[int] | None:
        """The window's last backward starts; it reduces groups ``scope`` in that order.
        Plan the runs it steps and return the order to read the swapped runs in (None when
        it steps none: the step after backward does everything, as without this)."""
        if self.armed:
            raise RuntimeError(
                "a backward after the last backward of an accumulation window, before engine.step(): the "
                "optimizer steps under the window's last backward (zero_optimization.offload_optimizer."
                "step_in_backward), so call engine.step() after it (or set step_in_backward to false)"
            )
        position = {g: k for k, g in enumerate(scope)}
        runs = {r for r, groups in enumerate(self._groups) if all(g in position for g in groups)}
        # A group's gradient skips the disk only if every run holding it is stepped here.
        while True:
            takes = {g for g in position if all(r in runs for r in self._runs_of.get(g, []))}
            kept = {r for r in runs if all(g in takes for g in self._groups[r])}
            if kept == runs:
                break
            runs = kept
        if not runs:
            return None
        self._queue = sorted(runs, key=lambda r: (max(position[g] for g in self._groups[r]), r))
        self._takes = frozenset(takes)
        for r in self._queue:
            for g in self._groups[r]:
                self._needed[g] = self._needed.get(g, 0) + 1
        self._multiplier = self._begin()
        self._options = _options(self.optimizer)
        self._step_run = self.state.stepping.run_stepper(self.optimizer, self._multiplier, self._grads_of)
        self.armed = True
        self.state.grads.listener = self
        if self.state.params is not None:
            self.state.params.begin_writes_under_backward()
        early = self._swap_order()
        first = set(early)
        return early + [k for k in range(len(self._swap_index)) if k not in first]

    def receive(self, g: int) -> torch.Tensor | None:
        """A tensor for group ``g``'s final gradient shard if it is handed over instead of
        swapped to disk (``FinalGradients``), else None."""
        if not self.armed or g not in self._takes:
            return None
        swapper = self.state.grads.swapper
        assert swapper is not None
        numel = swapper.shard_numel[g]
        for k, t in enumerate(self._spare):
            if t.numel() == numel:
                return self._spare.pop(k)
        # As the swapper's own buffers: on huge pages, so that filling it faults few pages.
        return aligned_empty(numel, swapper.dtype)

    def final(self, g: int, shard: torch.Tensor) -> None:
        """Group ``g``'s gradient shard is final: step the runs that are ready."""
        if self.armed and self._needed.get(g):
            self._final[g] = shard
            if self.state.grads.swapper is not None:
                self._received.add(g)
            self.poll()

    def poll(self) -> None:
        """Step the next runs whose gradients are final and whose reads are done (or
        whose reads are needed to free held gradients); keep reads going ahead."""
        if not self.armed:
            return
        swapper = self.state.swapper
        while self._queue and all(g in self._final for g in self._groups[self._queue[0]]):
            k = self._swap_index.get(self.runs[self._queue[0]][0])
            if k is not None and not swapper.read_done(k) and self._held_bytes() <= self._held_limit:
                break
            self._step_next()
        if swapper is not None and self._queue:
            swapper.prefetch(self._swap_order())

    def _step_next(self) -> None:
        r = self._queue.pop(0)
        run = self.runs[r]
        k = self._swap_index.get(run[0])
        if k is None:
            self._step_run(run)
        else:
            ahead = self._swap_order()[:1]
            self.state.swapper.step_one(k, self.optimizer, self._step_run, ahead)
        self._done.add(r)
        self.stepped += 1
        for g in self._groups[r]:
            self._needed[g] -= 1
            if not self._needed[g]:
                shard = self._final.pop(g)
                if g in self._received:
                    self._keep_spare(shard)

    def nbytes_in_memory(self) -> int:
        """Host bytes kept between windows for the gradient shards handed over."""
        return sum(t.numel() * t.element_size() for t in self._spare)

    def _keep_spare(self, shard: torch.Tensor) -> None:
        self._spare.append(shard)
        while sum(t.numel() * t.element_size() for t in self._spare) > self._spare_limit:
            self._spare.pop(0)

    def _grads_of(self, run: list[int]) -> list[torch.Tensor]:
        pieces = self.state.masters.pieces
        return [self._final[pieces[i].group][pieces[i].lo : pieces[i].hi] for i in run]

    def _swap_order(self) -> list[int]:
        return [self._swap_index[self.runs[r][0]] for r in self._queue if self.runs[r][0] in self._swap_index]

    def _held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for g, t in self._final.items() if g in self._received)

    # -- engine.step() --------------------------------------------------------------------------

    def finish(self, multiplier: torch.Tensor) -> None:
        """``engine.step()`` after an armed backward: step the runs left (the queue's, then
        those not stepped under backward, in group order), write, re-gather, disarm."""
        assert self.armed and self._multiplier is not None
        assert torch.equal(multiplier.cpu(), self._multiplier.cpu()), "the step's multiplier changed since backward"
        if _options(self.optimizer) != self._options:
            self.abandon()
            raise RuntimeError(
                "the optimizer's param groups (learning rate or another option) changed between the window's "
                "last backward and engine.step(), but the optimizer already stepped under that backward "
                "(zero_optimization.offload_optimizer.step_in_backward): change them before the backward, "
                "or set step_in_backward to false"
            )
        try:
            while self._queue:
                self._step_next()
            rest = [run for r, run in enumerate(self.runs) if r not in self._done]
            with self.state.stepping.run_grads(rest) as grads_of:
                self.state.stepping.runs(self.optimizer, multiplier, grads_of, runs=rest, step_number=self._step_run.step_number)
        finally:
            self._disarm()

    def refuse(self, what: str) -> None:
        """Raise if the window's last backward steps the optimizer and ``engine.step()`` has
        not finished it: ``what`` would read or change the parameters, gradients or
        optimizer state in between (the same on every rank: being armed does not depend on
        timing)."""
        if self.armed:
            raise RuntimeError(self._explain(what))

    def abandon(self) -> str | None:
        """The window's gradients are dropped (``engine.zero_grad()``) after its last
        backward: disarm, and return what to raise once they are (the runs stepped stay
        stepped), or None when not armed."""
        if not self.armed:
            return None
        message = self._explain("engine.zero_grad()") + "; the runs updated stay updated"
        if self.state.params is not None:
            self.state.params.finish_step()
        self._disarm()
        return message

    def _explain(self, what: str) -> str:
        return (
            f"{what} between the last backward of an accumulation window and engine.step(): the optimizer "
            "steps under that backward and consumes the gradients as they become final "
            f"({self.stepped} of this rank's {len(self.runs)} optimizer runs are updated already; "
            "zero_optimization.offload_optimizer.step_in_backward, on by default with NVMe optimizer offload); "
            "do this before the backward or after engine.step(), or set step_in_backward to false"
        )


def _options(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param-group options (learning rate, betas, ...), as comparable values."""
    return [
        {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]
