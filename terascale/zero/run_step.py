"""One optimizer run's update: its gradients in, the optimizer's step, its new values out.

A rank steps its master pieces run by run ([Note: master pieces]); :class:`RunStep` is what
the step does with one run, whichever tier the masters are on and however the optimizer
keeps its state:

- fp32 Adam/AdamW masters on the host: widen, step and narrow per cached chunk ([Note:
  host Adam]);
- 8-bit moments: decode, step and encode per chunk ([Note: compact optimizer states]);
- bf16 masters or moments: widen, step and narrow back stochastically ([Note: bf16 masters
  and optimizer states]);
- anything else: the optimizer's own ``step()`` with fp32 gradients set on the masters;

and on an accelerator with host masters the gradients come down and the new values go up
through the staging pipeline ([Note: the host step's transfers]). The new values then go
to the parameter shards (or their tier). :class:`Regathers` all-gathers the persistent
groups behind the runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from terascale.comm import ops
from terascale.offload import host_adam
from terascale.offload.transfer import HostStepTransfers
from terascale.optim.compact import is_compact
from terascale.optim.rounding import StochasticRounding
from terascale.zero.flat_group import FlatParamGroup
from terascale.zero.masters import MasterPrecision, ShardedMasters

Write = Callable[[int, int, torch.Tensor], None]  # (group, lo, values): a tier that holds the shard elsewhere


class RunStep:
    """``step(run)``: one optimizer call over run ``run`` (its masters swapped in, if on
    NVMe) with gradients ``grads_of(run) × multiplier``, and its new values written into
    the parameter shards, or handed to ``write``."""

    def __init__(
        self,
        masters: ShardedMasters,
        optimizer: torch.optim.Optimizer,
        multiplier: torch.Tensor,
        grads_of: Callable[[list[int]], list[torch.Tensor]],
        *,
        write: Write | None,
        offloaded: bool,
        precision: MasterPrecision,
        rounding: StochasticRounding | None,
        transfers: HostStepTransfers | None,
        step_number: int | None = None,
        outputs: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.masters = masters
        self.optimizer = optimizer
        self.multiplier = multiplier
        self.grads_of = grads_of
        self.write = write
        self.precision = precision
        self.rounding = rounding
        self.transfers = transfers
        # Where piece i's new values go instead of its parameter shard (host staging
        # buffers: [Note: the overlapped host step]); ``write`` then takes whole masters.
        self.outputs = outputs
        self.fused_host = offloaded and host_adam.supports(optimizer)
        self.compact = is_compact(optimizer)
        self.run_index = {run[0]: k for k, run in enumerate(masters.runs)}  # runs are disjoint
        self._multipliers: dict[torch.device, torch.Tensor] = {}
        # The step being taken, the seed of its rounding noise ([Note: bf16 masters and
        # optimizer states]): every piece keeps the same count before the step; one read a
        # step (given when some runs of this step were already taken under backward).
        if step_number is None:
            first = optimizer.state.get(masters.masters[0], {}).get("step") if masters.masters and precision.low else None
            step_number = 1 + (0 if first is None else int(first))
        self.step_number = step_number

    def __call__(self, run: list[int]) -> None:
        with ops.named_range("terascale::optimizer run", self.run_index[run[0]]):
            self._step(run)

    def _step(self, run: list[int]) -> None:
        params = [self.masters.masters[i] for i in run]
        on_host = all(m.device.type == "cpu" for m in params)
        # [Note: the host step's transfers]: the gradients come down and the new values go
        # up through staging buffers, behind the neighbouring runs' updates.
        transfers = self.transfers if self.transfers is not None and self.transfers.active and on_host else None
        grads = transfers.host_grads(run) if transfers is not None else self.grads_of(run)
        if not (self.precision.low or self.compact or (self.fused_host and on_host)):
            with masters_with_grads(self.masters, run, grads, self._multiplier_on(params[0].device)):
                self.optimizer.step()
            self.masters.write_to_shards(run, self.write)
            return
        outs, destinations = self._outputs(run, transfers)
        multiplier = self._multiplier_on(params[0].device)
        if self.precision.low:
            host_adam.step(
                self.optimizer, params, grads, multiplier, outs, host_adam.chunk_numel_for(params[0].device),
                state_dtype=self.precision.state_dtype, rounding=self.rounding,
                positions=self.masters.positions(run), step_number=self.step_number,
            )  # fmt: skip
        elif self.compact:
            self.optimizer.step_with(params, grads, multiplier, outs)
        else:
            host_adam.step(self.optimizer, params, grads, multiplier, outs)
        if destinations:
            transfers.upload(run, destinations)
        self.masters.write_to_shards([i for i, out in zip(run, outs) if out is None], self.write)

    def _multiplier_on(self, device: torch.device) -> torch.Tensor:
        """The multiplier on ``device``, copied there once a step: a copy to the host waits
        for the device, and once the step's uploads are queued it would wait for them too
        ([Note: the host step's transfers])."""
        if device not in self._multipliers:
            self._multipliers[device] = self.multiplier.to(device)
        return self._multipliers[device]

    def _outputs(
        self, run: list[int], transfers: HostStepTransfers | None
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """Where the step writes run ``run``'s new parameter values, piece by piece (None:
        ``write_to_shards`` copies the master there), and, with ``transfers``, the device
        shard slices its staged values go to ([Note: the host step's transfers])."""
        outs = [self._host_output(i) for i in run]
        if transfers is None or self.outputs is not None:
            return outs, []
        at = [k for k, i in enumerate(run) if self.write is None and not self.masters.shares_storage[i]]
        if not at:
            return outs, []
        pieces = [self.masters.pieces[run[k]] for k in at]
        for k, view in zip(at, transfers.outputs(run, [p.hi - p.lo for p in pieces])):
            outs[k] = view
        return outs, [self.masters.groups[p.group].shard[p.lo : p.hi] for p in pieces]

    def _host_output(self, i: int) -> torch.Tensor | None:
        """Piece ``i``'s slice of its parameter shard (or its staging buffer), if the host
        step can write it directly."""
        if self.outputs is not None:
            return self.outputs(i)
        if self.write is not None or self.masters.shares_storage[i]:
            return None
        piece = self.masters.pieces[i]
        shard = self.masters.groups[piece.group].shard
        return shard[piece.lo : piece.hi] if shard.device.type == "cpu" else None


def scaled_grads(
    masters: ShardedMasters, run: list[int], pieces: Sequence[torch.Tensor], multiplier: torch.Tensor
) -> list[torch.Tensor]:
    """``run``'s fp32 gradients ``pieces × multiplier``, made on the masters' device (in
    one copy on an offload tier; in place where ``pieces`` are fp32 there already)."""
    tensors = masters.masters
    grads = [g.to(device=tensors[i].device, dtype=torch.float32) for i, g in zip(run, pieces)]
    torch._foreach_mul_(grads, multiplier.to(tensors[run[0]].device))
    return grads


@contextlib.contextmanager
def masters_with_grads(
    masters: ShardedMasters, run: list[int], pieces: Sequence[torch.Tensor], multiplier: torch.Tensor
) -> Iterator[None]:
    """Run ``run``'s masters with their fp32 gradients ``pieces × multiplier``
    (:func:`scaled_grads`) while the body steps them."""
    tensors = masters.masters
    for i, grad in zip(run, scaled_grads(masters, run, pieces, multiplier)):
        tensors[i].grad = grad
    try:
        yield
    finally:
        for i in run:
            tensors[i].grad = None


class Regathers:
    """All-gathers persistent groups after the step, in group order (the same on every rank
    whatever pieces it owns), at most ``bucket_numel`` elements in flight."""

    def __init__(self, groups: Sequence[FlatParamGroup], bucket_numel: int) -> None:
        self.groups = groups
        self.bucket_numel = bucket_numel
        self._next = 0
        self._in_flight: list[FlatParamGroup] = []

    def launch_before(self, limit: int) -> None:
        """Start the all-gathers of persistent groups with index < ``limit`` not started yet."""
        for fg in self.groups[self._next : limit]:
            if not fg.persistent:
                continue
            fg.regather(async_op=True)
            self._in_flight.append(fg)
            while len(self._in_flight) > 1 and sum(f.layout.padded_numel for f in self._in_flight) > self.bucket_numel:
                self._in_flight.pop(0).wait()
        self._next = max(self._next, limit)

    def finish(self) -> None:
        self.launch_before(len(self.groups))
        for fg in self._in_flight:
            fg.wait()
        self._in_flight = []
