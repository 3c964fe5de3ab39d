"""The demo (``make demo``): its GPT, corpus and FLOP formula, and a short real 2-rank run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from gpt import DEMO_CONFIG, GPT, ByteBlocks, GPTConfig, decode, encode, flops_per_iteration  # noqa: E402
from gpt import load_stdlib_corpus  # noqa: E402


def test_demo_model_size_and_tied_head():
    model = GPT(DEMO_CONFIG)
    assert 10e6 <= model.num_parameters() <= 20e6
    assert model.lm_head.weight is model.wte.weight


def test_flops_formula_counts_megatron_matmuls():
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=6, n_embd=384)
    b, s, l, h, v = 16, 128, 6, 384, 256
    # Per layer forward: QKV + projection + MLP = 24·B·s·h², attention scores and values
    # = 4·B·s²·h; x4 for forward, backward and a recomputed forward. Logits: 2·B·s·h·V, x3.
    expected = 4 * l * (24 * b * s * h * h + 4 * b * s * s * h) + 3 * 2 * b * s * h * v
    assert math.isclose(flops_per_iteration(cfg, b, s), expected, rel_tol=1e-12)


def test_corpus_is_stdlib_source_split_by_file():
    corpus = load_stdlib_corpus(max_bytes=300_000, held_out_fraction=0.1, seed=3)
    assert corpus.train.numel() + corpus.held_out.numel() <= 300_000
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    assert any(f.endswith(".py") for f in corpus.train_files)
    again = load_stdlib_corpus(max_bytes=300_000, held_out_fraction=0.1, seed=3)
    assert torch.equal(corpus.train, again.train)
    assert b"def " in bytes(corpus.train[:100_000].tolist())


def test_byte_blocks_predict_the_next_byte():
    data = encode("abcdefghij")
    blocks = ByteBlocks(data, block_size=3)
    assert len(blocks) == 3
    x, y = blocks[1]
    assert decode(x) == "def" and decode(y) == "efg"
    with pytest.raises(IndexError):
        blocks[3]


def test_generate_is_reproducible_and_extends_the_prompt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    prompt = encode("def ")
    a = model.generate(prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(1))
    assert a.shape == (24,) and torch.equal(a, b) and torch.equal(a[:4], prompt)


def test_demo_dtype_rule_takes_bf16_only_where_it_is_not_slower():
    from train_gpt import choose_dtype

    assert choose_dtype(200.0, 90.0) == "bf16"  # AVX-512 BF16: bf16 about twice fp32
    assert choose_dtype(90.0, 90.0) == "bf16"  # a tie: bf16 halves the bytes moved
    assert choose_dtype(6.0, 85.0) == "fp32"  # AVX2 only: bf16 falls back to a slow path
    with pytest.raises(ValueError, match="positive"):
        choose_dtype(0.0, 85.0)


def test_demo_dtype_overrides_the_config_and_follows_a_resumed_run(tmp_path):
    from train_gpt import config_dtype, resumed_run_dtype, with_dtype

    config = json.loads((ROOT / "examples" / "configs" / "gpt_demo.json").read_text())
    assert config_dtype(config) == "bf16"
    fp32 = with_dtype(config, "fp32")
    assert fp32["bf16"] == {"enabled": False} and config_dtype(fp32) == "fp32" and config["bf16"]["enabled"]
    assert {k: v for k, v in fp32.items() if k != "bf16"} == {k: v for k, v in config.items() if k != "bf16"}
    assert config_dtype(with_dtype({"fp16": {"enabled": True, "loss_scale": 0}}, "bf16")) == "bf16"
    with pytest.raises(ValueError, match="'bf16' or 'fp32'"):
        with_dtype(config, "fp16")
    # --resume-from OUT/checkpoints/global_stepN: the saving run's OUT/metrics.json decides.
    checkpoint = tmp_path / "demo" / "checkpoints" / "global_step100"
    checkpoint.mkdir(parents=True)
    assert resumed_run_dtype(str(checkpoint)) is None  # not written yet: the resumed run measures
    (tmp_path / "demo" / "metrics.json").write_text(json.dumps({"dtype": "float32"}))
    assert resumed_run_dtype(str(checkpoint)) == ("fp32", tmp_path / "demo" / "metrics.json")
    assert resumed_run_dtype(str(checkpoint.parent)) == ("fp32", tmp_path / "demo" / "metrics.json")


@pytest.mark.parametrize(("config", "dtype"), [("gpt_demo.json", "auto"), ("gpt_demo_nvme.json", "bf16")])
def test_demo_trains_on_two_ranks(tmp_path, config, dtype):
    """The demo script end to end, through the launcher, with a small model and few steps
    (the NVMe config: optimizer state and parameters in swap files under ./runs, in bf16
    whatever this CPU is fast at)."""
    out = tmp_path / "demo"
    cmd = [
        sys.executable, "-m", "terascale", "run", "--nproc", "2", str(ROOT / "examples" / "train_gpt.py"),
        "--config", str(ROOT / "examples" / "configs" / config), "--out", str(out), "--dtype", dtype,
        "--steps", "16", "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32",
        "--max-bytes", "300000", "--eval-every", "8", "--eval-batches", "2", "--sample-tokens", "40",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TERASCALE_DEVICE": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The progress bar (stderr) reports loss, throughput, TFLOP/s and memory of both ranks.
    assert "tok/s=" in proc.stderr and "TFLOP/s=" in proc.stderr
    assert "mem/rank=" in proc.stderr and "/" in proc.stderr.split("mem/rank=")[-1].split("MiB")[0]
    metrics = json.loads((out / "metrics.json").read_text())
    # The first line names the dtype and why: measured under auto (bf16 where it is not the slower).
    first = proc.stdout.splitlines()[0]
    chosen = first.removeprefix("compute dtype: ").split(" ")[0]
    assert chosen in ("bf16", "fp32") and metrics["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[chosen], first
    if dtype == "auto":
        rates = metrics["linear_gflops"]
        assert chosen == ("bf16" if rates["bf16"] >= rates["fp32"] else "fp32") and "GFLOP/s" in first, first
    else:
        assert chosen == dtype and first.endswith(f"set by --dtype {dtype}"), first
    assert metrics["world_size"] == 2 and metrics["steps"] == 16
    curve = metrics["loss_curve"]
    assert len(curve) == 16 and curve[-1] < curve[0] - 0.5, curve
    assert metrics["held_out_loss_end"] < metrics["held_out_loss_start"] - 0.5
    assert metrics["tokens_per_s"] > 0 and metrics["tflops"] > 0
    assert len(metrics["memory_mib_per_rank"]) == 2
    assert (out / "loss.png").stat().st_size > 10_000
    sample = (out / "sample.txt").read_text()
    assert sample.startswith("def ") and "--- sample" in proc.stdout
    assert not any((tmp_path / "runs").rglob("*.swp"))  # the engine deletes its swap files
