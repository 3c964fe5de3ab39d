"""What the engine reports: steps_per_print logs, wall-clock breakdown, memory, CSV monitor."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest

from distributed import run_ranks
from toy import make_data, make_model


def _train_with_reporting(out_dir: str):
    import terascale

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("terascale")
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "fp16": {"enabled": True, "initial_scale_power": 4},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
    }
    engine, *_ = terascale.initialize(model=make_model(), config=config)
    x, y = make_data(4, 4 * engine.world_size)
    window_losses = []
    for s in range(4):
        total = 0.0
        for m in range(2):
            lo = (m * engine.world_size + engine.dist.dp_rank) * 2
            loss = engine(x[s, lo : lo + 2].half(), y[s, lo : lo + 2])
            engine.backward(loss)
            engine.step()
            total += loss.item() / 2
        window_losses.append(total)
    engine.destroy()
    return messages, window_losses


def test_logs_timers_memory_and_csv(tmp_path: Path):
    (messages, losses), _ = run_ranks(_train_with_reporting, 2, str(tmp_path))
    step_lines = [m for m in messages if m.startswith("step=")]
    # Printed every 2 optimizer steps, by data-parallel rank 0 only.
    assert [m.split()[0] for m in step_lines] == ["step=2", "step=4"]
    assert all("loss_scale=" in m and "skipped=0" in m for m in step_lines)
    # One line per print: throughput, every rank's memory (the max), the time breakdown.
    for m in step_lines:
        assert " samples/s" in m and "memory (max over ranks): rss " in m, m
        assert "| ms/step: forward " in m and " backward " in m and " step " in m, m
        assert "| waits: gather 0.0 reduce " in m and " io 0.0" in m, m
    # The same numbers go to the monitors at print steps, memory for each rank.
    for name in ("Throughput_samples_per_s", "Memory_rank0_host_rss_gb", "Memory_rank1_host_rss_gb",
                 "Time_forward_ms", "Time_backward_ms", "Time_step_ms", "Time_grad_reduce_ms"):
        with open(tmp_path / "job" / f"{name}.csv") as f:
            rows = list(csv.reader(f))
        assert [int(r[0]) for r in rows[1:]] == [16, 32], name
        assert all(float(r[1]) >= 0 for r in rows[1:]), name
    with open(tmp_path / "job" / "Memory_rank1_host_rss_gb.csv") as f:
        assert all(0.05 < float(r[1]) < 64 for r in list(csv.reader(f))[1:])  # a process's RSS in GB
    # The CSV monitor writes one file per metric, one row per optimizer step, keyed by samples.
    with open(tmp_path / "job" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [8, 16, 24, 32]
    # Rank 0's logged loss is its own window mean (as DeepSpeed's rank-0 log).
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
    assert (tmp_path / "job" / "Train_Samples_loss_scale.csv").exists()
