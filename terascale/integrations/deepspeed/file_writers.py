"""``deepspeed.io``: file-like writers for ``torch.save``, buffered through a host tensor.

``FastFileWriter(path, FastFileWriterConfig(dnvme_handle=h, pinned_tensor=buf))`` collects
written bytes in ``buf`` (a ``uint8`` host tensor) and writes each full buffer to the file
with the I/O handle ``h`` (an :class:`~terascale.integrations.deepspeed.op_builders.aio_handle`,
as ``AsyncIOBuilder().load().aio_handle(...)`` makes); with ``double_buffer`` the two halves
of ``buf`` alternate, one filling while the other is written. ``PyFileWriter`` is a plain
file; ``MockFileWriter`` counts bytes and writes nothing (for measuring).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FastFileWriterConfig:
    dnvme_handle: Any
    pinned_tensor: torch.Tensor
    double_buffer: bool = True
    num_parallel_writers: int = 1
    writer_rank: int = 0
    global_rank: int = 0

    def __post_init__(self) -> None:
        if self.pinned_tensor.dtype != torch.uint8 or self.pinned_tensor.device.type != "cpu":
            raise ValueError("FastFileWriterConfig.pinned_tensor must be a uint8 host tensor")
        if self.num_parallel_writers != 1:
            raise ValueError("FastFileWriterConfig: num_parallel_writers > 1 (one file written by several ranks) "
                             "is not built; write one file per rank")  # fmt: skip


class _Writer:
    def __init__(self, file_path: str) -> None:
        self.file_path = file_path
        self._written = 0
        self._closed = False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._written

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"write to closed writer of {self.file_path}")


class MockFileWriter(_Writer):
    def write(self, buffer: Any) -> int:
        self._check_open()
        n = memoryview(buffer).nbytes
        self._written += n
        return n


class PyFileWriter(_Writer):
    def __init__(self, file_path: str) -> None:
        super().__init__(file_path)
        self._f = open(file_path, "wb")  # noqa: SIM115 - closed in close()

    def write(self, buffer: Any) -> int:
        self._check_open()
        n = self._f.write(buffer)
        self._written += n
        return n

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._closed:
            self._f.close()
        super().close()


class FastFileWriter(_Writer):
    """See the module docstring."""

    def __init__(self, file_path: str, config: FastFileWriterConfig) -> None:
        super().__init__(file_path)
        self._io = config.dnvme_handle
        flat = config.pinned_tensor.view(-1)
        halves = 2 if config.double_buffer and flat.numel() >= 2 else 1
        size = flat.numel() // halves
        self._buffers = [flat[i * size : (i + 1) * size] for i in range(halves)]
        self._current, self._fill = 0, 0
        self._file_offset = 0  # bytes handed to the handle so far
        self._in_flight = False
        open(file_path, "wb").close()  # start empty, as opening a file for writing does

    def write(self, buffer: Any) -> int:
        self._check_open()
        data = torch.frombuffer(bytearray(memoryview(buffer).cast("B")), dtype=torch.uint8) if memoryview(
            buffer).nbytes else torch.empty(0, dtype=torch.uint8)  # fmt: skip
        done = 0
        while done < data.numel():
            target = self._buffers[self._current]
            n = min(target.numel() - self._fill, data.numel() - done)
            target[self._fill : self._fill + n].copy_(data[done : done + n])
            self._fill += n
            done += n
            if self._fill == target.numel():
                self._drain()
        self._written += done
        return done

    def _drain(self) -> None:
        """Write the current buffer's filled part; with two, switch to the other."""
        if self._fill == 0:
            return
        if self._in_flight:
            self._io.wait()  # the other half's write must finish before it is refilled
            self._in_flight = False
        part = self._buffers[self._current][: self._fill]
        if len(self._buffers) == 2:
            self._io.async_pwrite(part, self.file_path, self._file_offset)
            self._in_flight = True
        else:
            self._io.sync_pwrite(part, self.file_path, self._file_offset)
        self._file_offset += self._fill
        self._current, self._fill = (self._current + 1) % len(self._buffers), 0

    def flush(self) -> None:
        self._drain()
        if self._in_flight:
            self._io.wait()
            self._in_flight = False
        os.truncate(self.file_path, self._file_offset)  # pwrite never shrinks a file

    def close(self) -> None:
        if not self._closed:
            self.flush()
        super().close()
