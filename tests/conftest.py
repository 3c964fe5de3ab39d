"""What every test may rely on: the test process as the previous test found it.

Most tests run their work in ranks forked for them (``distributed.py``) or in processes of
their own, so what they change dies with those. What a test changes in the pytest process
itself would reach every later test: a default process group (a later test's
``init_process_group`` would fail, or one that checks ``dist.is_initialized()`` would skip),
the default dtype, grad mode, the working directory. The guard below puts each back after
the test and fails that test by name, so a leak is found where it happens, not in some later
test that then behaves differently.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# [Note: tests that run alone]
# `make test` runs the suite on pytest-xdist's workers (one per CPU, each file on one
# worker): most of a launched job is interpreter start-up and waiting, which another
# worker's tests fill. A test that bounds a wall-clock time (a lease taken within 1 s, a
# heartbeat never 1.5 s late, a rank slower by an injected 0.2 s) is marked
# ``@pytest.mark.alone``: it starts only once no other test runs, and no other test starts
# until it is done. That is a readers-writer lock over files both workers see (their base
# temporary folders' parent): every test holds the running lock shared, an ``alone`` test
# holds it exclusively, and the turnstile before it stops new tests from starving a
# waiting ``alone`` one. Without xdist (one test alone, or ``-p no:xdist``) nothing runs
# beside a test and there is nothing to take.


def _lock_folder(config: pytest.Config) -> Path | None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: this process runs every test
        return None
    # xdist gives each worker ROOT/popen-gwN as its base temporary folder.
    return Path(config.option.basetemp).parent


@contextlib.contextmanager
def _turn(item: pytest.Item) -> Iterator[None]:
    folder = _lock_folder(item.config)
    if folder is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    with open(folder / "turnstile.lock", "a") as turnstile, open(folder / "running.lock", "a") as running:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # leaving the `with` closes both files, which releases their locks


# The longest files first, so that xdist (``--dist loadfile --no-loadscope-reorder``) starts
# them on different workers and the short ones fill in around them; otherwise the last
# long file can start late and run on alone. Measured per file on 2 CPUs (seconds): resilience
# 177, clients 131, launcher 51, examples 35, hf_trainer 32, lease 32, pipeline 30, planner 28,
# config_corpus 28, harness 21. Only the order depends on this list, never an outcome.
LONGEST_FIRST = ("test_resilience.py", "test_clients.py", "test_live_elastic.py", "test_launcher.py", "test_examples.py",
                 "test_hf_trainer.py", "test_lease.py", "test_pipeline.py", "test_planner.py",
                 "test_config_corpus.py", "test_harness.py")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _lock_folder(config) is None:  # one process: the order changes nothing
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    # Around set-up, call and tear-down: a module's fixture is built in its first test's set-up.
    with _turn(item):
        return (yield)


def _process_state() -> dict[str, object]:
    return {
        "a default process group": dist.is_available() and dist.is_initialized(),
        "the default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "the working directory": os.getcwd(),
    }


@pytest.fixture
def own_process_group() -> object:
    """For a test that calls ``terascale.initialize`` in the test process itself: that forms a
    default group of one, as DeepSpeed's does, and leaves it to the program; this takes it
    down after the test."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _leaves_the_process_as_it_found_it() -> object:
    before = _process_state()
    yield
    after = _process_state()
    changed = [what for what in before if after[what] != before[what]]
    if not changed:
        return
    # Put it back first: the next test runs on a clean process whatever this one did.
    if after["a default process group"] and not before["a default process group"]:
        dist.destroy_process_group()
    torch.set_default_dtype(before["the default dtype"])  # type: ignore[arg-type]
    torch.set_grad_enabled(bool(before["grad mode"]))
    os.chdir(str(before["the working directory"]))
    pytest.fail(f"the test changed {', '.join(changed)} of the test process and did not put it back", pytrace=False)
