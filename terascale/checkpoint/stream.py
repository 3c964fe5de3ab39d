"""A safetensors file written tensor by tensor through the asynchronous I/O engine.

[Note: streamed shard files]
``safetensors.torch.save_file`` serialises a whole dict of tensors into one bytes object
first, so saving a rank's state would cost that state twice in host memory, and state
that lives on NVMe would have to be materialised whole. The safetensors format is a
little-endian u64 header length, a JSON header giving each tensor's dtype, shape and
byte range in the data section, then the data section. Since the header only needs the
tensors' dtypes and shapes, :class:`SafetensorsStream` writes it first and then streams
each tensor's bytes, in header order, through a few aligned staging buffers that the I/O
engine writes behind (``O_DIRECT`` where the filesystem allows it). The header is padded
with spaces, which the format allows, so that the data section starts on a 4 KiB
boundary and every full staging buffer lands at an aligned file offset. Files are read
back with the ``safetensors`` library itself (``safe_open(...).get_slice``), which reads
just the byte ranges asked for.

The stream also hashes the file's bytes as they go (:attr:`SafetensorsStream.checksum`,
``[Note: checkpoint checksums]``). The I/O engine may finish writes in any order, but the
staging buffers are filled and handed over strictly in file order (each one at the file
offset where the previous one ended), and one thread hashes them in the order handed
over, so the hash runs over the file from its first byte to its last. That thread hashes
a buffer while the next one is filled (the hash releases the GIL): inline, hashing (4 GiB/s)
would add to the copy into the buffer on the filling thread, and a disk or a device-to-host
copy faster than about 2 GB/s would then wait for it. (On this 2-CPU machine, disk-bound,
both measured the same: 288 MiB in 0.15 s with or without the hash.) A buffer goes back to
the pool once its write has finished, which can be before its hash has: the stream waits
for the hash before it fills that buffer again.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from terascale.checkpoint.integrity import Checksum
from terascale.offload.aio import ALIGNMENT, AsyncIO
from terascale.offload.swap import BufferPool, WriteBehind, round_up

# The safetensors names of the dtypes a checkpoint holds.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its key, dtype and shape (the header is built from these)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header(entries: Sequence[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    at = 0
    for e in entries:
        if e.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"cannot store {e.key} of dtype {e.dtype} in a safetensors file")
        header[e.key] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    padded = round_up(8 + len(text)) - 8  # the data section starts 4 KiB-aligned
    return struct.pack("<Q", padded) + text + b" " * (padded - len(text))


class SafetensorsStream:
    """Writes ``entries`` to ``path`` as a safetensors file: :meth:`write` each tensor in
    order, then :meth:`close`, which flushes the file to the device (``fsync``).

    At most ``buffer_count`` staging buffers of ``buffer_bytes`` are in memory at once,
    whatever the file's size; or the buffers of ``pool``, which a caller writing many
    files keeps between them (allocating and first touching the pages costs about as much
    as copying the bytes into them). Any error leaves a file that must be considered unwritten.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        entries: Sequence[TensorEntry],
        aio: AsyncIO,
        *,
        metadata: dict[str, str] | None = None,
        buffer_bytes: int = 16 << 20,
        buffer_count: int = 3,
        pool: BufferPool | None = None,
    ) -> None:
        self.path = Path(path)
        self.entries = list(entries)
        self.aio = aio
        head = _header(self.entries, metadata)
        self._data_start = len(head)
        self.nbytes = len(head) + sum(e.nbytes for e in self.entries)
        self._next = 0  # index of the next entry to write
        self._checksum = Checksum()
        self._checksum.update(head)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="terascale-checksum")
        self._hashing: deque[tuple[torch.Tensor, Future]] = deque()  # buffers handed over, oldest first
        if pool is None:
            pool = BufferPool(max(2, buffer_count))
            pool.reserve(max(ALIGNMENT, round_up(buffer_bytes)))
        self._pool = pool
        self._writes = WriteBehind(self._pool, aio)
        with open(self.path, "wb") as f:  # a fresh file: nothing of an older one survives
            f.write(head)
            # Allocating every block up front makes the writes overwrites (about 8% faster
            # here on ext4) and a full disk fails now, before any data is written.
            try:
                os.posix_fallocate(f.fileno(), 0, self.nbytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise OSError(exc.errno, f"cannot allocate {self.nbytes} bytes for '{self.path}': {exc.strerror}") from exc
        self._buf: torch.Tensor | None = None
        self._fill = 0  # _buf's bytes used (from its start)
        self._skew = 0  # where _buf's staged bytes begin: _offset mod ALIGNMENT
        self._offset = self._data_start  # file offset of _buf[_skew]

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (any device, contiguous or not) as entry ``key``. Its bytes
        are copied into a staging buffer before this returns: it may change right after."""
        assert self._next < len(self.entries), f"{self.path}: more tensors than entries"
        entry = self.entries[self._next]
        if key != entry.key or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(
                f"{self.path}: expected {entry.key} {entry.dtype} {list(entry.shape)}, got {key} "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        self._next += 1
        flat = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else None
        done = 0
        total = entry.nbytes
        while done < total:
            if self._buf is None:
                self._buf = self._acquire()
                # The bytes go as far into the buffer as the file offset is past a block
                # boundary, so that every piece but the head of the first goes O_DIRECT
                # (the header makes the data start anywhere).
                self._fill = self._skew = self._offset % ALIGNMENT
            n = min(total - done, self._buf.numel() - self._fill)
            self._buf[self._fill : self._fill + n].copy_(flat[done : done + n])
            self._fill += n
            done += n
            if self._fill == self._buf.numel():
                self._flush()

    def _acquire(self) -> torch.Tensor:
        """A staging buffer to fill: written and hashed (``[Note: streamed shard files]``)."""
        buf = self._writes.acquire()
        while self._hashing and (self._hashing[0][1].done() or any(b is buf for b, _ in self._hashing)):
            self._hashing.popleft()[1].result()  # one thread hashes in order: the older ones first
        return buf

    def _flush(self) -> None:
        if self._buf is None:
            return
        data = self._buf[self._skew : self._fill]
        self._writes.write(self._buf, data, self.path, self._offset)
        # Both the write and the hash only read the buffer.
        self._hashing.append((self._buf, self._hasher.submit(self._checksum.update, data.numpy())))
        self._offset += self._fill - self._skew
        self._buf = None

    def close(self) -> int:
        """Write what is staged, wait for every write, ``fsync``; the file's size in bytes."""
        if self._next != len(self.entries):
            missing = [e.key for e in self.entries[self._next :]]
            raise AssertionError(f"{self.path}: {len(missing)} tensors not written, first {missing[0]}")
        try:
            self._flush()
            self._writes.drain()
        finally:
            self._hasher.shutdown(wait=True)  # every buffer hashed: the checksum is the file's
            self._hashing.clear()
            self.aio.close_file(self.path, fsync=True)
        return self.nbytes

    @property
    def checksum(self) -> str:
        """The checksum of every byte written so far (the whole file after :meth:`close`)."""
        return self._checksum.value

    def abort(self) -> None:
        """Stop after an error: wait for writes in flight (ignoring their errors), close the file."""
        try:
            while True:
                try:
                    self._writes.drain()  # each failed write is dropped as it raises
                    break
                except OSError:
                    continue
        finally:
            self._hasher.shutdown(wait=True)
            self._hashing.clear()
            self.aio.close_file(self.path)
