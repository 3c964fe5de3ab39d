"""The collective watchdog (terascale.health.watchdog): a hang becomes an error that names
the rank, the operation, the group and the late peer.

The two-rank tests run each rank as its own process (torchrun's environment variables, a
gloo group on the CPU) so the exit code of the process the watchdog ends can be checked;
every process is killed at the end, whatever happens. The other tests run the watchdog in
this process against an in-memory store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from distributed import free_port
from terascale.health.watchdog import WATCHDOG_EXIT_CODE, CollectiveWatchdog

ROOT = Path(__file__).resolve().parent.parent

# One rank of a two-rank job. Both ranks enter step 1's forward; then rank 1 blocks outside
# any collective while rank 0 enters a collective rank 1 never joins.
WORKER = r'''
import dataclasses, sys, threading, time
import torch, torch.distributed as dist
from terascale.comm import init_distributed
from terascale.health.watchdog import CollectiveWatchdog

scenario = sys.argv[1]
ctx = init_distributed()
if scenario == "recv":
    pipe = dist.new_group([0, 1])
    ctx = dataclasses.replace(ctx, pp_group=pipe, pp_rank=ctx.rank, pp_world_size=2)
# Rank 1 must not time out first: its exit would fail rank 0's collective with gloo's own
# error before rank 0's watchdog reports.
watchdog = CollectiveWatchdog(ctx, timeout_s=2.0 if ctx.rank == 0 else 120.0, poll_s=0.5)
watchdog.progress(1, "forward")
dist.barrier()
if ctx.rank == 1:
    watchdog.progress(1, "backward")
    threading.Event().wait()  # stuck outside any collective
print(f"entering {time.time()}", flush=True)
if scenario == "all_reduce":
    watchdog.progress(1, "step")
    dist.all_reduce(torch.ones(4), group=ctx.dp_group)
else:
    watchdog.progress(2, "forward")
    dist.recv(torch.empty(4), src=1, group=ctx.pp_group)
print("the collective returned", flush=True)
'''


def _run_pair(tmp_path: Path, scenario: str) -> tuple[int, str, str, float, Path]:
    """Start both ranks; return rank 0's exit code, stdout, stderr, the seconds from its
    entering the collective to its exit, and its torchelastic error file."""
    script = tmp_path / "watchdog_worker.py"
    script.write_text(WORKER)
    error_file = tmp_path / "error.json"
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "TERASCALE_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            if rank == 0:
                env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
            procs.append(subprocess.Popen([sys.executable, str(script), scenario], cwd=tmp_path, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        out, err = procs[0].communicate(timeout=90)  # start-up (importing torch) + 2 s + margin
        exited = time.time()
        assert procs[1].poll() is None, "rank 1 should still be blocked"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    entered = [float(line.split()[1]) for line in out.splitlines() if line.startswith("entering ")]
    assert entered, f"rank 0 never reached the collective:\n{out}\n{err}"
    return procs[0].returncode, out, err, exited - entered[0], error_file


def test_all_reduce_hang_names_rank_operation_group_and_late_peer(tmp_path: Path) -> None:
    code, out, err, seconds, error_file = _run_pair(tmp_path, "all_reduce")
    assert code == WATCHDOG_EXIT_CODE, f"exit code {code}\n{out}\n{err}"
    assert 2.0 <= seconds < 2.0 + 15.0, seconds
    assert "the collective returned" not in out
    assert "rank 0 made no progress" in err and "(step 1, phase 'step')" in err
    assert "blocked in all_reduce on the data-parallel group (ranks [0, 1])" in err
    assert "watchdog_worker.py" in err  # the calling line
    assert "Rank 1 is still at step 1, phase 'backward'" in err
    assert "it has not reached this collective" in err
    # What rank 1 itself is doing, from its heartbeat.
    assert "not in a collective at threading.py:" in err and "called from watchdog_worker.py:19" in err
    # torchrun's error-file format: {"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}
    record = json.loads(error_file.read_text())["message"]
    assert "blocked in all_reduce" in record["message"] and "Rank 1" in record["message"]
    assert record["message"] in record["extraInfo"]["py_callstack"]
    assert int(record["extraInfo"]["timestamp"]) > 0


def test_recv_hang_names_the_pipeline_group_and_the_sender(tmp_path: Path) -> None:
    code, out, err, seconds, _ = _run_pair(tmp_path, "recv")
    assert code == WATCHDOG_EXIT_CODE, f"exit code {code}\n{out}\n{err}"
    assert 2.0 <= seconds < 2.0 + 15.0, seconds
    assert "blocked in recv on the pipeline group (ranks [0, 1]) from rank 1" in err
    assert "Rank 1 is still at step 1, phase 'backward'" in err


def _ctx(rank: int, world_size: int, backend: str = "gloo") -> SimpleNamespace:
    """The parts of a DistributedContext the watchdog reads, without a process group."""
    return SimpleNamespace(rank=rank, world_size=world_size, backend=backend, dp_group=None, mp_group=None,
                           pp_group=None, replica_group=None)


def _wait_for(reports: list[str], count: int, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while len(reports) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(reports) >= count, f"expected {count} report(s) within {seconds} s, got {reports}"


def test_diagnosis_names_peers_behind_silent_and_missing() -> None:
    store = dist.HashStore()
    reports: list[str] = []
    peer_reports: list[str] = []
    # Rank 1: alive and behind. Rank 2: its heartbeats stopped 30 s ago. Rank 3: none at all.
    # Heartbeats every 0.25 s: silent after 0.75 s, which a loaded machine does not reach.
    with CollectiveWatchdog(_ctx(1, 4), timeout_s=120, poll_s=0.25, store=store, on_timeout=peer_reports.append) as peer:
        peer.progress(3, "forward")
        store.set("hb/2", json.dumps({"step": 3, "phase": "backward", "age": 0.0, "t": time.time() - 30, "poll": 0.25}))
        with CollectiveWatchdog(_ctx(0, 4), timeout_s=1.0, poll_s=0.25, store=store, on_timeout=reports.append) as wd:
            wd.progress(3, "step")
            _wait_for(reports, 1)
            time.sleep(1.0)
            assert len(reports) == 1, "one report per stall"
            wd.progress(4, "forward")  # progress re-arms it
            _wait_for(reports, 2)
    assert not peer_reports
    message = reports[0]
    assert message.startswith("terascale watchdog: rank 0 made no progress for ")
    assert "(step 3, phase 'step')" in message
    # This rank (the test's thread, sleeping) is in no collective: it is the one stuck.
    assert "not in a collective; its training thread is at tests/test_watchdog.py:" in message
    assert "in _wait_for" in message and "This rank itself is stuck" in message
    assert "Rank 1 is still at step 3, phase 'forward'" in message
    assert "it has not reached this collective" not in message  # this rank is in none
    assert "Rank 2 is silent, last at step 3, phase 'backward': dead or frozen" in message
    assert "Rank 3 has published no heartbeat" in message
    assert "(step 4, phase 'forward')" in reports[1]


@pytest.mark.alone  # bounds a wall-clock time (see conftest.py)
def test_no_report_while_progress_continues() -> None:
    store = dist.HashStore()
    reports: list[str] = []
    wd = CollectiveWatchdog(_ctx(0, 2), timeout_s=1.5, poll_s=0.25, store=store, on_timeout=reports.append)
    try:
        start = time.monotonic()
        step = 0
        while time.monotonic() - start < 4.5:  # 3 x the timeout, a phase change every poll
            wd.progress(step // 3, ("forward", "backward", "step")[step % 3])
            step += 1
            time.sleep(0.25)
    finally:
        wd.close()
        wd.close()  # idempotent
    assert reports == []
    assert json.loads(store.get("hb/0"))["closed"] is True  # peers see it closed, not dead


def test_on_nccl_a_rank_outside_torch_distributed_may_be_waiting_for_the_device() -> None:
    # NCCL collectives return at once; the host then blocks at its next wait for the device,
    # so the watchdog must not claim that this rank itself is the one stuck.
    reports: list[str] = []
    with CollectiveWatchdog(_ctx(0, 1, backend="nccl"), timeout_s=0.3, poll_s=0.1, store=None,
                            on_timeout=reports.append) as wd:
        wd.progress(7, "backward")
        _wait_for(reports, 1)
    assert "(step 7, phase 'backward'): not in a torch.distributed call" in reports[0]
    assert "on NCCL this may be a wait for the device" in reports[0]
    assert "This rank itself is stuck" not in reports[0]


def test_construction_does_not_wait_for_the_store_connection() -> None:
    # The thread connects (clones the store) itself: a rank whose rank 0 has already left
    # would otherwise retry the clone for the process-group timeout inside initialize().
    release = threading.Event()
    store = dist.HashStore()

    class UnreachableStore:  # clone() blocks until released, like a TCPStore whose host is gone
        def clone(self) -> dist.Store:
            release.wait()
            return store

    timer = threading.Timer(60, release.set)  # ends the test if construction blocks
    timer.start()
    try:
        wd = CollectiveWatchdog(_ctx(0, 2), timeout_s=120, poll_s=0.1, store=UnreachableStore())
        constructed_while_blocked = not release.is_set()
        release.set()
        wd.progress(1, "forward")
        deadline = time.monotonic() + 20
        while not store.check(["hb/0"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        wd.close()
    finally:
        timer.cancel()
    assert constructed_while_blocked
    assert json.loads(store.get("hb/0"))["closed"] is True  # it published over the clone once connected
