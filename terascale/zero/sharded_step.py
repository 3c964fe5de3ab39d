"""The optimizer step of a ZeRO model state over this rank's masters.

Three ways, by what the optimizer needs to see at once:

- run by run (Adam and every elementwise optimizer): each run's masters (swapped in
  where they are on NVMe) stepped with its gradients and written into the parameter
  shards, persistent groups re-gathered behind ([Note: master pieces]);
- two passes for whole-parameter norms (Lamb's trust ratios: [Note: optimizers on shards]);
- two passes around an exchange of whole matrices (Muon: [Note: whole matrices on shards]).

:class:`ShardedStep` holds the parts of the step that stay from one step to the next
(where each parameter lies in the masters, Muon's exchanges) and reads everything else
from its :class:`terascale.zero.sharded.ShardedState`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.optim.lamb import Lamb
from terascale.optim.muon import MOMENTUM_KEY, Muon, Orthogonalize, orthogonalize_each
from terascale.zero.optimizers import Segments, SumNorms
from terascale.zero.run_step import Regathers, RunStep, masters_with_grads, scaled_grads
from terascale.zero.whole_matrices import MatrixExchange, exchanges, step_muon

if TYPE_CHECKING:
    from terascale.zero.sharded import ShardedState


class ShardedStep:
    """The step of ``state``'s optimizer: :meth:`__call__` picks the way (see above)."""

    def __init__(self, state: ShardedState) -> None:
        self.state = state
        self._exchanges: list[MatrixExchange] | None = None  # Muon's, made at its first step

    def __call__(self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor, sum_norms: SumNorms | None,
                 orthogonalize: Orthogonalize | None) -> None:  # fmt: skip
        """One step over every run with the window's gradients × ``multiplier``."""
        with self.run_grads() as grads_of:
            if isinstance(optimizer, Lamb):
                self.by_parameter_norms(optimizer, multiplier, grads_of, sum_norms)
            elif isinstance(optimizer, Muon):
                self.whole_matrices(optimizer, multiplier, grads_of, orthogonalize or orthogonalize_each)
            else:
                self.runs(optimizer, multiplier, grads_of)

    def runs(
        self,
        optimizer: torch.optim.Optimizer,
        multiplier: torch.Tensor,
        grads_of: Callable[[list[int]], list[torch.Tensor]],
        runs: Sequence[list[int]] | None = None,
        step_number: int | None = None,
    ) -> None:
        """Step each run (of ``runs``; default: all) with its gradients ``grads_of(run)``,
        writing the new values into the parameter shards and re-gathering persistent groups
        behind it. Given ``runs``, the others were stepped under backward ([Note: the
        optimizer step under backward]): nothing of theirs is settled or stepped again, and
        ``step_number`` is the step those took (:class:`RunStep`)."""
        st = self.state
        if st.params is not None and runs is None:
            st.params.settle()
        step_run = self.run_stepper(optimizer, multiplier, grads_of, step_number)

        # Runs go in group order (offloaded runs are the first ones); each group's
        # all-gather starts as soon as its last run is done, under the next runs' updates.
        regathers = Regathers(st.groups, st.options.allgather_bucket_numel)

        def step_and_regather(run: list[int]) -> None:
            step_run(run)
            regathers.launch_before(st.masters.pieces[run[-1]].group)

        todo = {run[0] for run in (st.masters.runs if runs is None else runs)}  # runs are disjoint
        swapped = set() if st.swapper is None else {i for run in st.swapper.runs for i in run}
        order = [] if st.swapper is None else [k for k, run in enumerate(st.swapper.runs) if run[0] in todo]
        resident = [run for run in st.masters.sub_groups() if run[0] not in swapped and run[0] in todo]
        if st.host_transfers is not None:  # [Note: the host step's transfers]: in stepping order
            st.host_transfers.begin([st.swapper.runs[k] for k in order] + resident, grads_of)
        try:
            if st.swapper is not None:
                st.swapper.step(optimizer, step_and_regather, order)
            for run in resident:
                step_and_regather(run)
        finally:
            if st.host_transfers is not None:
                st.host_transfers.finish()
            if st.ahead is not None and st.grads.listener is st.ahead:
                st.grads.listener = None  # armed again by the next window's last backward
        if st.params is not None:
            st.params.finish_step()
        regathers.finish()

    def run_stepper(
        self,
        optimizer: torch.optim.Optimizer,
        multiplier: torch.Tensor,
        grads_of: Callable[[list[int]], list[torch.Tensor]],
        step_number: int | None = None,
    ) -> RunStep:
        """``step_run(run)``: one optimizer call over run ``run`` (its masters swapped in, if
        on NVMe) with gradients ``grads_of(run) × multiplier``, and its new values written
        into the parameter shards (or their tier): :class:`terascale.zero.run_step.RunStep`."""
        st = self.state
        return RunStep(
            st.masters, optimizer, multiplier, grads_of,
            write=None if st.params is None else st.params.write_piece,
            offloaded=st.options.offload_optimizer.enabled,
            precision=st.options.masters,
            rounding=st.rounding,
            transfers=st.host_transfers,
            step_number=step_number,
        )  # fmt: skip

    def by_parameter_norms(
        self,
        optimizer: Lamb,
        multiplier: torch.Tensor,
        grads_of: Callable[[list[int]], list[torch.Tensor]],
        sum_norms: SumNorms | None,
    ) -> None:
        """The two-pass step of ``[Note: optimizers on shards]``: moments and partial norms
        run by run, one all-reduce of the norms (and ``sum_norms`` over tensor-parallel
        slices), then the updates with whole-parameter trust ratios, each group
        all-gathered as its last run is done."""
        st = self.state
        segments = self.segments
        masters = st.masters.masters
        write = None if st.params is None else st.params.write_piece
        if st.params is not None:
            st.params.settle()
        rows = torch.zeros(segments.num_params, 2, dtype=torch.float32, device=st.device)
        runs = st.masters.sub_groups()
        for run in runs:
            with masters_with_grads(st.masters, run, grads_of(run), multiplier):
                optimizer.accumulate_norms([masters[i] for i in run], [segments.of[i] for i in run], rows)
        segments.reduce(rows)
        if sum_norms is not None:
            sum_norms(rows, st.trainable)
        regathers = Regathers(st.groups, st.options.allgather_bucket_numel)
        for k, run in enumerate(runs):
            with ops.named_range("terascale::optimizer run", k):
                optimizer.apply_norms([masters[i] for i in run], [segments.of[i] for i in run], rows, st.param_opt_group)
            st.masters.write_to_shards(run, write)
            regathers.launch_before(st.masters.pieces[run[-1]].group)
        if st.params is not None:
            st.params.finish_step()
        regathers.finish()

    def whole_matrices(
        self,
        optimizer: Muon,
        multiplier: torch.Tensor,
        grads_of: Callable[[list[int]], list[torch.Tensor]],
        orthogonalize: Orthogonalize,
    ) -> None:
        """Muon's step of ``[Note: whole matrices on shards]``: directions run by run, each
        matrix orthogonalized by its owner, then the updates run by run (each pass with the
        runs' masters and state swapped in where they live on NVMe)."""
        st = self.state
        if self._exchanges is None:
            self._exchanges = exchanges(st.plans, st.groups, st.masters, optimizer)
        write = None if st.params is None else st.params.write_piece
        if st.params is not None:
            st.params.settle()
        swapped = {} if st.swapper is None else {run[0]: k for k, run in enumerate(st.swapper.runs)}
        in_memory = st.swapper is not None and MOMENTUM_KEY in st.swapper.in_memory_state

        def step_runs(fn: Callable[[list[int]], None], runs: Sequence[list[int]],
                      masters_change: Callable[[list[int]], bool]) -> None:  # fmt: skip
            # In run order (the gradient reader reads one run ahead); a run on NVMe is swapped
            # in unless only its momentum is needed and that stays in memory.
            changes = [masters_change(run) for run in runs]
            swap = [swapped[run[0]] if run[0] in swapped and (change or not in_memory) else None
                    for run, change in zip(runs, changes)]  # fmt: skip
            ahead = [k for k in swap if k is not None]

            def step_and_write(run: list[int]) -> None:
                fn(run)
                st.masters.write_to_shards(run, write)

            for run, k, change in zip(runs, swap, changes):
                step_run = step_and_write if change else fn
                if k is None:
                    step_run(run)
                else:
                    ahead.pop(0)
                    st.swapper.step_one(k, optimizer, step_run, ahead[:1])

        step_muon(optimizer, st.masters, self._exchanges, st.masters.sub_groups(), step_runs,
                  lambda run: scaled_grads(st.masters, run, grads_of(run), multiplier), st.device,
                  orthogonalize)  # fmt: skip
        if st.ahead is not None and st.grads.listener is st.ahead:
            st.ahead.forget()  # the host step's copies ahead go unused: Muon reads the shards
            st.grads.listener = None
        if st.params is not None:
            st.params.finish_step()
        Regathers(st.groups, st.options.allgather_bucket_numel).finish()

    @property
    def orthogonalize_seconds(self) -> float:
        """Muon: the seconds this rank spent orthogonalizing its matrices in the last step
        (its owner's share, [Note: whole matrices on shards]); 0 for other optimizers."""
        return sum(plan.seconds for plan in self._exchanges or ())

    @functools.cached_property
    def segments(self) -> Segments:
        """Where each parameter lies in this rank's master pieces (fixed by the layout)."""
        st = self.state
        apart: dict[int, tuple[ProcessGroup, list[int]]] = {}
        for fg in st.groups:
            if fg.group is not st.group:
                numbers = [st.param_number[id(p)] for p in fg.params if id(p) in st.param_number]
                apart.setdefault(id(fg.group), (fg.group, []))[1].extend(numbers)
        return Segments(
            st.masters.segments(st.param_number), len(st.param_number), st.group,
            tuple((pg, tuple(sorted(n))) for pg, n in apart.values() if n),
        )  # fmt: skip

    @contextlib.contextmanager
    def run_grads(self, runs: Sequence[list[int]] | None = None) -> Iterator[Callable[[list[int]], list[torch.Tensor]]]:
        """``run -> its pieces' gradients`` for the duration of a step (over ``runs``, in
        that order; default: all runs); from swap files, read one run ahead."""
        st = self.state
        swapper = st.grads.swapper
        runs = st.masters.runs if runs is None else runs
        if swapper is None:
            pieces = st.masters.grad_pieces(st.grads.shards)
            yield lambda run: [pieces[i] for i in run]
            return
        index = {run[0]: k for k, run in enumerate(runs)}  # runs are disjoint
        reader = swapper.reader(
            [[(p.group, p.lo, p.hi) for p in (st.masters.pieces[i] for i in run)] for run in runs]
        )
        try:
            yield lambda run: reader.get(index[run[0]])
        finally:
            reader.close()
