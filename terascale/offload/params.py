"""Stage-3 parameter shards on the host or NVMe between their gathers.

[Note: parameter offload]
At stage 3 a group's own shard is needed only to be all-gathered (before its forward and
its backward) and to be overwritten by the optimizer step. With ``offload_param`` the
shards of the non-persistent groups live on a tier between those moments:

- ``cpu``: in host memory (pinned where a GPU is present); the gather copies the shard
  into the device's full buffer. On a machine without an accelerator the host is the
  device, so this tier changes nothing there.
- ``nvme``: in one swap file per group and rank. A shard is *fetched* (read into one of
  ``buffer_count`` aligned host buffers) ahead of its gather, along the stage-3 trace
  (see [Note: gather schedule]); the gather copies it into the full buffer and the buffer
  goes back to the pool at once. The optimizer step writes each updated piece of a shard
  straight into its file (the file holds the shard's bytes at their offsets; padding and
  frozen elements never change), so a step never reads shards back. The step stages
  those pieces in the same pool buffers (no fetch holds one during the step), so the
  step adds no host memory of its own. The first groups, up to ``max_in_cpu``
  elements, stay in host memory and have no file.

Each group's shard is in one of three residency states: RESIDENT (``fg.shard`` holds the
values), FETCHING (a read into a pool buffer is in flight) or OFFLOADED (only the file
holds them; ``fg.shard`` is an empty placeholder). A fetch never takes the pool's last
buffer, so the gather that needs a shard now always finds one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from terascale.offload.aio import AsyncIO, IoHandle
from terascale.offload.policy import ParamOffload
from terascale.offload.swap import BufferPool, SwapDirectory, WriteBehind

if TYPE_CHECKING:
    from terascale.zero.flat_group import FlatParamGroup


class Residency(enum.Enum):
    RESIDENT = "resident"
    FETCHING = "fetching"
    OFFLOADED = "offloaded"


class OffloadedParams:
    """Shards of the groups :meth:`add`-ed with ``offload`` on ``policy``'s tier (a :class:`ShardHome`)."""

    def __init__(self, policy: ParamOffload, rank: int) -> None:
        assert policy.enabled
        self.groups: list[FlatParamGroup] = []
        self._index: dict[int, int] = {}
        self.policy = policy
        self.state: dict[int, Residency] = {}
        self._pending: dict[int, tuple[torch.Tensor, IoHandle]] = {}
        self.fetches = 0  # reads issued (for tests and reports)
        self.fetches_ahead = 0  # of which started ahead of the gather that needed them
        self._pin = policy.pin_memory  # the policy pins only where an accelerator is
        self._kept_numel = 0  # elements of shards kept in host memory under max_in_cpu
        self._disk_nbytes = 0
        if policy.device == "cpu":
            self.directory = self.aio = self.pool = self.writes = None
            return
        self.directory = SwapDirectory(policy.nvme_path, "params", rank)
        self.aio = AsyncIO(policy.aio, trace_name="terascale::swap")
        # Buffers as large as the largest shard, not buffer_size: that is all a fetch needs.
        self.pool = BufferPool(max(2, policy.buffer_count), pin_memory=self._pin)
        self.writes = WriteBehind(self.pool, self.aio)  # the step's piece writes

    def add(self, fg: FlatParamGroup, offload: bool) -> None:
        """Take group ``fg`` (the next group in order) onto the tier if ``offload``; on
        NVMe its shard is written out now, so a model is built one group at a time."""
        g = len(self.groups)
        self.groups.append(fg)
        self._index[id(fg)] = g
        if not offload:
            return
        self.state[g] = Residency.RESIDENT
        if self.policy.device == "cpu":
            if fg.device.type != "cpu":
                fg.shard = fg.shard.to("cpu").pin_memory() if self._pin else fg.shard.to("cpu")
            return
        numel = fg.layout.shard_numel
        if numel > self.policy.buffer_size:
            raise ValueError(
                f"offload_param.buffer_size is {self.policy.buffer_size} elements but parameter group "
                f"{g}'s shard has {numel}; raise buffer_size to at least {numel}"
            )
        if self._kept_numel + numel <= self.policy.max_in_cpu:
            self._kept_numel += numel
            return
        self.pool.reserve(_shard_nbytes(fg))
        self._disk_nbytes += _shard_nbytes(fg)
        self.directory.require_free(self._disk_nbytes, "offload_param")
        self.aio.sync_write(fg.shard.detach().cpu().contiguous(), self._file(g))
        fg.shard = torch.empty(0, dtype=fg.dtype, device=fg.device)
        self.state[g] = Residency.OFFLOADED
        fg.home = self

    def _file(self, g: int) -> Path:
        return self.directory.file(f"group{g}")

    # -- ShardHome ---------------------------------------------------------------------------

    def fetch(self, g: int) -> bool:
        """Start reading group ``g``'s shard if it is offloaded; False when no spare
        buffer is left for it (True when there is nothing to read)."""
        if self.state.get(g) is not Residency.OFFLOADED:
            return True
        if not self._spare_buffers(2):
            return False
        self._start_read(g)
        self.fetches_ahead += 1
        return True

    def ready(self, fg: FlatParamGroup) -> None:
        g = self._index[id(fg)]
        if self.state[g] is Residency.OFFLOADED:
            self._spare_buffers(1, wait=True)
            self._start_read(g)
        if self.state[g] is Residency.FETCHING:
            buf, handle = self._pending[g]
            handle.wait()
            fg.shard = buf[: _shard_nbytes(fg)].view(fg.dtype)
            if fg.device.type != "cpu":
                fg.shard = fg.shard.to(fg.device)

    def consumed(self, fg: FlatParamGroup) -> None:
        g = self._index[id(fg)]
        if g in self._pending:
            buf, _ = self._pending.pop(g)
            self.pool.release(buf)
            fg.shard = torch.empty(0, dtype=fg.dtype, device=fg.device)
            self.state[g] = Residency.OFFLOADED

    def _start_read(self, g: int) -> None:
        fg = self.groups[g]
        buf = self.pool.acquire()
        self._pending[g] = (buf, self.aio.read(buf[: _shard_nbytes(fg)], self._file(g)))
        self.state[g] = Residency.FETCHING
        self.fetches += 1

    def _spare_buffers(self, n: int, wait: bool = False) -> bool:
        # A read must see the step's writes, which also give their buffers back. Then
        # only fetches hold pool buffers: each is released when its gather has copied it.
        self._drain_writes()
        if self.pool.free() >= n:
            return True
        assert not wait, "every parameter buffer is held by a fetch; raise offload_param.buffer_count"
        return False

    # -- the optimizer step writes shards ------------------------------------------------------

    @torch.no_grad()
    def write_piece(self, g: int, lo: int, values: torch.Tensor) -> None:
        """Set elements ``[lo, lo + len(values))`` of group ``g``'s shard to ``values``."""
        fg = self.groups[g]
        if self.state.get(g, Residency.RESIDENT) is Residency.RESIDENT:
            fg.shard[lo : lo + values.numel()].copy_(values)
            return
        assert self.state[g] is Residency.OFFLOADED, f"write to group {g} while {self.state[g]}"
        assert not self._pending, "settle() before the step writes"
        # A piece lies within one shard, and a pool buffer holds the largest shard.
        nbytes = values.numel() * fg.dtype.itemsize
        buf = self.writes.acquire()
        staged = buf[:nbytes]
        staged.view(fg.dtype).copy_(values.detach().reshape(-1))
        self.writes.write(buf, staged, self._file(g), lo * fg.dtype.itemsize)

    def _drain_writes(self) -> None:
        if self.writes is not None:
            self.writes.drain()

    def settle(self) -> None:
        """Drop fetches nobody gathered (a trace that changed); before the step writes."""
        for g in list(self._pending):
            buf, handle = self._pending.pop(g)
            handle.wait()
            self.pool.release(buf)
            self.state[g] = Residency.OFFLOADED

    def finish_step(self) -> None:
        """Wait for the step's writes (the next gathers read the files)."""
        self._drain_writes()

    @contextmanager
    def resident(self, indices: Sequence[int], write_back: bool) -> Iterator[None]:
        """Hold the shards of groups ``indices`` in memory (read synchronously); with
        ``write_back`` their (modified) values go back to the files on exit."""
        self._drain_writes()
        loaded = []
        try:
            for g in indices:
                if self.state.get(g) is Residency.OFFLOADED:
                    fg = self.groups[g]
                    shard = torch.empty(fg.layout.shard_numel, dtype=fg.dtype)
                    self.aio.sync_read(shard, self._file(g))
                    fg.shard = shard.to(fg.device)
                    self.state[g] = Residency.RESIDENT
                    loaded.append(g)
            yield
            if write_back:
                for g in loaded:
                    self.aio.sync_write(self.groups[g].shard.detach().cpu().contiguous(), self._file(g))
        finally:
            for g in loaded:
                fg = self.groups[g]
                fg.shard = torch.empty(0, dtype=fg.dtype, device=fg.device)
                self.state[g] = Residency.OFFLOADED

    # -- accounting and teardown --------------------------------------------------------------

    def nbytes_on_disk(self) -> int:
        return sum(_shard_nbytes(self.groups[g]) for g, s in self.state.items() if s is not Residency.RESIDENT)

    def nbytes_in_memory(self) -> int:
        return 0 if self.pool is None else self.pool.nbytes_held()

    def close(self) -> None:
        if self.aio is None:
            return
        try:
            self._drain_writes()
            for buf, handle in self._pending.values():
                handle.wait()
            self.aio.close()
        finally:
            self.directory.remove()


def _shard_nbytes(fg: FlatParamGroup) -> int:
    return fg.layout.shard_numel * fg.dtype.itemsize
