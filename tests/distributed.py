"""Run a test function on N real processes joined by a gloo process group.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes with torchrun's
environment variables set, calls ``fn(*args)`` in each, and returns the per-rank return
values (index = rank). Ranks use one GPU each where there are enough GPUs, else the CPU.
An exception on any rank fails the test with that rank's traceback;
a hang fails after ``timeout`` seconds instead of blocking the suite.

[Note: forked ranks]
Ranks are forked from multiprocessing's fork server, which imports torch, torch._dynamo,
every terascale module and the Hugging Face modelling the tests use (``rank_imports.py``
names them and what it leaves out) once per pytest process (an xdist worker has its own),
rather than spawned: a spawned rank imports torch afresh, about 2.5 s of the machine's two
CPUs for every ``run_ranks`` call, which was a third of the suite, and a rank forked from a
server that had imported only torch and terascale's top package still spent 2.5 of a small
test's 2.7 s importing (torch._dynamo, the engine, transformers). Forking from the server
is safe where forking the test process would not be: the server only imports (no CUDA
context, no OpenMP pool, no process group, no thread: test_harness.py checks), exactly as a
DataLoader worker is forked after ``import torch``. Each rank still gets a fresh process
for everything the test does, so nothing a test did in its ranks (a process group, global
state, a hang, a crash) outlives its call: the next call forks new ranks. Keeping ranks
alive across tests with their group formed (DeepSpeed's ``reuse_dist_env``) would save
only the group's formation, measured at 0.05-0.1 s a call here, at the cost of that
isolation.
The environment is the test process's when the server started, plus the torchrun
variables set below; a test needing more for its ranks passes it as an argument.

The rendezvous store is hosted by ``run_ranks`` itself, as torchrun's agent hosts it
(``TORCHELASTIC_USE_AGENT_STORE``), not by rank 0: a rank 0 that finishes first would
otherwise take the store with it while a peer still uses it (creating a group of its
own, say), which fast-starting ranks made a real race.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from rank_imports import preload_names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forked_context() -> mp.context.BaseContext:
    """The multiprocessing context whose processes fork from the warm server (see the note
    at the top). Every test that starts processes through multiprocessing takes it from
    here: a process has one fork server, and whoever starts it first fixes its imports.
    ``TERASCALE_TEST_START=spawn`` starts fresh interpreters instead (slow; for debugging
    what the server's imports might hide or cause)."""
    if os.environ.get("TERASCALE_TEST_START") == "spawn":  # debugging: fresh interpreters, no server
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload_names())  # read when the server starts, on the first use
    return ctx


def run_forked(fn: Callable, *args: Any, timeout: float = 120.0) -> tuple[int | None, Any]:
    """Call ``fn(*args, results)`` in one process forked from the warm server, for what needs a
    process of its own but no group (a process that kills itself, a resource limit): (its exit
    code, what it put in the ``results`` queue, or None). Its stderr is the test's. For small
    results only: the child's queue is read after it exits, and a child whose put fills the
    pipe would wait for a reader until the timeout."""
    ctx = forked_context()
    results = ctx.Queue()
    proc = ctx.Process(target=fn, args=(*args, results))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"{fn.__name__}: did not finish within {timeout:.0f}s")
    try:
        return proc.exitcode, results.get(timeout=5) if proc.exitcode == 0 else None
    except queue.Empty:
        return proc.exitcode, None


def _script(path: str, argv: list[str], results: mp.Queue) -> None:
    import runpy
    import sys

    import torch

    torch.set_num_threads(1)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))  # as `python PATH` puts its folder first
    runpy.run_path(path, run_name="__main__")
    results.put(0)


def run_script(path: str | os.PathLike, *argv: str, timeout: float = 120.0) -> None:
    """``python PATH ARGV...`` on one CPU thread, in a process forked from the warm server (the
    same program, without its 2-4 s of imports); fails on a non-zero exit."""
    code, _ = run_forked(_script, str(path), list(argv), timeout=timeout)
    assert code == 0, f"{path} {' '.join(argv)}: exit code {code} (its output is the test's)"


def _entry(
    fn: Callable, rank: int, world_size: int, port: int, results: mp.Queue, args: tuple, device: str | None
) -> None:
    if device is not None:
        os.environ["TERASCALE_DEVICE"] = device
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store is run_ranks' (see the note above)
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # Plain bytes through the queue: torch's shared-memory pickling of tensors would
        # need this process alive after it returns.
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, device: str | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` forked ranks; return their results by rank.

    ``device="cpu"`` keeps the ranks on the CPU where GPUs are present, for tests of what a
    CPU rank does (its host memory, a trajectory bit-identical to a CPU reference).
    ``fresh=True`` starts the ranks as fresh interpreters, as torchrun does, for a test that
    holds a memory prediction to a rank's measured peak: a forked rank finds torch._dynamo
    imported, which a real rank imports after the planner ran, and its peak is lower by that
    (measured: the planner's prediction then ran 1.10x the measured peak, at the edge of
    test_planner's 10% band, against 1.04-1.06x for a real rank)."""
    import torch

    # One process per GPU: where there are enough GPUs the ranks use them (NCCL), else
    # every rank runs on the CPU (gloo).
    if device is None and torch.cuda.device_count() < world_size:
        device = "cpu"
    ctx = mp.get_context("spawn") if fresh else forked_context()
    results: mp.Queue = ctx.Queue()
    # Hosted here until every rank has exited; port 0: the system picks a free one.
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, results, args, device), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        for _ in range(world_size):
            while True:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    # A rank that died without reporting (killed, crashed in start-up) would
                    # otherwise leave the others waiting for it until the timeout.
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise AssertionError(f"{fn.__name__}: a rank exited with code {dead[0]} without a result") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{fn.__name__}: no result from some rank within {timeout:.0f}s") from None
            if ok:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # the other ranks may now hang on a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
        del store  # only now: the ranks have stopped using it
    if errors:
        raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
