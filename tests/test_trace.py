"""The trace window writes one Chrome/Perfetto trace per rank over whole optimizer steps,
with terascale's phases as named ranges (stage 3: the gathers and reduce-scatters)."""

from __future__ import annotations

import json
from pathlib import Path

from distributed import run_ranks


def _trace_rank(out_dir: str, nvme_dir: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import terascale
    from terascale.config.profiling import TraceConfig
    from terascale.profiling.trace import TraceWindow

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = terascale.initialize(model=model(), config=config)
    trace_config = TraceConfig(enabled=True, start_step=2, num_steps=2, output_dir=out_dir)
    window = TraceWindow(trace_config, engine.dist.rank, engine.device)
    written = {}
    for step in range(1, 5):
        window.step_begins(step)
        x = torch.randn(2, 8, device=engine.device)
        y = torch.randint(0, 2, (2,), device=engine.device)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        path = window.step_ends(step)
        written[step] = (str(path) if path else None, window.running, Path(window.path).exists())
    closed = window.close()  # nothing open any more
    engine.destroy()

    # Optimizer state on NVMe and a checkpoint inside a one-step window: the swap I/O
    # threads and the checkpoint writer show up too.
    config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir}}
    engine, *_ = terascale.initialize(model=model(), config=config)
    io_config = TraceConfig(enabled=True, start_step=1, output_dir=out_dir + "_io")
    io_window = TraceWindow(io_config, engine.dist.rank, engine.device)
    io_window.step_begins(1)
    engine.backward(F.cross_entropy(engine(torch.randn(2, 8, device=engine.device)), torch.zeros(2, dtype=torch.long)))
    engine.step()
    engine.save_checkpoint(nvme_dir + "/ckpt")
    io_path = io_window.step_ends(1)
    engine.destroy()
    return {"written": written, "path": str(window.path), "closed": closed, "io_path": str(io_path)}


def test_trace_window_writes_named_ranges_per_rank(tmp_path):
    (tmp_path / "nvme").mkdir()
    results = run_ranks(_trace_rank, 2, str(tmp_path / "traces"), str(tmp_path / "nvme"))
    for rank, r in enumerate(results):
        path = tmp_path / "traces" / f"rank{rank}.trace.json"
        assert r["path"] == str(path)
        # Open over steps 2-3; written when step 3 ends, not before and never again.
        assert r["written"][1] == (None, False, False)
        assert r["written"][2] == (None, True, False)
        assert r["written"][3] == (str(path), False, True)
        assert r["written"][4] == (None, False, True)
        assert r["closed"] is None
        names = [e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]]
        assert "terascale::iteration 2" in names and "terascale::iteration 3" in names
        assert "terascale::iteration 1" not in names and "terascale::iteration 4" not in names
        gathers = {n for n in names if n.startswith("terascale::gather group ")}
        reduces = {n for n in names if n.startswith("terascale::reduce_scatter group ")}
        # Every group of the model (three Linear layers, one group each) shows up.
        assert len(gathers) == 3 and len(reduces) == 3, (gathers, reduces)
        assert any(n.startswith("terascale::optimizer run ") for n in names)
        io_names = {e.get("name", "") for e in json.loads(Path(r["io_path"]).read_text())["traceEvents"]}
        assert {"terascale::swap read", "terascale::swap write", "terascale::checkpoint write"} <= io_names


def test_trace_window_disabled_and_cut_short(tmp_path):
    import torch

    from terascale.config.profiling import TraceConfig
    from terascale.profiling.trace import TraceWindow

    off = TraceWindow(TraceConfig(enabled=False, output_dir=str(tmp_path)), 0, "cpu")
    off.step_begins(1)
    assert off.step_ends(1) is None and not off.running and not list(tmp_path.iterdir())

    # Training ends inside the window: close() writes what it holds.
    window = TraceWindow(TraceConfig(enabled=True, start_step=1, num_steps=5, output_dir=str(tmp_path)), 3, "cpu")
    window.step_begins(1)
    torch.ones(4).sum()
    assert window.step_ends(1) is None and window.running
    path = window.close()
    assert path == tmp_path / "rank3.trace.json" and path.exists() and not window.running
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert "terascale::iteration 1" in names and "aten::sum" in names
