"""A pytest plugin for the GPU check: each failure's traceback is appended to the file
``$GPU_CHECK_FAILURES`` the moment its report arrives (under xdist too), so that a test
phase stopped at its time cap still leaves the reasons of the failures it saw."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("GPU_CHECK_FAILURES")
    if path and report.failed:
        with open(path, "a") as sink:
            sink.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
