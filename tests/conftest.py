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

import os

import pytest
import torch
import torch.distributed as dist


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
