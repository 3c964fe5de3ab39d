"""A rank's swap directory on the NVMe tier and the aligned host buffers data moves through."""

from __future__ import annotations

import os
import shutil
from collections import deque
from pathlib import Path

import torch

from terascale.offload.aio import AsyncIO, IoHandle
from terascale.offload.host_buffers import aligned_empty, round_up


class SwapDirectory:
    """``<nvme_path>/terascale_swap/<kind>_rank<r>``: one rank's swap files of one kind.

    Created on construction (a clear ``ValueError`` if ``nvme_path`` is missing, not a
    directory or not writable) and removed by :meth:`remove`; files left by an earlier
    run of the same rank are overwritten, never read.
    """

    def __init__(self, nvme_path: str | os.PathLike, kind: str, rank: int) -> None:
        root = Path(nvme_path)
        if not root.is_dir():
            raise ValueError(f"nvme_path '{root}' is not an existing directory; create it or point nvme_path elsewhere")
        if not os.access(root, os.W_OK):
            raise ValueError(f"nvme_path '{root}' is not writable (read-only filesystem or permissions)")
        self.path = root / "terascale_swap" / f"{kind}_rank{rank}"
        self.path.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> Path:
        return self.path / f"{name}.swp"

    def require_free(self, nbytes: int, what: str) -> None:
        """Raise ``ValueError`` unless the filesystem has ``nbytes`` free for ``what``
        (counting the space this directory's files already take, which they reuse)."""
        held = sum(f.stat().st_size for f in self.path.glob("*.swp"))
        free = shutil.disk_usage(self.path).free + held
        if free < nbytes:
            raise ValueError(
                f"{what} needs {nbytes / 2**30:.2f} GiB in '{self.path}' but its filesystem has "
                f"{free / 2**30:.2f} GiB free; free space or point nvme_path at a larger disk"
            )

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class BufferPool:
    """At most ``count`` aligned host byte buffers, all of the largest size asked so far.

    Buffers are allocated on first use; :meth:`reserve` grows the size (dropping free
    buffers that are too small). The pool bounds the host memory a swap pipeline uses.
    """

    def __init__(self, count: int, *, pin_memory: bool = False) -> None:
        if count < 1:
            raise ValueError(f"buffer_count must be at least 1, got {count}")
        self.count = count
        self.nbytes = 0
        self._pin = pin_memory
        self._free: list[torch.Tensor] = []
        self._out = 0

    def reserve(self, nbytes: int) -> None:
        nbytes = round_up(nbytes)
        if nbytes > self.nbytes:
            self.nbytes = nbytes
            self._free = [b for b in self._free if b.numel() >= nbytes]

    def free(self) -> int:
        """Buffers that can be acquired now."""
        return self.count - self._out

    def available(self) -> bool:
        return self.free() > 0

    def acquire(self) -> torch.Tensor:
        assert self.available(), "buffer pool exhausted: release a buffer first"
        self._out += 1
        return self._free.pop() if self._free else aligned_empty(self.nbytes, torch.uint8, pin_memory=self._pin)

    def release(self, buf: torch.Tensor) -> None:
        self._out -= 1
        if buf.numel() >= self.nbytes:
            self._free.append(buf)

    def nbytes_held(self) -> int:
        return (len(self._free) + self._out) * self.nbytes


class WriteBehind:
    """Writes from ``pool``'s buffers that finish in the background: a buffer returns to
    the pool only once its write has finished, so the pool bounds the bytes in flight."""

    def __init__(self, pool: BufferPool, aio: AsyncIO) -> None:
        self.pool = pool
        self.aio = aio
        self._writes: deque[tuple[torch.Tensor, IoHandle, Path]] = deque()

    def acquire(self) -> torch.Tensor:
        """A pool buffer, waiting for the oldest writes to finish while none is free."""
        while not self.pool.available():
            self._finish_oldest()
        return self.pool.acquire()

    def available_now(self) -> bool:
        """Whether a buffer is free without waiting (finished writes give theirs back)."""
        while self._writes and self._writes[0][1].done():
            self._finish_oldest()
        return self.pool.available()

    def write(self, buf: torch.Tensor, data: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> None:
        """Start writing ``data`` (a view of pool buffer ``buf``) to ``path`` at byte
        ``offset``; ``buf`` goes back to the pool when the write has finished."""
        self._writes.append((buf, self.aio.write(data, path, offset), Path(path)))

    def finish_writes_to(self, path: str | os.PathLike) -> None:
        """Wait until no write to ``path`` is in flight (before reading it back)."""
        path = Path(path)
        while any(p == path for _, _, p in self._writes):
            self._finish_oldest()

    def drain(self) -> None:
        """Wait for every write (raising a failed one's error)."""
        while self._writes:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        """Wait for the oldest write in flight (raising its error) and give its buffer back."""
        buf, handle, _ = self._writes.popleft()
        handle.wait()  # raises a failed write here
        self.pool.release(buf)
