"""The harness the other tests stand on: warm forked ranks, their limits, and isolation.

``run_ranks`` forks every rank afresh from a server that imported torch, torch._dynamo and
terascale ([Note: forked ranks] in distributed.py); a rank that fails, hangs or
dies is gone with its call, and the next call gets new ones. ``conftest.py`` fails a test
that leaves a default process group (or the default dtype, grad mode, working directory)
changed in the test process, and puts it back; pytest-timeout cuts what hangs past every
other limit, by the test's name.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

from distributed import run_ranks
from rank_imports import THIRD_PARTY, preload_names

pytest_plugins = ["pytester"]


def _installed(names: list[str]) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n.split(".")[0]) is not None]


# What the server leaves to the ranks (see rank_imports.py's rules): pyarrow's thread.
LEFT_OUT = ("lightning", "datasets", "pyarrow", "transformers.trainer")


def _warm_start(names: list[str]) -> tuple[list[str], list[str]]:
    """(the names this rank had to import itself or holds that the server leaves out, the threads
    its parent, the server, runs)."""
    missing = [n for n in names if n not in sys.modules] + [n for n in LEFT_OUT if n in sys.modules]
    task = f"/proc/{os.getppid()}/task"
    threads = []
    for tid in os.listdir(task):
        with open(f"{task}/{tid}/comm") as f:
            threads.append(f.read().strip())
    return missing, threads


def test_ranks_start_with_the_servers_imports_no_more_and_the_server_runs_no_extra_thread():
    """A name the server could not import is passed over silently, and every rank would then
    import it itself: the cost the server exists to remove (a module of tests/ on the list did
    exactly that: the server does not see the test process's sys.path). And the list may only
    hold modules whose import starts no thread, since forking a process that runs more than
    one is unsafe: the server runs one OS thread, its own (pyarrow, which the Trainer and
    Lightning bring, would add jemalloc's, so a rank must not find them imported)."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through /proc")
    names = _installed(preload_names())
    assert set(THIRD_PARTY) <= set(names)
    results = run_ranks(_warm_start, 2, names)
    assert [missing for missing, _ in results] == [[], []]
    assert len(results[0][1]) == 1, f"an import of the fork server started a thread: {results[0][1]}"


def _fail_on(bad_rank: int, how: str) -> int:
    rank = int(os.environ["RANK"])
    if rank == bad_rank:
        if how == "raise":
            raise ValueError("rank fails on purpose")
        if how == "exit":
            os._exit(3)
        time.sleep(600)  # "hang"
    return rank


@pytest.mark.parametrize("how", ["raise", "exit", "hang"])
def test_a_failed_dead_or_hung_rank_fails_its_call_and_the_next_call_gets_new_ranks(how):
    expected = {"raise": (AssertionError, "rank fails on purpose"), "exit": (AssertionError, "exited with code 3"),
                "hang": (TimeoutError, "_fail_on: no result from some rank within 5s")}[how]  # fmt: skip
    with pytest.raises(expected[0], match=expected[1]):
        run_ranks(_fail_on, 2, 1, how, timeout=5)
    assert run_ranks(_fail_on, 2, -1, how) == [0, 1]


def _conftest_source() -> str:
    with open(os.path.join(os.path.dirname(__file__), "conftest.py")) as f:
        return f.read()


def test_a_test_that_leaves_a_process_group_fails_by_name_and_the_next_finds_none(pytester):
    pytester.makeconftest(_conftest_source())
    pytester.makepyfile(
        test_leak="""
        import torch.distributed as dist

        def test_leaks_a_group(tmp_path):
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)

        def test_next_one():
            assert not dist.is_initialized()

        def test_leaks_the_default_dtype():
            import torch
            torch.set_default_dtype(torch.float64)

        def test_after_it():
            import torch
            assert torch.get_default_dtype() == torch.float32
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_a_group*",
                                 "*changed a default process group of the test process*"])  # fmt: skip
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_the_default_dtype*"])


def test_a_hang_is_cut_by_the_per_test_timeout_naming_the_test(pytester):
    pytester.makepyfile(
        test_hang="""
        import time

        def test_hangs():
            time.sleep(600)

        def test_runs_after_it():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--timeout", "3")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_hang.py::test_hangs - Failed: Timeout (>3.0s) from pytest-timeout."])


def test_an_alone_test_runs_with_no_other_test_beside_it_on_xdist_workers(pytester):
    """[Note: tests that run alone]: under ``-n 2`` both workers run tests, but none overlaps
    the ``alone`` test, which also waits for the test already running on the other worker
    when it comes up. (The 0.4 s spans only widen the window a missing lock would show in.)"""
    pytester.makeconftest(_conftest_source())
    pytester.makeini("[pytest]\nmarkers =\n    alone: runs with no other test beside it\n")
    log = pytester.path / "spans.log"
    span = f"""
        import os
        import time

        def span(name, seconds):
            started = time.monotonic()
            time.sleep(seconds)
            with open({str(log)!r}, "a") as f:
                f.write(f"{{name}} {{started}} {{time.monotonic()}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
        """
    pytester.makepyfile(spans=span)
    files = {f"test_{c}": "\n".join(f"def test_{c}{i}():\n    span('{c}{i}', 0.4)\n" for i in range(4)) for c in "bcd"}
    files["test_a"] = "import pytest\n\n@pytest.mark.alone\ndef test_a():\n    span('alone', 1.0)\n"
    pytester.makepyfile(**{name: "from spans import span\n\n" + body for name, body in files.items()})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile")
    result.assert_outcomes(passed=13)
    rows = [line.split() for line in log.read_text().splitlines()]
    spans = {name: (float(a), float(b)) for name, a, b, _ in rows}
    assert {worker for *_, worker in rows} == {"gw0", "gw1"}, "the tests did not run on two workers"
    alone = spans.pop("alone")
    beside = [name for name, (a, b) in spans.items() if a < alone[1] and alone[0] < b]
    assert beside == [], f"ran beside the alone test: {beside}"
