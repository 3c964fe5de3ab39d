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
  a group's pieces in one pool buffer laid out as its file (no fetch holds one during
  the step), so the step adds no host memory of its own, and returns with the last
  writes in flight: they finish under the next forward.
- The step's staging buffers double as the next forward's fetches ([Note: staged
  shards]). The first groups, up to ``max_in_cpu`` elements, stay in host memory and
  have no file.

Each group's shard is in one of four residency states: RESIDENT (``fg.shard`` holds the
values), FETCHING (a read into a pool buffer is in flight), STAGED (the last step left
the values in a pool buffer, whose writes may still be in flight) or OFFLOADED (only the
file holds them; ``fg.shard`` is an empty placeholder). A fetch never takes the pool's
last buffer, so the gather that needs a shard now always finds one.

[Note: staged shards]
The forward after a step gathers the groups in the order the step wrote them, and a
read of a shard would first have to wait for the step's write of it. So the step keeps
the staging buffers of its first groups (all but one of the pool's buffers; the last
cycles through the other groups) as those groups' fetched shards: the forward gathers
them from memory, and their writes finish under it; a buffer goes back to the pool once
its group is gathered and its writes are done. Only a shard the step wrote whole (every
element of a parameter: no frozen ones) is kept; the rest of a staging buffer is padding.
On the 16.8M-parameter GPT of ``bench/step_time.py`` this takes every parameter read out
of the forward after a step. A step under backward ([Note: the optimizer step under
backward]) writes the last groups first, while backward still fetches the first ones: its
staging buffers cycle, and at its end those still held (the first groups', written last)
are kept for the forward.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from terascale.offload.aio import AsyncIO, IoHandle
from terascale.offload.host_buffers import aligned_empty, round_up
from terascale.offload.policy import ParamOffload
from terascale.offload.swap import BufferPool, SwapDirectory

if TYPE_CHECKING:
    from terascale.zero.flat_group import FlatParamGroup


class Residency(enum.Enum):
    RESIDENT = "resident"
    FETCHING = "fetching"
    STAGED = "staged"
    OFFLOADED = "offloaded"


class _Staging:
    """A group's staging buffer in a step: the file's image, the step's writes from it,
    the elements written, and whether it is kept as the group's next fetch."""

    def __init__(self, buf: torch.Tensor, keep: bool) -> None:
        self.buf = buf
        self.keep = keep
        self.writes: list[IoHandle] = []
        self.written = 0  # elements

    def done(self) -> bool:
        return all(h.done() for h in self.writes)

    def wait(self) -> None:
        for h in self.writes:
            h.wait()


class OffloadedParams:
    """Shards of the groups :meth:`add`-ed with ``offload`` on ``policy``'s tier (a :class:`ShardHome`).

    On NVMe the shards move through ``aio``, the rank's swap engine (its owner closes it).
    """

    def __init__(self, policy: ParamOffload, rank: int, aio: AsyncIO | None = None) -> None:
        assert policy.enabled
        self.groups: list[FlatParamGroup] = []
        self._index: dict[int, int] = {}
        self.policy = policy
        self.state: dict[int, Residency] = {}
        self._pending: dict[int, tuple[torch.Tensor, IoHandle]] = {}
        self.fetches = 0  # reads issued (for tests and reports)
        self.fetches_ahead = 0  # of which started ahead of the gather that needed them
        self.staged_gathers = 0  # gathers served by a step's staging buffer: no read at all
        self._pin = policy.pin_memory  # the policy pins only where an accelerator is
        self._kept_numel = 0  # elements of shards kept in host memory under max_in_cpu
        self._disk_nbytes = 0
        self._staging: dict[int, _Staging] = {}  # groups the last step wrote, in its order
        self._kept = 0  # staging buffers of this step kept as fetches ([Note: staged shards])
        self._whole: dict[int, int] = {}  # elements of each shard that belong to a parameter
        self._under_backward = False  # this step's writes run under backward ([Note: staged shards])
        # Groups with a second file, and whether it is the current one ([Note: the
        # overlapped host step]: the update writes one while the window reads the other).
        self._second: dict[int, bool] = {}
        if policy.device == "cpu":
            self.directory = self.aio = self.pool = None
            return
        assert aio is not None, "parameter shards on NVMe need the rank's swap engine"
        self.directory = SwapDirectory(policy.nvme_path, "params", rank)
        self.aio = aio
        # Buffers as large as the largest shard, not buffer_size: that is all a fetch needs.
        self.pool = BufferPool(max(2, policy.buffer_count), pin_memory=self._pin)

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
        # DeepSpeed swaps each parameter through a buffer_size buffer and needs the largest
        # parameter to fit one; a config it runs with runs here (the buffers here hold a
        # group's shard, whatever buffer_size says).
        largest = max(fg.layout.slots, key=lambda slot: slot.numel)
        if largest.numel > self.policy.buffer_size:
            raise ValueError(
                f"offload_param.buffer_size is {self.policy.buffer_size} elements but parameter "
                f"'{largest.name}' has {largest.numel}; raise buffer_size to at least {largest.numel}"
            )
        if self._kept_numel + numel <= self.policy.max_in_cpu:
            self._kept_numel += numel
            return
        self.pool.reserve(_file_nbytes(fg))
        self._disk_nbytes += _file_nbytes(fg)
        self.directory.require_free(self._disk_nbytes, "offload_param")
        self._write_whole(g, fg.shard)
        lo, hi = fg.layout.shard_range(fg.rank)
        self._whole[g] = sum(max(0, min(hi, s.offset + s.numel) - max(lo, s.offset)) for s in fg.layout.slots)
        fg.shard = torch.empty(0, dtype=fg.dtype, device=fg.device)
        self.state[g] = Residency.OFFLOADED
        fg.home = self

    def _file(self, g: int) -> Path:
        return self.directory.file(f"group{g}" + ("b" if self._second.get(g) else ""))

    # -- the overlapped step's second files ([Note: the overlapped host step]) -----------------

    def on_disk(self, g: int) -> bool:
        """Whether group ``g``'s shard lives in a swap file (not in host memory)."""
        return self.state.get(g, Residency.RESIDENT) is not Residency.RESIDENT

    def add_second_files(self, groups: Sequence[int]) -> None:
        """Give each of ``groups`` (on disk) a second swap file, a copy of its first."""
        self.settle()
        for g in groups:
            if g in self._second:
                continue
            fg = self.groups[g]
            self._disk_nbytes += _file_nbytes(fg)
            self.directory.require_free(self._disk_nbytes, "offload_param (overlap_step's second files)")
            raw = aligned_empty(_file_nbytes(fg), torch.uint8)
            self.aio.sync_read(raw, self._file(g))
            self._second[g] = False
            self.aio.sync_write(raw, self.next_file(g))

    def next_file(self, g: int) -> Path:
        """The file of group ``g`` that gathers do not read now: the update writes it."""
        return self.directory.file(f"group{g}" + ("" if self._second[g] else "b"))

    def switch_files(self, groups: Sequence[int]) -> None:
        """The update wrote ``groups``' next files whole: they are current from now on (what
        was fetched or staged of the old ones is dropped)."""
        self.settle()
        for g in groups:
            self._second[g] = not self._second[g]

    def _write_whole(self, g: int, shard: torch.Tensor) -> None:
        """Write group ``g``'s file: ``shard``, padded to whole 4 KiB blocks so that reads
        of it go O_DIRECT from end to end."""
        buf = aligned_empty(_file_nbytes(self.groups[g]), torch.uint8)
        buf[: shard.numel() * shard.element_size()].view(shard.dtype).copy_(shard.detach().reshape(-1))
        buf[shard.numel() * shard.element_size() :].zero_()
        self.aio.sync_write(buf, self._file(g))

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
        elif self.state[g] is Residency.STAGED:
            buf = self._staging[g].buf
            self.staged_gathers += 1
        else:
            return
        fg.shard = buf[: _shard_nbytes(fg)].view(fg.dtype)
        if fg.device.type != "cpu":
            fg.shard = fg.shard.to(fg.device)

    def consumed(self, fg: FlatParamGroup) -> None:
        g = self._index[id(fg)]
        if g in self._pending:
            buf, _ = self._pending.pop(g)
            self.pool.release(buf)
        elif self.state.get(g) is Residency.STAGED:
            self._staging[g].keep = False  # its buffer goes back once its writes are done
            self._reap()
        else:
            return
        fg.shard = torch.empty(0, dtype=fg.dtype, device=fg.device)
        self.state[g] = Residency.OFFLOADED

    def _start_read(self, g: int) -> None:
        fg = self.groups[g]
        if g in self._staging:  # the step's writes of this shard come first
            self._retire(g)
        buf = self.pool.acquire()
        self._pending[g] = (buf, self.aio.read(buf[: _file_nbytes(fg)], self._file(g)))
        self.state[g] = Residency.FETCHING
        self.fetches += 1

    def _spare_buffers(self, n: int, wait: bool = False) -> bool:
        """Whether ``n`` pool buffers are free (staging buffers whose writes are done and
        that are not kept give theirs back); with ``wait``, wait for such writes, then
        drop staged shards, until they are."""
        self._reap()
        if self.pool.free() >= n or not wait:
            return self.pool.free() >= n
        for keep in (False, True):
            for g in [g for g, st in self._staging.items() if st.keep is keep]:
                if self.pool.free() >= n:
                    break
                self._retire(g)
        # Now only fetches hold buffers, each released when its gather has copied it.
        assert self.pool.free() >= n, "every parameter buffer is held by a fetch; raise offload_param.buffer_count"
        return True

    def _reap(self) -> None:
        for g in [g for g, st in self._staging.items() if not st.keep and st.done()]:
            self._retire(g)

    def _retire(self, g: int) -> None:
        """Wait for the step's writes of group ``g`` and give its staging buffer back."""
        staging = self._staging.pop(g)
        staging.wait()  # raises a failed write here
        self.pool.release(staging.buf)
        if self.state.get(g) is Residency.STAGED:
            self.state[g] = Residency.OFFLOADED

    # -- the optimizer step writes shards ------------------------------------------------------

    @torch.no_grad()
    def write_piece(self, g: int, lo: int, values: torch.Tensor) -> None:
        """Set elements ``[lo, lo + len(values))`` of group ``g``'s shard to ``values``."""
        fg = self.groups[g]
        if self.state.get(g, Residency.RESIDENT) is Residency.RESIDENT:
            fg.shard[lo : lo + values.numel()].copy_(values)
            return
        if self._under_backward:  # other groups' fetches for backward go on
            self._settle_group(g)
        else:
            assert not self._pending, "settle() before the step writes"
        assert self.state[g] is Residency.OFFLOADED, f"write to group {g} while {self.state[g]}"
        staging = self._staging.get(g) or self._stage(g)
        # The buffer is laid out as the file: a piece's memory is as misaligned as its file
        # offset, so all of it but an unaligned head and tail goes O_DIRECT.
        at, nbytes = lo * fg.dtype.itemsize, values.numel() * fg.dtype.itemsize
        staged = staging.buf[at : at + nbytes]
        staged.view(fg.dtype).copy_(values.detach().reshape(-1))
        staging.writes.append(self.aio.write(staged, self._file(g), at))
        staging.written += values.numel()

    def _stage(self, g: int) -> _Staging:
        """A pool buffer for group ``g``'s pieces in this step; the first groups' are kept
        as their next fetch, the others cycle through what is left. Under backward none is
        kept yet (the pool serves backward's fetches; :meth:`finish_step` decides)."""
        keep = self._kept < self.pool.count - 1 and not self._under_backward
        if not self.pool.available():  # wait for the oldest cycling buffer's writes
            cycling = [h for h, st in self._staging.items() if not st.keep]
            if cycling:
                self._retire(cycling[0])
            elif self._pending:  # under backward the buffers may be fetches: drop the one furthest ahead
                self._drop_fetch(next(reversed(self._pending)))
            else:  # a shard staged for a gather: it is read again instead
                self._retire(next(iter(self._staging)))
        staging = _Staging(self.pool.acquire(), keep)
        self._kept += keep
        self._staging[g] = staging
        return staging

    def settle(self) -> None:
        """Drop fetches and staged shards nobody gathered (a trace that changed), and wait
        for the last step's writes; before the step writes."""
        for g in list(self._pending):
            self._drop_fetch(g)
        self._settle_staging()

    def _drop_fetch(self, g: int) -> None:
        buf, handle = self._pending.pop(g)
        handle.wait()
        self.pool.release(buf)
        self.state[g] = Residency.OFFLOADED

    def begin_writes_under_backward(self) -> None:
        """The coming step writes its shards under backward, group by group as their
        gradients are final ([Note: the optimizer step under backward]): fetches of the
        groups backward still needs stay, and which staging buffers the next forward keeps
        is decided by :meth:`finish_step`."""
        self._under_backward = True

    def _settle_group(self, g: int) -> None:
        """Before group ``g``'s first write of a step under backward: drop a fetch of it,
        and a shard the last step staged for a gather that never came."""
        if g in self._pending:
            self._drop_fetch(g)
        if self.state.get(g) is Residency.STAGED:
            self._retire(g)

    def _settle_staging(self) -> None:
        for g in list(self._staging):
            self._retire(g)

    def finish_step(self) -> None:
        """Keep the step's first staging buffers whose shard it wrote whole as those groups'
        next fetches; the rest go back as their writes finish ([Note: staged shards])."""
        if self.pool is None:
            return
        if self._under_backward:
            # Backward wrote the last groups first and the first groups last: the staging
            # buffers still held are the first groups', which the forward gathers first.
            kept = 0
            for g in sorted(self._staging):
                staging = self._staging[g]
                staging.keep = kept < self.pool.count - 1 and staging.written == self._whole[g]
                kept += staging.keep
            self._under_backward = False
        for g, staging in self._staging.items():
            if staging.keep and staging.written == self._whole[g]:
                self.state[g] = Residency.STAGED
            else:
                staging.keep = False
        self._kept = 0
        self._reap()

    @contextmanager
    def resident(self, indices: Sequence[int], write_back: bool) -> Iterator[None]:
        """Hold the shards of groups ``indices`` in memory (read synchronously); with
        ``write_back`` their (modified) values go back to the files on exit."""
        if self.pool is not None:
            self._settle_staging()
        loaded = []
        try:
            for g in indices:
                if self.state.get(g) is Residency.OFFLOADED:
                    fg = self.groups[g]
                    raw = aligned_empty(_file_nbytes(fg), torch.uint8)
                    self.aio.sync_read(raw, self._file(g))
                    fg.shard = raw[: _shard_nbytes(fg)].view(fg.dtype).to(fg.device)
                    self.state[g] = Residency.RESIDENT
                    loaded.append(g)
            yield
            if write_back:
                for g in loaded:
                    self._write_whole(g, self.groups[g].shard.cpu())
        finally:
            for g in loaded:
                fg = self.groups[g]
                fg.shard = torch.empty(0, dtype=fg.dtype, device=fg.device)
                self.state[g] = Residency.OFFLOADED

    # -- accounting and teardown --------------------------------------------------------------

    def nbytes_on_disk(self) -> int:
        first = sum(_shard_nbytes(self.groups[g]) for g, s in self.state.items() if s is not Residency.RESIDENT)
        return first + sum(_shard_nbytes(self.groups[g]) for g in self._second)

    def nbytes_in_memory(self) -> int:
        return 0 if self.pool is None else self.pool.nbytes_held()

    def close(self) -> None:
        """Finish this tier's I/O and delete its swap files (the engine stays open)."""
        if self.aio is None:
            return
        try:
            self._settle_staging()
            for buf, handle in self._pending.values():
                handle.wait()
        finally:
            self.directory.remove()


def _shard_nbytes(fg: FlatParamGroup) -> int:
    return fg.layout.shard_numel * fg.dtype.itemsize


def _file_nbytes(fg: FlatParamGroup) -> int:
    """Bytes of a group's swap file: its shard in whole 4 KiB blocks."""
    return round_up(_shard_nbytes(fg))
