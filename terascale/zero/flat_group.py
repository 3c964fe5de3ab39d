"""A group of parameters as one flat buffer, sharded over the data-parallel ranks.

[Note: flat shards]
The parameters of one group (e.g. one transformer block) lie back to back in one flat
buffer, padded at the end to a multiple of the world size N; rank r owns the elements
``[r*S, (r+1)*S)`` with ``S = padded / N``, so a parameter may straddle two ranks'
shards (:class:`Fragment` says which part of which parameter a rank owns). The group is
the unit of all-gather, reduce-scatter and, later, of offload I/O and the optimizer step.

While the group is UNSHARDED every parameter's ``.data`` is a view into the full buffer:
the user's ``nn.Parameter`` objects, their names and the module code stay untouched, and
nothing is attached to them. Resharding frees the full buffer by resizing its storage to
zero bytes and points each parameter's ``.data`` at an empty tensor, so code that touches
a sharded parameter sees zero elements and fails on the shape, instead of reading freed
memory. The views, and every reference autograd saved for backward, remain aliases of
the buffer's storage and see the parameters again once the next all-gather has refilled
it and the parameters point back at their views.

[Note: kept full buffers]
On an accelerator the storage's memory comes back from the caching allocator. On the
host it would come from glibc, which maps a block this large afresh on every gather, so
the kernel maps and zeroes each page on first touch: measured here, a 403 MB gather took
100-127 ms against 26 ms into memory already mapped, about 4 s of a 4B-parameter
model's forward and backward. A :class:`FullBuffers` pool therefore keeps the memory of
freed host buffers and hands it to the next gather of the same size, with no more idle
than the largest group (gathers go layer after layer: what one layer frees is the next
one's, so the peak stays what it was). The gather schedule keeps nothing when its trace
has no gather of that size ahead (e.g. in a backward whose groups all stayed gathered
since forward). It moves memory between storage objects
(``UntypedStorage._swap_data_ptr_``), never the storage itself, so the aliases above
stay valid. The engine empties the pool after each backward: between steps its memory
is the optimizer's.

[Note: ZeRO++ gathers]
Two options of ZeRO++ (Wang et al., 2023) change how a stage-3 group is gathered, never
what the optimizer steps (the masters and gradients stay full precision):

- ``quant`` (qwZ): each rank sends its shard as int8 block codes and every rank decodes
  every shard, its own included, so all ranks compute with the same weights ([Note:
  block-quantized messages]). Forward and backward use the decoded weights; the gradient is
  taken with respect to them (straight through).
- ``secondary_group`` (hpZ): when the group is freed after its first use in a step, this
  rank keeps its ``1/h`` slice of the full buffer (``h`` the secondary group's size, the
  ranks of one node); while that secondary partition is valid, gathers run inside the
  secondary group, unquantized (re-encoding decoded values would add a second error and
  the link is fast). So a step's forward gathers across nodes once and its backward
  re-gathers inside the node. The secondary partition costs ``P/h`` elements a rank and
  is invalid from the moment the shards change (``invalidate_secondary``: the optimizer
  step, a checkpoint load, a ``GatheredParameters`` edit); the next gather is a primary
  one again and the next free rebuilds it. Persistent groups are never freed and never
  quantized (small parameters, re-gathered once a step).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.collectives import all_gather_flat
from terascale.comm.quant import BlockQuant
from terascale.comm.quantized import all_gather_quantized


class ShardState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard holds data; the full buffer's storage is freed
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight
    UNSHARDED = "unsharded"  # the full buffer holds every parameter; parameters are views of it


class ShardHome(Protocol):
    """Where a group's shard lives between gathers (an offload tier, see terascale.offload)."""

    def ready(self, fg: FlatParamGroup) -> None:
        """Make ``fg.shard`` hold this rank's values on ``fg.device`` (waits for a fetch)."""

    def consumed(self, fg: FlatParamGroup) -> None:
        """The gather has copied ``fg.shard`` into the full buffer; it may go away again."""


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat (unpadded) buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int


@dataclass(frozen=True)
class Fragment:
    """The part of parameter ``slot`` held by one rank's shard.

    Elements ``[start, end)`` of the flattened parameter sit at ``[shard_offset,
    shard_offset + end - start)`` of the shard.
    """

    slot: int
    start: int
    end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FlatLayout:
    """The flat buffer's layout: parameter slots in order, padded to ``world_size`` shards."""

    slots: tuple[ParamSlot, ...]
    world_size: int

    @staticmethod
    def build(named_shapes: Sequence[tuple[str, torch.Size]], world_size: int) -> FlatLayout:
        if not named_shapes:
            raise ValueError("a parameter group needs at least one parameter")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots, offset = [], 0
        for name, shape in named_shapes:
            numel = math.prod(shape)
            slots.append(ParamSlot(name, torch.Size(shape), offset, numel))
            offset += numel
        return FlatLayout(tuple(slots), world_size)

    @property
    def numel(self) -> int:
        """Elements of all parameters, without padding."""
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        return max(1, math.ceil(self.numel / self.world_size))

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s elements ``[start, end)`` of the padded flat buffer."""
        assert 0 <= rank < self.world_size
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def fragments(self, rank: int) -> tuple[Fragment, ...]:
        """The parts of parameters inside rank ``rank``'s shard, in buffer order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, slot in enumerate(self.slots):
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                out.append(Fragment(i, start - slot.offset, end - slot.offset, start - lo))
        return tuple(out)


class FullBuffers:
    """Memory of freed full buffers, kept for the next gather of the same size (see
    [Note: kept full buffers]). At most ``max_idle_bytes`` is kept idle at once; a newly
    freed buffer displaces the longest-idle ones."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[torch.UntypedStorage] = []  # oldest first
        self.reused = 0  # gathers served from kept memory (for tests and reports)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory: kept memory of that size if
        there is some, a fresh allocation otherwise. Its contents are undefined."""
        assert storage.nbytes() == 0, "fill an empty storage"
        for i in range(len(self._idle) - 1, -1, -1):
            if self._idle[i].nbytes() == nbytes:
                storage._swap_data_ptr_(self._idle.pop(i))
                self.reused += 1
                return
        storage.resize_(nbytes)

    def release(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory, leaving it empty (zero bytes): kept, displacing the
        longest-idle memory as the bound requires, or freed if larger than the bound."""
        nbytes = storage.nbytes()
        if not nbytes or nbytes > self.max_idle_bytes:
            storage.resize_(0)
            return
        while self.idle_bytes + nbytes > self.max_idle_bytes:
            self._idle.pop(0)
        holder = torch.UntypedStorage(0, device=storage.device)
        holder._swap_data_ptr_(storage)
        self._idle.append(holder)

    def clear(self) -> None:
        """Free every kept buffer."""
        self._idle.clear()

    @property
    def idle_bytes(self) -> int:
        return sum(s.nbytes() for s in self._idle)


def keeps_full_buffers(device: torch.device) -> bool:
    """Whether full buffers on ``device`` are worth keeping (the host; see [Note: kept full
    buffers]) and this torch can move memory between storages."""
    return device.type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class FlatParamGroup:
    """``named_params`` flattened into one buffer and sharded over the ranks of ``group``.

    Construction copies the parameters (or ``init_values(i, param)`` of ``shapes[i]``,
    for parameters whose data is not held locally) into the full buffer and points each parameter's
    ``.data`` at its view of it. ``shard`` is this rank's slice: for a ``persistent``
    group a view of the full buffer (the group never frees it), otherwise a private copy,
    and the group starts SHARDED. ``buffers``, where given, supplies and keeps the full
    buffer's memory (see [Note: kept full buffers]). :meth:`unshard` all-gathers the full buffer from every
    rank's shard; :meth:`reshard` frees it. ``index`` numbers the group among its model's
    groups; it names the group's ranges in a trace (``terascale::gather group <index>``).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        group: ProcessGroup,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        persistent: bool = False,
        init_values: Callable[[int, nn.Parameter], torch.Tensor] | None = None,
        shapes: Sequence[torch.Size] | None = None,
        index: int = 0,
        buffers: FullBuffers | None = None,
        quant: BlockQuant | None = None,
        secondary_group: ProcessGroup | None = None,
    ) -> None:
        shapes = shapes or [p.shape for _, p in named_params]
        self.layout = FlatLayout.build([(n, s) for (n, _), s in zip(named_params, shapes)], dist.get_world_size(group))
        self.names = tuple(n for n, _ in named_params)
        self.params = tuple(p for _, p in named_params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError(f"a parameter appears twice in one group: {self.names}")
        dtypes = {p.dtype for p in self.params}
        if dtype is None and len(dtypes) > 1:
            raise ValueError(
                f"parameters of one group must share a dtype, got {sorted(map(str, dtypes))} in "
                f"{self.names}; pass dtype= to cast them"
            )
        self.dtype = dtype or self.params[0].dtype
        self.device = torch.device(device) if device is not None else self.params[0].device
        self.group = group
        self.rank = dist.get_rank(group)
        self.index = index
        self.persistent = persistent
        self.home: ShardHome | None = None  # set by an offload tier; None: the shard stays here
        self._buffers = buffers
        # [Note: ZeRO++ gathers]
        self.quant = None if persistent else quant
        self.secondary_group = None if persistent else secondary_group
        self.secondary: torch.Tensor | None = None  # this rank's 1/h slice, while valid
        self._full_as_computed = True  # the full buffer holds what a training gather gives

        self._full = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, (slot, p) in enumerate(zip(self.layout.slots, self.params)):
                value = p.detach() if init_values is None else init_values(i, p)
                self._full[slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
        self._views = tuple(
            self._full[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in self.layout.slots
        )
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self._point_params_at(self._views)
        lo, hi = self.layout.shard_range(self.rank)
        self.shard = self._full[lo:hi] if persistent else self._full[lo:hi].clone()
        self.state = ShardState.UNSHARDED
        self._work: dist.Work | None = None
        # Seconds the caller spent waiting for this group's collectives (the straggler
        # detector subtracts it from compute time: [Note: straggler compute time]).
        self.blocked_s = 0.0
        if not persistent:
            # The first secondary partition comes from the first training gather, like every
            # step's ([Note: ZeRO++ gathers]), not from these initial values.
            self._full_as_computed = False
            self.reshard()

    # -- gathering and freeing -------------------------------------------------------------

    def reshard(self, keep_memory: bool = True) -> None:
        """Free the full buffer; parameters hold empty tensors until :meth:`unshard`.
        ``keep_memory=False`` says no gather of this size is coming soon: the memory is
        not kept for one (see [Note: kept full buffers])."""
        assert not self.persistent, "a persistent group is never resharded"
        assert self.state is ShardState.UNSHARDED, f"reshard from {self.state}"
        if self.secondary_group is not None and self.secondary is None and self._full_as_computed:
            lo, hi = self.secondary_range()
            self.secondary = self._full[lo:hi].clone()
        self._point_params_at([self._empty] * len(self.params))
        if self._buffers is None or not keep_memory:
            self._full.untyped_storage().resize_(0)
        else:
            self._buffers.release(self._full.untyped_storage())
        self.state = ShardState.SHARDED

    def unshard(self, async_op: bool = False, exact: bool = False) -> None:
        """Re-allocate the full buffer and all-gather every rank's shard into it.

        With ``async_op`` the group is GATHERING until :meth:`wait`. A no-op when the
        group is already UNSHARDED or GATHERING. ``exact`` gathers the shards as they are,
        never quantized ([Note: ZeRO++ gathers]): for callers that may write the full
        parameters back into the shards.
        """
        if self.state is not ShardState.SHARDED:
            return
        if self._buffers is None:
            self._full.untyped_storage().resize_(self.full_nbytes)
        else:
            self._buffers.fill(self._full.untyped_storage(), self.full_nbytes)
        self._gather(async_op, exact)

    def regather(self, async_op: bool = False) -> None:
        """All-gather a persistent group's full buffer after its shard changed (in place)."""
        assert self.persistent and self.state is ShardState.UNSHARDED, f"regather from {self.state}"
        self._gather(async_op)

    def invalidate_secondary(self) -> None:
        """The shards changed: the next gather is a primary one ([Note: ZeRO++ gathers])."""
        self.secondary = None

    def secondary_range(self) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the padded full buffer that this rank's hpZ secondary
        partition holds ([Note: ZeRO++ gathers])."""
        assert self.secondary_group is not None
        n = self.layout.padded_numel // dist.get_world_size(self.secondary_group)
        j = dist.get_rank(self.secondary_group)
        return j * n, (j + 1) * n

    def _gather(self, async_op: bool, exact: bool = False) -> None:
        if self.secondary is not None:
            if self.home is not None:  # the tier's fetch of this shard (if any) is released unread
                self.home.ready(self)
                self.home.consumed(self)
            lo, hi = self.secondary_range()
            own = self._full[lo:hi]
            with torch.no_grad():
                own.copy_(self.secondary)
            with ops.named_range("terascale::gather group (secondary)", self.index):
                self._work = all_gather_flat(self._full, own, self.secondary_group, async_op=async_op)
            self.state = ShardState.GATHERING
            if not async_op:
                self.wait()
            return
        lo, hi = self.layout.shard_range(self.rank)
        own = self._full[lo:hi]
        # An exact gather of quantized shards is not what training computes with: no
        # secondary partition is made from it.
        self._full_as_computed = not (exact and self.quant is not None)
        if self.home is not None:
            # Copy the shard into place first: the offload tier gets its buffer back at once.
            self.home.ready(self)
            with torch.no_grad():
                own.copy_(self.shard)
            self.home.consumed(self)
        elif own.data_ptr() != self.shard.data_ptr():
            with torch.no_grad():
                own.copy_(self.shard)
        if self.quant is not None and not exact:
            with ops.named_range("terascale::gather group (quantized)", self.index):
                self._work = all_gather_quantized(self._full, own, self.group, self.quant, async_op=async_op)
        elif self.layout.world_size > 1:
            with ops.named_range("terascale::gather group", self.index):
                self._work = all_gather_flat(self._full, own, self.group, async_op=async_op)
        self.state = ShardState.GATHERING
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish an in-flight gather (no-op otherwise)."""
        if self.state is ShardState.GATHERING:
            if self._work is not None:
                started = time.perf_counter()
                with ops.named_range("terascale::gather wait group", self.index):
                    self._work.wait()
                self.blocked_s += time.perf_counter() - started
                self._work = None
            self._point_params_at(self._views)
            self.state = ShardState.UNSHARDED

    def _point_params_at(self, tensors: Sequence[torch.Tensor]) -> None:
        # ``.data`` assignment swaps what the Parameter object holds; its identity, name,
        # hooks and autograd version counter stay.
        for p, t in zip(self.params, tensors):
            p.data = t

    @torch.no_grad()
    def update_shard_from_full(self) -> None:
        """Copy this rank's slice of the (modified) full parameters into its shard."""
        assert self.state is ShardState.UNSHARDED, f"update_shard_from_full from {self.state}"
        self.invalidate_secondary()
        if not self.persistent:
            lo, hi = self.layout.shard_range(self.rank)
            self.shard.copy_(self._full[lo:hi])

    # -- what this rank owns -----------------------------------------------------------------

    def owned_fragments(self) -> list[tuple[nn.Parameter, Fragment]]:
        """Each parameter part in this rank's shard, with the parameter it belongs to."""
        return [(self.params[f.slot], f) for f in self.layout.fragments(self.rank)]

    @property
    def full_buffer(self) -> torch.Tensor:
        """The padded full buffer (its storage is empty while SHARDED)."""
        return self._full

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def full_nbytes(self) -> int:
        """Bytes of the padded full buffer while gathered."""
        return self.layout.padded_numel * self.dtype.itemsize

    @property
    def keeps_memory(self) -> bool:
        """Whether :meth:`reshard` can keep the freed memory for a later gather."""
        return self._buffers is not None

    def __repr__(self) -> str:
        return (
            f"FlatParamGroup({len(self.params)} params, {self.layout.numel} elements, "
            f"shard {self.layout.shard_numel} x {self.layout.world_size}, {self.state.value})"
        )
