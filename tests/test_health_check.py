"""Tests for `terascale check`: the verdict on made-up reports, one rank's local
measurements in-process, and real runs of the command on 2 ranks (gloo on CPU).

No test looks at how fast anything was measured: machine speed is not under test.
Real runs start `python -m terascale check` in a session of its own and kill the whole
session on timeout, so a stuck torchrun cannot hang the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from terascale.health.verdict import (
    LOCAL_METRICS,
    CheckOptions,
    RankReport,
    bus_factor,
    exit_code,
    failing_nodes,
    find_outliers,
    format_report,
    format_table,
    medians,
    summary,
)
from terascale.launcher.cli import main

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def _reports() -> list[RankReport]:
    hosts = ["a", "a", "b", "b"]
    ar = [0.69, 0.70, 0.31, 0.68]
    reports = []
    for rank, (host, bw) in enumerate(zip(hosts, ar)):
        r = RankReport(rank=rank, host=host, node=host,
                       values={"matmul_fp32": 1.0 + rank / 100, "all_reduce_world": bw},
                       skipped={"h2d": "no CUDA device", "d2h": "no CUDA device"})
        reports.append(r)
    return reports


# ---------------------------------------------------------------------------
# verdict (pure)


def test_medians_over_the_ranks_that_measured():
    reports = _reports()
    reports[3].values.pop("matmul_fp32")
    reports[3].errors["matmul_fp32"] = "RuntimeError: boom"
    meds = medians(reports)
    assert meds["matmul_fp32"] == pytest.approx(1.01)  # median of 1.00, 1.01, 1.02
    assert meds["all_reduce_world"] == pytest.approx((0.68 + 0.69) / 2)
    assert "h2d" not in meds  # skipped everywhere: no median


def test_outliers_name_rank_host_and_fraction():
    reports = _reports()
    outliers = find_outliers(reports, tolerance=0.7)
    assert [(o.rank, o.host, o.metric) for o in outliers] == [(2, "b", "all_reduce_world")]
    o = outliers[0]
    assert o.fraction == pytest.approx(0.31 / 0.685)
    assert o.describe() == "rank 2 (host b): all_reduce bus bandwidth 0.31 GB/s, 45% of the median 0.685 GB/s"
    assert find_outliers(reports, tolerance=0.0) == []  # 0 turns the comparison off
    assert failing_nodes(reports, outliers) == {"b": [2]}
    assert exit_code(reports, outliers) == 1
    assert exit_code(reports, find_outliers(reports, tolerance=0.4)) == 0


def test_failed_measurement_fails_its_node():
    reports = _reports()
    reports[1].errors["nvme_write"] = "AioError: write of '/x/f.bin' failed: Not a directory"
    reports[1].skipped["nvme_read"] = "the write failed"
    assert exit_code(reports, []) == 1
    assert failing_nodes(reports, []) == {"a": [1]}
    text, code = format_report(reports, tolerance=0.4)
    assert code == 1
    assert "rank 1 (host a): NVMe write bandwidth: AioError: write of '/x/f.bin'" in text
    assert "nvme r on rank 1: the write failed" in text
    assert text.splitlines()[-1] == "terascale check: FAILED on 1 node(s): a (rank 1)"


def test_report_lists_outliers_and_failures_by_node():
    reports = _reports()
    reports[0].errors["memory"] = "RuntimeError: out of memory"
    text, code = format_report(reports, tolerance=0.7)
    assert code == 1
    assert "outliers (below 70% of the median):" in text
    assert text.splitlines()[-1] == "terascale check: FAILED on 2 node(s): a (rank 0); b (rank 2)"


def test_healthy_report_and_table():
    reports = _reports()
    reports[2].values["all_reduce_world"] = 0.66
    text, code = format_report(reports, tolerance=0.7)
    assert code == 0
    assert text.splitlines()[-1] == "terascale check: all 4 ranks healthy"
    assert "h2d, d2h on all ranks: no CUDA device" in text
    table = format_table(reports).splitlines()
    header = table[0].split()
    assert header[:3] == ["rank", "host", "fp32"]
    # every local metric has a column; collectives only where measured
    assert "ar" in header and "node" not in header
    rows = [line.split() for line in table[2:6]]
    assert [row[:2] for row in rows] == [["0", "a"], ["1", "a"], ["2", "b"], ["3", "b"]]
    assert table[7].split()[0] == "median"
    h2d = header.index("h2d")  # the labels of two words ("ar world") come after it
    assert all(row[h2d] == "-" for row in rows)


def test_error_cell_and_summary_round_trip():
    reports = _reports()
    reports[1].errors["memory"] = "RuntimeError: x"
    assert " ERR " in format_table(reports).splitlines()[3] + " "
    data = json.loads(json.dumps(summary(reports, 0.7)))
    assert data["exit_code"] == 1 and data["world_size"] == 4
    assert data["failing_nodes"] == {"a": [1], "b": [2]}
    assert data["outliers"][0]["rank"] == 2 and data["outliers"][0]["fraction"] == pytest.approx(0.31 / 0.685)
    assert RankReport.from_dict(data["ranks"][1]) == reports[1]


def test_bus_bandwidth_factors():
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bus_factor("all_gather", 1) == 0.0
    with pytest.raises(ValueError):
        bus_factor("broadcast", 2)


def test_options_validate_and_round_trip(tmp_path):
    for bad in ({"repeats": 0}, {"tolerance": 1.5}, {"io_mb": 0}, {"size_mb": -1.0}, {"timeout_s": 0}):
        with pytest.raises(ValueError):
            CheckOptions(**bad)
    opts = CheckOptions(size_mb=2.5, io_mb=8, repeats=3, tolerance=0.5, nvme_path=str(tmp_path),
                        json_path=str(tmp_path / "out.json"), timeout_s=30.0)
    parser = argparse.ArgumentParser()
    CheckOptions.add_arguments(parser)
    assert CheckOptions.from_args(parser.parse_args(opts.to_argv())) == opts


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert main(["check", "--tolerance", "2"]) == 2
    assert "--tolerance" in capsys.readouterr().err
    assert main(["check", "--repeats", "0"]) == 2
    assert main(["check", "--json", str(tmp_path / "missing" / "out.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["check", "--include", "a"]) == 2  # a filter needs a hostfile, as for `run`


# ---------------------------------------------------------------------------
# one rank's local measurements, in this process


def test_measure_local_writes_reads_and_cleans_up(tmp_path):
    import torch

    from terascale.health.preflight import measure_local

    report = RankReport(rank=0, host="here")
    opts = CheckOptions(io_mb=1, repeats=1, nvme_path=str(tmp_path))
    measure_local(report, torch.device("cpu"), opts, nbytes=1 << 20)
    assert report.errors == {}
    assert set(report.values) == {m.name for m in LOCAL_METRICS} - {"h2d", "d2h"}
    assert all(v > 0 for v in report.values.values())
    assert set(report.skipped) == {"h2d", "d2h"}
    assert list(tmp_path.iterdir()) == []  # the test file is removed


# ---------------------------------------------------------------------------
# real runs: `terascale check --nproc 2`


def _run_check(args: list[str]) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    import torch

    if torch.cuda.device_count() < 2:  # two ranks need two GPUs; else both run on the CPU
        env["TERASCALE_DEVICE"] = "cpu"
    # A session of its own so a timeout can kill the launcher with torchrun and its ranks.
    proc = subprocess.Popen([sys.executable, "-m", "terascale", "check", "--nproc", "2", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"terascale check timed out; output:\n{out}")
    return proc.returncode, out


def test_real_check_two_ranks_reports_every_metric(tmp_path):
    out_json = tmp_path / "check.json"
    start = time.monotonic()
    # --tolerance 0: two ranks sharing two busy cores may differ a lot; speed is not under test.
    rc, out = _run_check(["--size-mb", "2", "--io-mb", "8", "--repeats", "2", "--tolerance", "0",
                          "--nvme-path", str(tmp_path), "--json", str(out_json)])
    assert rc == 0, out
    assert out.rstrip().splitlines()[-1] == "terascale check: all 2 ranks healthy", out
    data = json.loads(out_json.read_text())
    assert data["world_size"] == 2 and data["exit_code"] == 0
    measured = {"matmul_fp32", "matmul_bf16", "memory", "nvme_write", "nvme_read",
                "all_reduce_world", "all_gather_world", "reduce_scatter_world"}
    for r in data["ranks"]:
        assert r["errors"] == {}, r
        on_cuda = r["device"].startswith("cuda")
        assert set(r["values"]) == measured | ({"h2d", "d2h"} if on_cuda else set()), r
        assert all(v > 0 for v in r["values"].values()), r
        if not on_cuda:
            assert {"h2d", "d2h"} <= set(r["skipped"])
        assert set(r["skipped"]) >= {f"{op}_{k}" for op in ("all_reduce", "all_gather", "reduce_scatter")
                                     for k in ("node", "cross")}  # one node
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert set(data["medians"]) >= measured
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.json"]  # I/O test files removed
    assert time.monotonic() - start < TIMEOUT_S


def test_real_check_unwritable_nvme_path_fails_and_names_ranks(tmp_path):
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    rc, out = _run_check(["--size-mb", "2", "--io-mb", "8", "--repeats", "1", "--tolerance", "0",
                          "--nvme-path", str(not_a_dir)])
    assert rc == 1, out
    assert "failed measurements:" in out
    for rank in (0, 1):
        assert f"rank {rank} (host " in out and f"-rank{rank}-" in out, out
    assert str(not_a_dir) in out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("terascale check: FAILED on 1 node(s): ") and last.endswith("(ranks 0, 1)"), out
