"""The asynchronous I/O engine: exact round trips, many requests in flight, clear errors,
the priority queue, huge-page buffers and the ``aio: "auto"`` probe."""

from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from terascale.offload import ALIGNMENT, AioError, AioOptions, AsyncIO, aligned_empty
from terascale.offload import aio as aio_module
from terascale.offload import probe
from terascale.offload.host_buffers import HUGE_PAGE, on_huge_pages
from terascale.offload.kernel_aio import open_queue
from terascale.offload.probe import aio_options

from distributed import run_forked

BACKENDS = ["threads"] + (["kernel"] if open_queue(1) is not None else [])


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each engine test runs on both backends: worker threads and the kernel's AIO queue."""
    return request.param


@pytest.mark.parametrize(
    "options",
    [
        AioOptions(block_size=ALIGNMENT * 2, queue_depth=4, thread_count=2),
        AioOptions(block_size=ALIGNMENT, queue_depth=1, thread_count=1, single_submit=True),
        AioOptions(block_size=ALIGNMENT * 4, overlap_events=False),
        AioOptions(block_size=ALIGNMENT * 3, queue_depth=16, thread_count=4),
    ],
    ids=["pieces-in-parallel", "single-submit", "no-overlap", "64-in-flight"],
)
def test_round_trips_are_exact_for_aligned_and_unaligned_tensors(tmp_path, options, backend):
    options = dataclasses.replace(options, backend=backend)
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


def test_missing_directory_and_missing_file_name_the_path(tmp_path, backend):
    with AsyncIO(AioOptions(backend=backend)) as aio:
        with pytest.raises(AioError, match="does not exist; create it or choose another directory"):
            aio.write(torch.zeros(4), tmp_path / "nope" / "swap.bin")
        with pytest.raises(AioError, match="no such file"):
            aio.read(torch.zeros(4), tmp_path / "absent.bin")


def test_short_read_is_an_error_not_silent_garbage(tmp_path, backend):
    path = tmp_path / "short.bin"
    with AsyncIO(AioOptions(block_size=ALIGNMENT, backend=backend)) as aio:
        aio.sync_write(torch.ones(ALIGNMENT // 4), path)  # one block
        dst = torch.zeros(3 * ALIGNMENT // 4)
        with pytest.raises(AioError, match=r"short read of .*short\.bin.*file ends at 4096"):
            aio.sync_read(dst, path)


def _write_past_a_file_size_limit(path: str, backend: str, said: mp.Queue) -> None:  # type: ignore[valid-type]
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    t = aligned_empty(1 << 20, torch.float32)  # 4 MiB
    with AsyncIO(AioOptions(block_size=1 << 20, backend=backend)) as aio:
        try:
            aio.sync_write(t, path)
        except AioError as exc:
            said.put(f"ERROR {exc}")
        else:
            said.put("no error")


def test_a_failed_write_raises_with_the_path(tmp_path, backend):
    # A file-size limit makes the kernel refuse writes past it (EFBIG), as a full disk
    # refuses them (ENOSPC); run in a process of its own so the limit binds nothing else.
    code, said = run_forked(_write_past_a_file_size_limit, str(tmp_path / "big.bin"), backend, timeout=60)
    assert code == 0 and isinstance(said, str), f"exit code {code}"
    assert "ERROR" in said and "big.bin" in said and "write of bytes" in said


def test_options_are_checked_and_read_from_the_config():
    from terascale.config import Config

    cfg = Config.load({"train_batch_size": 1, "aio": {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 2}})
    opts = aio_options(cfg.aio)
    assert (opts.block_size, opts.queue_depth, opts.thread_count) == (262144, 4, 2)
    with pytest.raises(ValueError, match="multiple of 4096"):
        AioOptions(block_size=1000)


def test_unaligned_file_offsets_round_trip_through_direct_middles(tmp_path, backend):
    # A piece whose memory and file start equally far from a block boundary is cut into an
    # unaligned head, aligned blocks and an unaligned tail: the bytes must come back the
    # same however the cuts fall, next to bytes written before and after them.
    torch.manual_seed(1)
    path = tmp_path / "skew.bin"
    base = aligned_empty(8 * ALIGNMENT, torch.uint8)
    base.copy_(torch.randint(0, 256, (8 * ALIGNMENT,), dtype=torch.uint8))
    with AsyncIO(AioOptions(block_size=2 * ALIGNMENT, backend=backend)) as aio:
        aio.sync_write(base, path)
        for skew, nbytes in [(100, 3 * ALIGNMENT), (4000, 200), (1, 5 * ALIGNMENT - 2), (0, 2 * ALIGNMENT + 7)]:
            buf = aligned_empty(7 * ALIGNMENT, torch.uint8)
            data = buf[skew : skew + nbytes]
            data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
            aio.sync_write(data, path, ALIGNMENT + skew)
            base[ALIGNMENT + skew : ALIGNMENT + skew + nbytes] = data
        back = aligned_empty(8 * ALIGNMENT, torch.uint8)
        aio.sync_read(back, path)
    assert torch.equal(back, base)


def test_cuts_align_the_pieces_between_an_unaligned_head_and_tail():
    cut = aio_module._cuts
    assert cut(4096, 0, 10000, 4096) == [0, 4096, 8192, 10000]
    assert cut(4096 + 100, 100, 10000, 8192) == [0, 3996, 8092, 10000]  # head 3996, tail 1908
    assert cut(4096 + 100, 200, 10000, 8192) == [0, 8192, 10000]  # misaligned differently: plain blocks
    assert cut(0, 4000, 50, 8192) == [0, 50]
    assert cut(0, 0, 0, 4096) == [0]


def test_many_requests_in_flight_finish_in_any_order(tmp_path, backend):
    # 64 requests on 4 workers: every one completes exactly, waited for in reverse order.
    torch.manual_seed(2)
    tensors = [aligned_empty(ALIGNMENT * (1 + i % 5), torch.uint8).random_(0, 256) for i in range(64)]
    with AsyncIO(AioOptions(block_size=ALIGNMENT, queue_depth=4, backend=backend)) as aio:
        writes = [aio.write(t, tmp_path / f"f{i % 8}.bin", (i // 8) * 5 * ALIGNMENT) for i, t in enumerate(tensors)]
        assert [h.wait() for h in reversed(writes)] == [t.numel() for t in reversed(tensors)]
        back = [torch.empty_like(t) for t in tensors]
        reads = [aio.read(b, tmp_path / f"f{i % 8}.bin", (i // 8) * 5 * ALIGNMENT) for i, b in enumerate(back)]
        aio.synchronize()
        assert all(h.done() for h in reads)
        assert aio.bytes_written == aio.bytes_read == sum(t.numel() for t in tensors)
    for t, b in zip(tensors, back):
        assert torch.equal(t, b)


def _blocking_engine(tmp_path):
    """An engine with one worker, held inside its first piece until the returned event is
    set, so that what is queued behind it is ordered by the queue alone."""
    aio = AsyncIO(AioOptions(block_size=ALIGNMENT, queue_depth=1, backend="threads"))  # one piece at a time
    release, order = threading.Event(), []
    real = aio_module._transfer_block

    def transfer(request, lo, hi):
        if request.path.name == "gate.bin":
            release.wait(10)
        order.append((request.op, request.path.name, lo))
        real(request, lo, hi)

    return aio, release, order, transfer


def test_reads_go_before_queued_writes_and_a_waited_write_goes_first(tmp_path, monkeypatch):
    aio, release, order, transfer = _blocking_engine(tmp_path)
    monkeypatch.setattr(aio_module, "_transfer_block", transfer)
    data = aligned_empty(3 * ALIGNMENT, torch.uint8).fill_(1)
    aio.sync_write(data, tmp_path / "r.bin")
    order.clear()
    with aio:
        gate = aio.write(data[:ALIGNMENT], tmp_path / "gate.bin")
        time.sleep(0.2)  # the worker is inside the gate now
        w1 = aio.write(data, tmp_path / "w1.bin")
        w2 = aio.write(data, tmp_path / "w2.bin")
        r = aio.read(torch.empty(3 * ALIGNMENT, dtype=torch.uint8), tmp_path / "r.bin")
        waiter = threading.Thread(target=w2.wait)
        waiter.start()  # waiting for w2 promotes its pieces ahead of the read
        time.sleep(0.2)
        release.set()
        waiter.join(10)
        for h in (gate, r, w1):  # (waiting for w1 before r would promote it past r)
            h.wait()
    names = [name for _, name, _ in order]
    assert names[0] == "gate.bin"
    assert names[1:4] == ["w2.bin"] * 3  # the waited-for write
    assert names[4:7] == ["r.bin"] * 3  # then reads
    assert names[7:] == ["w1.bin"] * 3  # then the write nobody waits for


def test_activity_counts_busy_time_and_waits(tmp_path, backend):
    data = aligned_empty(64 * ALIGNMENT, torch.uint8).fill_(3)
    with AsyncIO(AioOptions(block_size=4 * ALIGNMENT, backend=backend)) as aio:
        aio.activity.recording = True
        start = time.perf_counter()
        aio.sync_write(data, tmp_path / "a.bin")
        aio.sync_read(data, tmp_path / "a.bin")
        elapsed = time.perf_counter() - start
        busy = aio.activity.busy()
        kinds = {k for _, _, k in aio.activity.spans}
    assert kinds == {"read", "write", "wait"}
    assert 0 < busy["read"] <= busy["any"] <= elapsed and 0 < busy["write"] <= busy["any"]
    assert abs(busy["any"] - busy["read"] - busy["write"]) < 1e-6  # never both: each was waited for
    assert 0 < aio.blocked_s <= elapsed


def test_an_engine_nobody_closed_finishes_its_writes_when_collected(tmp_path, backend):
    data = aligned_empty(32 * ALIGNMENT, torch.uint8).fill_(9)
    aio = AsyncIO(AioOptions(block_size=ALIGNMENT, queue_depth=2, backend=backend))
    aio.write(data, tmp_path / "left.bin")
    threads = list(aio._workers.threads)
    del aio
    gc.collect()
    assert not any(t.is_alive() for t in threads)
    assert (tmp_path / "left.bin").read_bytes() == bytes([9]) * data.numel()


def test_large_buffers_start_on_huge_page_boundaries():
    big = aligned_empty(HUGE_PAGE // 4 + 1, torch.float32)
    assert on_huge_pages(big) and big.numel() == HUGE_PAGE // 4 + 1
    big.fill_(1.5)  # the mapping is writable and stays alive as long as the tensor
    view = big[10:20]
    del big
    gc.collect()
    assert torch.equal(view, torch.full((10,), 1.5))
    assert aligned_empty(100, torch.uint8).data_ptr() % ALIGNMENT == 0


def test_auto_probe_measures_once_per_device_and_keeps_given_values(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "PROBE_BYTES", 4 << 20)
    monkeypatch.setattr(probe, "BLOCK_SIZES", (ALIGNMENT * 16, 1 << 20))
    monkeypatch.setattr(probe, "IN_FLIGHT", (2, 4))
    picked = probe.probe_options(tmp_path, {})
    opts = AioOptions(**picked)  # valid settings
    assert opts.block_size in (ALIGNMENT * 16, 1 << 20) and opts.queue_depth in (2, 4) and opts.thread_count == 1
    assert opts.backend in BACKENDS
    cache = json.loads((tmp_path / "terascale_swap" / "aio_probe.json").read_text())
    # 2 block sizes x 2 depths on threads, and the fastest of them on the kernel's queue
    assert len(cache) == 1 and len(cache[0]["measured"]) == 4 + ("kernel" in BACKENDS)
    assert not list((tmp_path / "terascale_swap").glob("*.bin"))  # the probe file is gone

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(probe, "_measure", no_measuring)
    assert probe.probe_options(tmp_path, {}) == picked  # cached

    monkeypatch.undo()
    monkeypatch.setattr(probe, "PROBE_BYTES", 4 << 20)
    given = probe.probe_options(tmp_path, {"block_size": 1 << 20, "thread_count": 2, "backend": "threads"})
    assert given["block_size"] == 1 << 20 and given["thread_count"] == 2 and given["backend"] == "threads"
    assert given["queue_depth"] in {n // 2 for n in probe.IN_FLIGHT}


def test_config_auto_values_probe_and_given_values_do_not(tmp_path, monkeypatch):
    from terascale.config import Config

    calls = []
    monkeypatch.setattr(probe, "probe_options", lambda d, given: calls.append(given) or
                        {"block_size": 1 << 20, "queue_depth": 4, "thread_count": 1, "backend": "threads", **given})  # fmt: skip
    whole = Config.load({"train_batch_size": 1, "aio": "auto"})
    assert whole.aio.block_size == "auto" and whole.aio.backend == "auto" and not whole.auto_keys
    assert aio_options(whole.aio, tmp_path) == AioOptions(block_size=1 << 20, queue_depth=4)
    some = Config.load({"train_batch_size": 1, "aio": {"block_size": "2e6", "queue_depth": "auto"}})
    assert some.aio.block_size == 2_000_000 and some.aio.queue_depth == "auto"
    given = Config.load({"train_batch_size": 1, "aio": {"block_size": 262144, "queue_depth": 32, "backend": "kernel"}})
    calls.clear()
    assert aio_options(given.aio, tmp_path).block_size == 262144
    assert aio_options(given.aio, tmp_path).backend == "kernel"
    assert calls == []  # nothing measured when the config gives the values
    monkeypatch.undo()
    assert aio_options(whole.aio, None) == AioOptions()  # no NVMe path: the defaults
    with pytest.raises(Exception, match="block_size"):
        Config.load({"train_batch_size": 1, "aio": {"block_size": "big"}})


def test_the_kernel_backend_is_asked_for_and_refused_where_there_is_none(monkeypatch):
    assert AioOptions().backend == "threads"  # the default (RESULTS.md: the kernel's queue trained slower)
    if "kernel" in BACKENDS:
        with AsyncIO(AioOptions(backend="kernel")) as aio:
            assert aio.backend == "kernel"
    with AsyncIO(AioOptions(backend="kernel"), direct=False) as aio:
        assert aio.backend == "threads"  # kernel AIO is asynchronous only with O_DIRECT
    monkeypatch.setattr(aio_module, "open_queue", lambda depth: None)  # no io_setup here
    with pytest.raises(ValueError, match="no kernel AIO queue"):
        AsyncIO(AioOptions(backend="kernel"))
