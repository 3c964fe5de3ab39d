"""Where checkpointed inputs wait for their recompute: device, host memory or NVMe.

[Note: checkpoint inputs]
A checkpointed block keeps only its inputs from forward to backward. torch's
non-reentrant checkpoint saves them as saved tensors *outside* its own saved-tensor
hooks, so the :class:`InputStore` hooks, entered around the checkpoint call, see exactly
those inputs and nothing the block computes. ``pack`` turns each input into a
:class:`_Record`:

- ``partition``: with a tensor-parallel group, each rank keeps 1/tp of the flat input
  (the ranks hold the same activation) and the recompute all-gathers it back;
- ``place``: the kept tensor stays on the device (in the step's contiguous arena with
  ``contiguous_memory_optimization``), or is copied to host memory (pinned buffers reused
  across steps, on a side stream where the device has one), or written to a swap file on
  the NVMe path through the async I/O engine.

``unpack`` runs when the recompute of that block starts in backward. It waits for the
fetch of its record and starts fetching the records of the next blocks in *backward*
order (the ones before it in forward), ``prefetch`` deep, so the copies overlap the
recompute and backward of this block; :meth:`InputStore.before_backward` starts the
first fetches as backward begins. A record's host or disk copy lives until autograd
drops the saved input (after the block's backward, or later with ``retain_graph``); its
buffer then returns to the pool, and the contiguous arena starts over once no record of
the step is alive.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from terascale.comm.collectives import all_gather_flat
from terascale.offload.aio import AioOptions, AsyncIO, IoHandle, aligned_empty
from terascale.offload.swap import SwapDirectory, round_up


@dataclass(frozen=True)
class StoreOptions:
    """Where inputs go: ``tier`` is ``device``, ``host`` or ``nvme``."""

    tier: str = "device"
    contiguous: bool = False  # contiguous_memory_optimization
    number_checkpoints: int | None = None  # sizes the contiguous arena
    prefetch: int = 2  # records fetched ahead in backward order
    pin_memory: bool = True  # host buffers (where the device has pinned memory)
    nvme_path: str | None = None
    aio: AioOptions = field(default_factory=AioOptions)

    def __post_init__(self) -> None:
        assert self.tier in ("device", "host", "nvme"), self.tier
        assert self.tier != "nvme" or self.nvme_path, "the nvme tier needs a path"


@dataclass
class BlockStats:
    """What one label's checkpoints cost this step (profile and memory reports)."""

    inputs: int = 0  # checkpoints taken
    bytes: int = 0  # input bytes kept (after partitioning)
    offload_s: float = 0.0  # time the forward spent handing inputs to the tier
    fetch_wait_s: float = 0.0  # time backward waited for inputs to come back
    selective_bytes: int = 0  # outputs selective checkpointing keeps on the device


class _Copies:
    """Copies between the device and host memory, on a side stream where the device has one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mod = getattr(torch, device.type) if device.type != "cpu" else None
        self._side = self._mod.Stream(device) if self._mod is not None and hasattr(self._mod, "Stream") else None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> object:
        """Start copying device ``src`` into host ``dst``; returns an event (or None)."""
        if self._side is None:
            dst.copy_(src)
            return None
        self._side.wait_stream(self._mod.current_stream(self.device))
        with self._mod.stream(self._side):
            dst.copy_(src, non_blocking=True)
            event = self._mod.Event()
            event.record(self._side)
        src.record_stream(self._side)  # the allocator may reuse src only after the copy
        return event

    def to_device(self, src: torch.Tensor, after: object) -> tuple[torch.Tensor, object]:
        """Start copying host ``src`` to a new device tensor (after event ``after``)."""
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        if self._side is None:
            out.copy_(src)
            return out, None
        self._side.wait_stream(self._mod.current_stream(self.device))
        with self._mod.stream(self._side):
            if after is not None:
                self._side.wait_event(after)
            out.copy_(src, non_blocking=True)
            event = self._mod.Event()
            event.record(self._side)
        return out, event

    def wait(self, event: object) -> None:
        if event is not None:
            self._mod.current_stream(self.device).wait_event(event)

    def done(self, event: object) -> bool:
        return event is None or event.query()


class _Arena:
    """One preallocated byte buffer that a step's checkpoints are laid out in, in order."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device = device
        self.pin = pin
        self.buffer: torch.Tensor | None = None
        self.offset = 0
        self.wanted = 0  # bytes the largest step asked for

    def take(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of the arena (256-byte aligned), or None when it is full."""
        start = round_up(self.offset, 256)
        self.wanted = max(self.wanted, start + nbytes)
        if self.buffer is None or start + nbytes > self.buffer.numel():
            return None
        self.offset = start + nbytes
        return self.buffer[start : start + nbytes]

    def restart(self, first_nbytes: int, number: int | None) -> None:
        """A new step: grow the buffer to what the last step needed (or ``number`` checkpoints)."""
        want = max(self.wanted, (number or 0) * round_up(first_nbytes, 256))
        if want and (self.buffer is None or self.buffer.numel() < want):
            self.buffer = torch.empty(want, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        self.offset = 0
        self.wanted = 0

    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


class _HostPool:
    """Host byte buffers by size, reused across steps (pinned where the device has them)."""

    def __init__(self, pin: bool, copies: _Copies) -> None:
        self.pin = pin
        self.copies = copies
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = defaultdict(list)

    def acquire(self, nbytes: int) -> torch.Tensor:
        for i, (buf, last_use) in enumerate(self._free[nbytes]):
            if self.copies.done(last_use):
                del self._free[nbytes][i]
                return buf
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, buf: torch.Tensor, last_use: object) -> None:
        self._free[buf.numel()].append((buf, last_use))

    def nbytes(self) -> int:
        return sum(b.numel() for bufs in self._free.values() for b, _ in bufs)


@dataclass
class _Ticket:
    """What a record holds that must go back when autograd drops it (the finalizer's view:
    it must not reference the record itself)."""

    host: torch.Tensor | None = None  # pooled host buffer (host tier)
    event: object = None  # the last copy that used ``host``
    slot: int = -1  # swap file index (nvme tier)
    resident: int = 0  # bytes the store holds on the device for this record now


@dataclass
class _Record:
    """One saved input: its metadata and where its (possibly partitioned) bytes are."""

    shape: torch.Size
    dtype: torch.dtype
    numel: int  # elements kept on this rank (a partition, or all)
    label: str
    partitioned: bool
    ticket: _Ticket = field(default_factory=_Ticket)
    tensor: torch.Tensor | None = None  # on the device (device tier, or fetched); host buffer while read
    staging: torch.Tensor | None = None  # aligned bytes being written (nvme tier)
    write: IoHandle | None = None
    read: IoHandle | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class InputStore:
    """Saved-tensor hooks that keep checkpoint inputs on their tier (see [Note: checkpoint inputs]).

    One store serves every checkpoint of an engine (or of the module-level API); it is
    not tied to one step. ``partition_group``: the tensor-parallel group whose ranks
    hold the same activations (None: keep whole). ``rank`` names the swap directory.
    """

    def __init__(self, options: StoreOptions, device: torch.device, partition_group: ProcessGroup | None = None,
                 rank: int = 0) -> None:  # fmt: skip
        self.options = options
        self.device = device
        self.group = partition_group if partition_group is not None and dist.get_world_size(partition_group) > 1 else None
        self._copies = _Copies(device)
        pin = options.pin_memory and device.type != "cpu" and torch.accelerator.is_available()
        self._pool = _HostPool(pin, self._copies)
        arena_device = device if options.tier == "device" else torch.device("cpu")
        self._arena = _Arena(arena_device, pin and options.tier == "host") if options.contiguous else None
        self._live: list[weakref.ref] = []  # records not yet dropped, in forward order
        self._writes: list[_Record] = []  # nvme records whose staging buffer is still being written
        self._alive = 0
        self._next_slot = 0
        self._free_slots: list[int] = []
        self._label = "checkpoint"
        self.stats: dict[str, BlockStats] = defaultdict(BlockStats)
        self._resident = 0
        self.resident_peak = 0  # most input bytes held on the device at once since reset_stats
        self._dir: SwapDirectory | None = None
        self._aio: AsyncIO | None = None
        self._cleanup = None
        if options.tier == "nvme":
            self._dir = SwapDirectory(options.nvme_path, "activations", rank)
            self._aio = AsyncIO(options.aio, trace_name="terascale::swap")
            # Swap files go with the store, or at interpreter exit for a store nobody closed
            # (the module-level API's).
            self._cleanup = weakref.finalize(self, _close_tier, self._aio, self._dir)

    @property
    def offloads(self) -> bool:
        """Whether inputs leave the device's memory (host-tier inputs of a CPU run stay put)."""
        return self.options.tier == "nvme" or (self.options.tier == "host" and self.device.type != "cpu")

    @contextmanager
    def hooks(self, label: str) -> Iterator[None]:
        """Pack the checkpoint inputs saved inside the block into this store, as ``label``."""
        previous, self._label = self._label, label
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._label = previous

    # -- pack ------------------------------------------------------------------------------------

    def pack(self, x: torch.Tensor) -> object:
        if isinstance(x, nn.Parameter) or x.numel() == 0:
            return x  # parameters live with ZeRO; nothing to keep for empty tensors
        if not self.offloads and self.group is None and self._arena is None:
            self._account(self._label, x.numel() * x.element_size(), 0.0)
            return x  # kept as it is: autograd holds it, as without the store
        start = time.perf_counter()
        if self._alive == 0 and self._arena is not None:
            self._arena.restart(x.numel() * x.element_size(), self.options.number_checkpoints)
        self._reap_writes()
        flat, partitioned = self._partition(x)
        record = _Record(x.shape, x.dtype, flat.numel(), self._label, partitioned)
        if not self.offloads:
            record.tensor = self._keep(flat)
            self._hold(record, record.nbytes)
        elif self.options.tier == "host":
            record.ticket.host = self._host_bytes(record.nbytes)
            record.ticket.event = self._copies.to_host(flat, record.ticket.host.view(flat.dtype))
        else:
            self._write(record, flat)
        self._alive += 1
        self._live.append(weakref.ref(record))
        weakref.finalize(record, InputStore._dropped, weakref.ref(self), record.ticket)
        self._account(record.label, record.nbytes, time.perf_counter() - start)
        return record

    def _account(self, label: str, nbytes: int, seconds: float) -> None:
        stats = self.stats[label]
        stats.inputs += 1
        stats.bytes += nbytes
        stats.offload_s += seconds

    def _hold(self, record: _Record, nbytes: int) -> None:
        record.ticket.resident += nbytes
        self._resident += nbytes
        self.resident_peak = max(self.resident_peak, self._resident)

    def _partition(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        flat = x.detach().reshape(-1)
        if self.group is None or flat.numel() < dist.get_world_size(self.group):
            return flat, False
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        n = -(-flat.numel() // world)
        part = flat[rank * n : (rank + 1) * n]
        return part.clone() if part.numel() == n else torch.cat([part, part.new_zeros(n - part.numel())]), True

    def _keep(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as kept on the device tier: in the arena when there is one."""
        if self._arena is None:
            return flat
        space = self._arena.take(flat.numel() * flat.element_size())
        if space is None:
            return flat.clone()  # the arena grows to fit at the next step
        out = space.view(flat.dtype)
        out.copy_(flat)
        return out

    def _host_bytes(self, nbytes: int) -> torch.Tensor:
        if self._arena is not None:
            space = self._arena.take(nbytes)
            if space is not None:
                return space
        return self._pool.acquire(nbytes)

    def _write(self, record: _Record, flat: torch.Tensor) -> None:
        """Stage ``flat`` in an aligned host buffer and start writing it to a swap file."""
        staging = aligned_empty(round_up(record.nbytes), torch.uint8)
        staging[: record.nbytes].view(flat.dtype).copy_(flat)
        record.ticket.slot = self._free_slots.pop() if self._free_slots else self._claim_slot()
        record.staging = staging
        record.write = self._aio.write(staging, self._dir.file(f"act{record.ticket.slot}"))
        self._writes.append(record)

    def _claim_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def _reap_writes(self) -> None:
        """Free the staging buffers of finished writes (the host memory of the nvme tier
        is the writes in flight, not every checkpoint)."""
        pending = []
        for record in self._writes:
            if record.write is not None and not record.write.done():
                pending.append(record)
                continue
            if record.write is not None:
                record.write.wait()  # raises a failed write here
                record.write = None
            record.staging = None
        self._writes = pending

    # -- unpack ----------------------------------------------------------------------------------

    def unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        record: _Record = packed
        start = time.perf_counter()
        self._fetch(record)
        self._prefetch_before(record)
        flat = self._arrive(record)
        if record.partitioned:
            world = dist.get_world_size(self.group)
            full = torch.empty(record.numel * world, dtype=record.dtype, device=self.device)
            all_gather_flat(full, flat, self.group)
            flat = full
        self.stats[record.label].fetch_wait_s += time.perf_counter() - start
        return flat[: record.shape.numel()].view(record.shape)

    def before_backward(self) -> None:
        """Backward is about to start: fetch the last records of the forward."""
        for record in self._records()[-self.options.prefetch :]:
            self._fetch(record)

    def _records(self) -> list[_Record]:
        records = [r for r in (ref() for ref in self._live) if r is not None]
        self._live = [weakref.ref(r) for r in records]
        return records

    def _prefetch_before(self, record: _Record) -> None:
        records = self._records()
        k = next((i for i, r in enumerate(records) if r is record), 0)
        for other in records[max(0, k - self.options.prefetch) : k][::-1]:
            self._fetch(other)

    def _fetch(self, record: _Record) -> None:
        """Start bringing ``record`` back to the device (a no-op where it is there already)."""
        if record.tensor is not None:
            return
        if record.ticket.slot >= 0:  # nvme: into a fresh aligned buffer (the recompute may keep it)
            if record.write is not None:
                record.write.wait()
                record.write = None
                record.staging = None
            buf = aligned_empty(round_up(record.nbytes), torch.uint8)
            record.read = self._aio.read(buf, self._dir.file(f"act{record.ticket.slot}"))
            record.tensor = buf[: record.nbytes].view(record.dtype)
        else:
            record.tensor, record.ticket.event = self._copies.to_device(
                record.ticket.host.view(record.dtype), record.ticket.event
            )
        self._hold(record, record.nbytes)

    def _arrive(self, record: _Record) -> torch.Tensor:
        """Wait until ``record`` is on the device and hand its tensor to autograd. An
        offloaded record then keeps only its host/disk copy, so a second backward
        (``retain_graph``) fetches it again."""
        if record.read is not None:
            record.read.wait()
            record.read = None
            tensor = record.tensor.to(self.device)
        else:
            self._copies.wait(record.ticket.event)
            tensor = record.tensor
        if self.offloads:
            record.tensor = None
            self._resident -= record.ticket.resident
            record.ticket.resident = 0
        return tensor

    @staticmethod
    def _dropped(store_ref: weakref.ref, ticket: _Ticket) -> None:
        """Autograd dropped a record: give its buffer, swap slot and device bytes back."""
        store = store_ref()
        if store is None:
            return
        store._alive -= 1
        store._resident -= ticket.resident
        arena = store._arena
        in_arena = arena is not None and arena.buffer is not None and ticket.host is not None and (
            ticket.host.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr())  # fmt: skip
        if ticket.host is not None and not in_arena:
            store._pool.release(ticket.host, ticket.event)
        if ticket.slot >= 0:
            store._free_slots.append(ticket.slot)

    # -- reports ---------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = defaultdict(BlockStats)
        self.resident_peak = self._resident

    def nbytes_in_memory(self) -> dict[str, int]:
        """Bytes the store keeps for reuse outside autograd's records: host pool and arena."""
        return {"host_pool": self._pool.nbytes(), "arena": 0 if self._arena is None else self._arena.nbytes()}

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()
        self._aio, self._dir = None, None


def _close_tier(aio: AsyncIO, directory: SwapDirectory) -> None:
    aio.close()
    directory.remove()
