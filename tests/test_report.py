"""``terascale report``: the HTML page and PNGs built from the CSV monitor's files."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from terascale.engine.monitor import CsvMonitor  # noqa: E402  (after the skip: the report needs matplotlib)
from terascale.launcher.cli import main  # noqa: E402
from terascale.profiling.report import build_report, load_run  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTIONS = ("Loss", "Optimizer", "Throughput", "Model FLOPs utilisation", "Memory per rank", "Time per step",
            "Communication bandwidth", "Stragglers", "Final values")


def _write_run(root: Path, job: str, *, steps: int = 40, ranks: int = 2, speed: float = 1.0, full: bool = True) -> Path:
    """A run's CSV files as the engine's CsvMonitor writes them; x is the global sample count."""
    mon = CsvMonitor(str(root), job)
    for i in range(1, steps + 1):
        x = 32 * i
        events = [("Train/Samples/train_loss", 3.0 * math.exp(-i / 15) + 1.0 + 0.05 * math.sin(7 * i), x),
                  ("Train/Samples/lr", 1e-3 * min(1.0, i / 10), x)]
        if full:
            events += [
                ("Train/Samples/grad_norm", 1.0 + 0.1 * math.cos(i), x),
                ("Train/Samples/loss_scale", 2.0 ** (16 - i // 20), x),
                ("Throughput/samples_per_s", 100.0 * speed, x),
                ("Throughput/tokens_per_s", 100.0 * speed * 1024, x),
                ("Throughput/tflops", 50.0 * speed, x),
                ("Throughput/mfu", 0.25 * speed, x),
                ("Time/forward_ms", 10.0 / speed, x),
                ("Time/backward_ms", 20.0 / speed, x),
                ("Time/step_ms", 5.0 / speed, x),
                ("Time/grad_reduce_ms", 4.0, x),
                ("Time/param_gather_ms", 3.0, x),
                ("Time/offload_wait_ms", 2.0, x),
                ("Comms/all_reduce/busbw_gbps", 40.0 * speed, x),
                ("Comms/all_reduce/algbw_gbps", 20.0 * speed, x),
                ("Comms/reduce_scatter_tensor/busbw_gbps", 30.0, x),
                ("Comms/reduce_scatter_tensor/algbw_gbps", 15.0, x),
                ("Health/straggler_max_ratio", 1.1, x),
            ]
            for r in range(ranks):
                events += [(f"Memory/rank{r}/device_allocated_gb", 2.0 + r, x),
                           (f"Memory/rank{r}/device_peak_gb", 3.0 + r + i / 100, x),
                           (f"Memory/rank{r}/host_rss_gb", 1.5, x)]
            if i % 10 == 0:
                events.append(("Eval/loss", 3.0 * math.exp(-i / 15) + 1.2, x))
        mon.write(events)
    mon.close()
    return root / job


def _pngs(html: str, out: Path) -> list[Path]:
    return [out / name for name in re.findall(r'<img src="([^"]+)"', html)]


def _assert_valid_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, f"{path}: {len(data)} bytes, an empty figure?"


def test_full_run_has_every_plot(tmp_path: Path):
    run = _write_run(tmp_path, "full")
    path = build_report(run)
    assert path == run / "report" / "report.html"
    html = path.read_text()
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in html
    pngs = _pngs(html, path.parent)
    assert {p.name for p in pngs} == {"loss.png", "optimizer.png", "throughput.png", "mfu.png", "memory.png",
                                      "time_breakdown.png", "comms.png", "stragglers.png"}
    for p in pngs:
        _assert_valid_png(p)
    assert "Not plotted" not in html and "left out" not in html
    # The header: points, last loss, medians over the last half, peak memory per rank.
    last_loss = 3.0 * math.exp(-40 / 15) + 1.0 + 0.05 * math.sin(7 * 40)
    assert f"<td>last train loss</td><td>{last_loss:.4g}</td>" in html
    assert "<td>MFU (median, last half)</td><td>25%</td>" in html
    assert "<td>peak device memory, rank 1</td><td>4.4 GB</td>" in html
    # The final-values table lists every metric, with its real name (the file name lost the "/").
    assert "<td>Comms/reduce_scatter_tensor/busbw_gbps</td>" in html


def test_missing_metrics_are_named_not_fatal(tmp_path: Path):
    run = _write_run(tmp_path, "bare", full=False)
    out = tmp_path / "out"
    html = build_report(run, out_dir=out).read_text()
    assert {p.name for p in _pngs(html, out)} == {"loss.png", "optimizer.png"}
    _assert_valid_png(out / "loss.png")
    assert not (out / "throughput.png").exists()
    for name in ("Throughput/mfu", "Time/forward_ms", "Health/straggler_max_ratio", "Eval/... (held-out loss)",
                 "Train/Samples/grad_norm", "Memory/rank{r}/device_peak_gb", "Comms/{op}/busbw_gbps"):
        assert f"<code>{name}</code>" in html
    assert html.count("Not plotted") == 6  # throughput, MFU, memory, time, comms, stragglers
    assert "<td>MFU (median, last half)</td><td>–</td>" in html


def test_an_mfu_above_100_percent_shows_as_unknown(tmp_path: Path):
    # Older runs on CPUs whose peak was timed on a slow bf16 matmul logged MFUs of 25 (2,500%).
    run = _write_run(tmp_path, "old", steps=40)
    mon = CsvMonitor(str(tmp_path), "old")
    mon.write([("Throughput/mfu", 0.3 if i <= 20 else 25.87, 32 * i) for i in range(1, 41)])
    mon.close()
    mfu = load_run(run).metrics["Throughput/mfu"]
    assert mfu.finite() == [0.3] * 20 and all(math.isnan(v) for v in mfu.y[20:])
    html = build_report(run).read_text()
    assert "<td>MFU (median, last half)</td><td>–</td>" in html
    # The final values: the last known one, no median of the (unknown) last half, min and max.
    assert "<td>Throughput/mfu</td><td>40</td><td>0.3</td><td>–</td><td>0.3</td><td>0.3</td>" in html
    assert "25.87" not in html and "2587" not in html and "shown as unknown" in html
    _assert_valid_png(run / "report" / "mfu.png")


def test_compare_overlays_and_adds_ratios(tmp_path: Path):
    # Same job name in both (the config's default): the parent folder tells them apart.
    base = _write_run(tmp_path / "base", "DeepSpeedJobName")
    fast = _write_run(tmp_path / "fast", "DeepSpeedJobName", speed=1.25, ranks=10)  # many ranks: a band
    path = build_report(fast, out_dir=tmp_path / "cmp", compare=base)
    html = path.read_text()
    a, b = "fast/DeepSpeedJobName", "base/DeepSpeedJobName"
    assert f"terascale report: {a} vs {b}" in html
    assert f"<th>ratio {a} / {b}</th>" in html and f"<th>last ({b})</th>" in html
    assert "<td>samples/s (median, last half)</td><td>125</td><td>100</td><td>1.25×</td>" in html
    assert "<td>Time/forward_ms</td>" in html and "<td>0.8×</td>" in html
    # Metrics only one run has get a dash, not an error.
    assert re.search(r"<td>Memory/rank9/host_rss_gb</td>(<td>[^<]*</td>){5}<td>–</td><td>–</td>", html)
    for p in _pngs(html, path.parent):
        _assert_valid_png(p)
    assert len(_pngs(html, path.parent)) == 8


def test_reads_parent_folder_resumed_and_partial_rows(tmp_path: Path):
    run = _write_run(tmp_path, "job", steps=5, full=False)
    # A resumed run logs again the samples after its checkpoint, and a live run may have a
    # half-written last line: the later value wins and the broken row is skipped.
    with open(run / "Train_Samples_train_loss.csv", "a") as f:
        f.write("96,0.5\n128,0.25\n160,")
    loaded = load_run(tmp_path)  # the parent holding one job folder
    loss = loaded.metrics["Train/Samples/train_loss"]
    assert loaded.name == "job" and loss.x == [32, 64, 96, 128, 160]
    assert loss.y[2:4] == [0.5, 0.25]
    _write_run(tmp_path, "other", steps=2, full=False)
    with pytest.raises(ValueError, match="several runs"):
        load_run(tmp_path)


def test_empty_dir_and_missing_matplotlib_are_clear_errors(tmp_path: Path, monkeypatch, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no CSV files in" in capsys.readouterr().err
    run = _write_run(tmp_path / "r", "job", steps=3, full=False)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install"):
        build_report(run)


def test_cli_prints_the_html_path(tmp_path: Path):
    run = _write_run(tmp_path, "job", steps=10)
    out = tmp_path / "page"
    proc = subprocess.run([sys.executable, "-m", "terascale", "report", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out / "report.html")
    assert (out / "report.html").exists() and (out / "loss.png").exists()


def _train_tiny(out_dir: str) -> None:
    import terascale
    from toy import make_data, make_model

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "tiny"},
    }
    engine, *_ = terascale.initialize(model=make_model(), config=config)
    x, y = make_data(12, 4)
    for s in range(12):
        engine.backward(engine(x[s], y[s]))
        engine.step()
    engine.destroy()


def test_report_of_a_real_training_run(tmp_path: Path):
    from distributed import run_ranks

    run_ranks(_train_tiny, 1, str(tmp_path))
    path = build_report(tmp_path)  # the csv_monitor's output_path: one job folder below it
    html = path.read_text()
    assert path.parent == tmp_path / "tiny" / "report"
    assert "<td>points (train loss)</td><td>12</td>" in html
    _assert_valid_png(path.parent / "loss.png")
    # Whatever else the engine logs (or not yet), the page names it instead of failing.
    assert all(f"<h2>{title}</h2>" in html for title in SECTIONS)
