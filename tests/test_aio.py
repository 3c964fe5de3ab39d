"""The asynchronous I/O engine: exact round trips, many requests in flight, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from terascale.offload import ALIGNMENT, AioError, AioOptions, AsyncIO, aligned_empty


@pytest.mark.parametrize(
    "options",
    [
        AioOptions(block_size=ALIGNMENT * 2, queue_depth=4, thread_count=2),
        AioOptions(block_size=ALIGNMENT, queue_depth=1, thread_count=1, single_submit=True),
        AioOptions(block_size=ALIGNMENT * 4, overlap_events=False),
    ],
    ids=["pieces-in-parallel", "single-submit", "no-overlap"],
)
def test_round_trips_are_exact_for_aligned_and_unaligned_tensors(tmp_path, options):
    torch.manual_seed(0)
    sources = [
        aligned_empty(10 * ALIGNMENT // 4, torch.float32).normal_(),  # aligned: O_DIRECT pieces
        aligned_empty(12_345, torch.bfloat16).normal_(),  # aligned start, unaligned tail
        torch.randn(7_777, dtype=torch.float64)[1:],  # unaligned start
        torch.arange(3, dtype=torch.int64),  # smaller than a block
    ]
    path = tmp_path / "swap.bin"
    offsets, at = [], 0
    for t in sources:  # pack back to back; aligned ones on block boundaries
        at = -(-at // ALIGNMENT) * ALIGNMENT if t.data_ptr() % ALIGNMENT == 0 else at + 8
        offsets.append(at)
        at += t.numel() * t.element_size()
    with AsyncIO(options) as aio:
        handles = [aio.write(t, path, off) for t, off in zip(sources, offsets)]
        assert [h.wait() for h in handles] == [t.numel() * t.element_size() for t in sources]
        targets = [torch.empty_like(t) for t in sources]
        handles = [aio.read(dst, path, off) for dst, off in zip(targets, offsets)]
        assert aio.synchronize() >= 1
        for h in handles:
            assert h.done()
        if os.name == "posix" and hasattr(os, "O_DIRECT"):
            assert str(path) in aio.direct_paths  # ext4 and xfs accept O_DIRECT
    for src, dst in zip(sources, targets):
        assert torch.equal(src, dst)


def test_aligned_empty_is_aligned_and_sized():
    for numel, dtype in [(1, torch.float32), (1025, torch.bfloat16), (ALIGNMENT, torch.uint8)]:
        t = aligned_empty(numel, dtype)
        assert t.numel() == numel and t.dtype == dtype and t.data_ptr() % ALIGNMENT == 0
        assert t.untyped_storage().nbytes() >= -(-numel * dtype.itemsize // ALIGNMENT) * ALIGNMENT


def test_missing_directory_and_missing_file_name_the_path(tmp_path):
    with AsyncIO() as aio:
        with pytest.raises(AioError, match="does not exist; create it or choose another directory"):
            aio.write(torch.zeros(4), tmp_path / "nope" / "swap.bin")
        with pytest.raises(AioError, match="no such file"):
            aio.read(torch.zeros(4), tmp_path / "absent.bin")


def test_short_read_is_an_error_not_silent_garbage(tmp_path):
    path = tmp_path / "short.bin"
    with AsyncIO(AioOptions(block_size=ALIGNMENT)) as aio:
        aio.sync_write(torch.ones(ALIGNMENT // 4), path)  # one block
        dst = torch.zeros(3 * ALIGNMENT // 4)
        with pytest.raises(AioError, match=r"short read of .*short\.bin.*file ends at 4096"):
            aio.sync_read(dst, path)


def test_a_failed_write_raises_with_the_path(tmp_path):
    # A file-size limit makes the kernel refuse writes past it (EFBIG), as a full disk
    # refuses them (ENOSPC); run in a child so the limit binds nothing else.
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from terascale.offload import AioError, AsyncIO, aligned_empty
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        t = aligned_empty(1 << 20, torch.float32)  # 4 MiB
        with AsyncIO() as aio:
            try:
                aio.sync_write(t, {str(tmp_path / "big.bin")!r})
            except AioError as exc:
                print("ERROR", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "big.bin" in out.stdout and "write of bytes" in out.stdout


def test_options_are_checked_and_read_from_the_config():
    from terascale.config import Config

    cfg = Config.load({"train_batch_size": 1, "aio": {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 2}})
    opts = AioOptions.from_config(cfg.aio)
    assert (opts.block_size, opts.queue_depth, opts.thread_count) == (262144, 4, 2)
    with pytest.raises(ValueError, match="multiple of 4096"):
        AioOptions(block_size=1000)
