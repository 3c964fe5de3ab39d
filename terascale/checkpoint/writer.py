"""Writing one rank's spans into its shard file, now or from a snapshot in the background."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from terascale.checkpoint.manifest import ShardFile
from terascale.checkpoint.spans import Slice
from terascale.checkpoint.stream import SafetensorsStream, TensorEntry
from terascale.comm.ops import named_range
from terascale.offload.aio import AsyncIO
from terascale.offload.swap import BufferPool


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def write_shard(
    path: Path, described: list[Slice], chunks: Iterable[list[Slice]], aio: AsyncIO, pool: BufferPool | None = None
) -> ShardFile:
    """Write the spans ``described`` (dtype and size from the tensors, which may be
    ``meta``) into ``path``, taking their values from ``chunks`` (the same spans in the
    same order, one resident chunk at a time) through the staging buffers of ``pool``
    (default: a fresh one). Flushed to the device on return. In a torch profiler trace
    the write is the range ``terascale::checkpoint write`` (on the calling thread)."""
    with named_range("terascale::checkpoint write"):
        entries = [TensorEntry(span.tensor_key, t.dtype, (span.numel,)) for span, t in described]
        stream = SafetensorsStream(path, entries, aio, metadata={"format": "pt"}, pool=pool)
        try:
            for chunk in chunks:
                for span, t in chunk:
                    stream.write(span.tensor_key, t.reshape(-1))
            nbytes = stream.close()
        except BaseException:
            stream.abort()
            raise
    return ShardFile(path.name, nbytes, [span for span, _ in described], stream.checksum)


def snapshot(chunks: Iterable[list[Slice]]) -> list[Slice]:
    """Copies of every span's values in host memory, for a write that outlives them."""
    return [(span, t.detach().to("cpu", copy=True).reshape(-1)) for chunk in chunks for span, t in chunk]


def staging_pool() -> BufferPool:
    """Staging buffers for shard writes: 4 x 16 MiB (measured on this machine: more or
    larger buffers write no faster)."""
    pool = BufferPool(4)
    pool.reserve(16 << 20)
    return pool
