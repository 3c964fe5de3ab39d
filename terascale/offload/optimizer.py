"""Optimizer state on NVMe: each run's fp32 masters and optimizer state in a swap file.

[Note: optimizer swapping]
The optimizer steps this rank's masters one *run* at a time (a run is at most
``sub_group_size`` elements, see ``[Note: master pieces]``). With
``offload_optimizer.device: nvme`` a run's masters and every tensor of its optimizer
state (Adam's two moments; whatever the optimizer keeps, except 0-d step counters and
the entries asked to stay in memory) live in one swap file per run and rank, laid out as 4 KiB-aligned segments. Between steps the
master ``nn.Parameter`` objects and the optimizer's state entries hold empty
placeholders; the step swaps a run in by reading its file into a pooled aligned buffer
and pointing the masters' ``.data`` and the state entries at views of it, so the
optimizer updates the buffer in place, and then writes the buffer back.

The step is pipelined over ``buffer_count`` buffers: while run k is stepped, run k+1 is
read and run k-1 is written (3 buffers suffice; fewer serialise, more let reads run
further ahead). A buffer returns to the pool only when its write has finished, so host
memory stays at ``buffer_count`` runs however large the model. The optimizer state
does not exist before the first step: that step steps each run with the optimizer's
fresh state in ordinary memory, lays the file out again with it, and writes it once.

The pipeline also reaches past the step, so that the disk keeps working while the
model computes: the step returns with its last writes still in flight (they finish
under the next forward; a read of a file first waits for its pending write), and
:meth:`prefetch`, called when the backward before a step begins, reads the first runs
into the free buffers under that backward. :meth:`flush` (before anything reads the
files otherwise, and at close) waits for both.

So a step moves on the disk only the runs beyond ``buffer_count``: with at most that many
runs, every read happens under backward and every write under the next forward. Runs
swapped to NVMe therefore end at a group end only from four million elements (48 MB of
masters and Adam moments; a million otherwise): large enough that small models fit the
default four buffers and that each run's I/O fills the engine's queue, small enough
that the buffers stay a few hundred MB (``sub_group_size`` caps them further).

Each rank reads and writes only its own runs, so with one disk per rank (or one fast
array) the aggregate bandwidth grows with the ranks.

With ``step_in_backward`` the same pipeline runs under the window's last backward, run by
run as each run's gradients become final (:meth:`step_one`, reads ahead in that order:
[Note: the optimizer step under backward]).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from terascale.offload.aio import AsyncIO, IoHandle
from terascale.offload.host_buffers import aligned_empty
from terascale.offload.swap import BufferPool, SwapDirectory, WriteBehind, round_up

if TYPE_CHECKING:
    from terascale.zero.masters import ShardedMasters

_SEGMENT_ALIGN = 64
MASTER_KEY = "master"  # the segment of a piece's master (other keys: optimizer state)


@dataclass(frozen=True)
class _Segment:
    """One tensor of a run's swap file: piece ``piece``'s master or its state ``key``."""

    piece: int
    key: str
    dtype: torch.dtype
    shape: torch.Size
    offset: int  # bytes; a multiple of _SEGMENT_ALIGN

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _layout(entries: Sequence[tuple[int, str, torch.Tensor]]) -> tuple[list[_Segment], int]:
    segments, at = [], 0
    for piece, key, t in entries:
        segments.append(_Segment(piece, key, t.dtype, t.shape, at))
        # Segments 64-byte aligned (any dtype's views; small ones such as 8-bit moments'
        # block scales add no 4 KiB of padding each), the file a whole number of blocks.
        at = round_up(at + t.numel() * t.element_size(), _SEGMENT_ALIGN)
    return segments, round_up(at)


class OptimizerSwapper:
    """Keeps the masters and optimizer state of ``runs`` (piece indices) in swap files.

    ``masters`` must have been built with ``create=False``: the constructor creates each
    run's masters (with ``create_run``, default ``masters.create_run``) and writes them
    out before creating the next.
    """

    def __init__(
        self,
        masters: ShardedMasters,
        runs: Sequence[Sequence[int]],
        directory: SwapDirectory,
        aio: AsyncIO,
        buffer_count: int,
        *,
        pin_memory: bool = False,
        create_run: Callable[[list[int]], None] | None = None,
        state_bytes: float = 8.0,
        in_memory_state: Collection[str] = (),
    ) -> None:
        """``in_memory_state``: keys of optimizer state that stay in memory where the
        optimizer made them, out of the files (Muon's momentum, when asked)."""
        self.masters = masters
        self.in_memory_state = frozenset(in_memory_state)
        self.runs = [list(r) for r in runs]
        self.directory = directory
        self.aio = aio
        self.pool = BufferPool(max(1, buffer_count), pin_memory=pin_memory)
        self.writes = WriteBehind(self.pool, aio)
        self._reads: dict[int, tuple[torch.Tensor, IoHandle]] = {}  # run -> read in flight
        self._layouts: list[list[_Segment]] = []
        self._nbytes: list[int] = []
        # Masters plus the optimizer's state (``state_bytes`` an element: Adam's two fp32
        # moments 8, 8-bit moments about 2): what the files will grow to.
        numel = sum(masters.pieces[i].hi - masters.pieces[i].lo for run in self.runs for i in run)
        self.nbytes_expected = int(numel * (masters.dtype.itemsize + state_bytes))
        directory.require_free(self.nbytes_expected, "offload_optimizer (masters and Adam state)")
        for k, run in enumerate(self.runs):
            (create_run or masters.create_run)(run)
            segments, nbytes = _layout([(i, MASTER_KEY, masters.masters[i].data) for i in run])
            self._layouts.append(segments)
            self._nbytes.append(nbytes)
            self.pool.reserve(nbytes)
            buf = self.writes.acquire()
            for seg in segments:
                seg.view(buf).copy_(masters.masters[seg.piece].data)
            self._write(k, buf)
            self._unbind(k, None)
        self.writes.drain()

    # -- the step ------------------------------------------------------------------------------

    def prefetch(self, order: Sequence[int] | None = None) -> None:
        """Start reading runs, in ``order`` (default: run order), into the buffers free now
        (none if none is)."""
        for k in range(len(self.runs)) if order is None else order:
            if k in self._reads:
                continue
            if not self.writes.available_now():
                return
            self._read(k, self.pool.acquire())

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        step_run: Callable[[list[int]], None],
        order: Sequence[int] | None = None,
    ) -> None:
        """Call ``step_run(run)`` for every run (those of ``order``, in that order; default:
        all, in run order) with its masters and state swapped in.

        Reads run ahead of the step and writes behind it within the buffer pool; returns
        with the last writes in flight (see :meth:`flush`).
        """
        order = list(range(len(self.runs))) if order is None else list(order)
        for i, k in enumerate(order):
            self.step_one(k, optimizer, step_run, order[i + 1 : i + 2])

    def step_one(
        self, k: int, optimizer: torch.optim.Optimizer, step_run: Callable[[list[int]], None], ahead: Sequence[int] = ()
    ) -> None:
        """Swap run ``k`` in (waiting for its read; reading it now if it was not read ahead),
        call ``step_run`` on it and write it back behind; the first run of ``ahead`` starts
        reading meanwhile if a buffer is free."""
        if k not in self._reads:
            self._read(k, self.writes.acquire())
        for j in ahead[:1]:
            if j not in self._reads and self.writes.available_now():
                self._read(j, self.pool.acquire())
        buf, handle = self._reads.pop(k)
        handle.wait()
        self._bind(k, buf, optimizer)
        step_run(self.runs[k])
        self._write(k, self._relayout(k, buf, optimizer))
        self._unbind(k, optimizer)

    def read_done(self, k: int) -> bool:
        """Whether run ``k`` has been read ahead and its read has finished (stepping it
        now would not wait)."""
        return k in self._reads and self._reads[k][1].done()

    def flush(self) -> None:
        """Finish every write and drop every read ahead: the files are whole and no
        buffer is held."""
        try:
            self.writes.drain()
        finally:
            for buf, handle in self._reads.values():
                handle.wait()
                self.pool.release(buf)
            self._reads.clear()

    @contextmanager
    def resident(self, write_back: bool) -> Iterator[None]:
        """Swap every run's masters in (not the optimizer state) for reading, or modifying
        with ``write_back``."""
        self.flush()
        bufs = []
        try:
            for k in range(len(self.runs)):
                buf = aligned_empty(self._nbytes[k], torch.uint8)
                self.aio.sync_read(buf, self._file(k))
                self._bind(k, buf, None)
                bufs.append(buf)
            yield
            if write_back:
                for k, buf in enumerate(bufs):
                    self.aio.sync_write(buf, self._file(k))
        finally:
            for k in range(len(bufs)):
                self._unbind(k, None)

    @contextmanager
    def run_resident(self, k: int, optimizer: torch.optim.Optimizer, write_back: bool) -> Iterator[None]:
        """Swap run ``k``'s masters and optimizer state in (one pool buffer) for reading,
        or for modifying with ``write_back``: then its values, and state entries added to
        its masters meanwhile, go back to its file on exit. For checkpoints: one run in
        memory at a time."""
        self.flush()
        buf = self.pool.acquire()
        try:
            self.aio.sync_read(buf[: self._nbytes[k]], self._file(k))
            self._bind(k, buf, optimizer)
            yield
            if write_back:
                buf = self._relayout(k, buf, optimizer)  # gives ``buf`` back if it made a new one
                self.aio.sync_write(buf[: self._nbytes[k]], self._file(k))
        finally:
            self._unbind(k, optimizer)
            self.pool.release(buf)

    def run_layout(self, k: int) -> dict[int, dict[str, torch.Tensor]]:
        """Run ``k``'s file as ``piece -> {"master" or state key: meta tensor}``: the dtypes
        and shapes it holds, without reading it."""
        buf = torch.empty(self._nbytes[k], dtype=torch.uint8, device="meta")
        out: dict[int, dict[str, torch.Tensor]] = {}
        for seg in self._layouts[k]:
            out.setdefault(seg.piece, {})[seg.key] = seg.view(buf)
        return out

    # -- buffers and files ---------------------------------------------------------------------

    def _file(self, k: int) -> Path:
        return self.directory.file(f"run{k}")

    def _read(self, k: int, buf: torch.Tensor) -> None:
        self.writes.finish_writes_to(self._file(k))  # the step before may still write it
        self._reads[k] = (buf, self.aio.read(buf[: self._nbytes[k]], self._file(k)))

    def _write(self, k: int, buf: torch.Tensor) -> None:
        self.writes.write(buf, buf[: self._nbytes[k]], self._file(k))

    # -- binding tensors to buffers ------------------------------------------------------------

    def _bind(self, k: int, buf: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> None:
        for seg in self._layouts[k]:
            view = seg.view(buf)
            if seg.key == MASTER_KEY:
                self.masters.masters[seg.piece].data = view
            elif optimizer is not None:
                optimizer.state[self.masters.masters[seg.piece]][seg.key] = view

    def _unbind(self, k: int, optimizer: torch.optim.Optimizer | None) -> None:
        for seg in self._layouts[k]:
            placeholder = torch.empty(0, dtype=seg.dtype)
            if seg.key == MASTER_KEY:
                self.masters.masters[seg.piece].data = placeholder
            elif optimizer is not None:
                optimizer.state[self.masters.masters[seg.piece]][seg.key] = placeholder

    def _relayout(self, k: int, buf: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The buffer to write for run ``k``: ``buf`` itself, or after the first step a new
        one laid out with the optimizer state the step just created."""
        known = {(s.piece, s.key) for s in self._layouts[k]}
        entries = []
        for i in self.runs[k]:
            m = self.masters.masters[i]
            entries.append((i, MASTER_KEY, m.data))
            for key, value in optimizer.state.get(m, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and key not in self.in_memory_state:
                    entries.append((i, key, value))
        if all((i, key) in known for i, key, _ in entries):
            return buf
        segments, nbytes = _layout(entries)
        # Views of ``buf`` (the masters, state read from the file) may be overwritten when
        # ``buf`` comes back from the pool as the fresh buffer: copy them out.
        held = buf.untyped_storage().data_ptr()
        values = [t.clone() if t.untyped_storage().data_ptr() == held else t for _, _, t in entries]
        self.pool.release(buf)
        self.pool.reserve(nbytes)
        fresh = self.writes.acquire()
        for seg, value in zip(segments, values):
            seg.view(fresh).copy_(value)
        self._layouts[k], self._nbytes[k] = segments, nbytes
        return fresh

    def nbytes_on_disk(self) -> int:
        """Bytes of this rank's swap files (masters and optimizer state)."""
        return sum(self._nbytes)

    def close(self) -> None:
        """Finish this tier's I/O and delete its swap files (the engine's owner closes it)."""
        try:
            self.flush()
        finally:
            self.directory.remove()

    def nbytes_in_memory(self) -> int:
        """Host bytes of the swap buffers (a working set bounded by ``buffer_count``)."""
        return self.pool.nbytes_held()
