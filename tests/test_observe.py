"""What the engine reports about throughput and utilisation (terascale/engine/observe.py):
tokens/s, the GPT formula's TFLOP/s and MFU, user metrics, checked against their definitions."""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from distributed import run_ranks

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
SEQ, LAYERS, HIDDEN, VOCAB = 16, 2, 32, 64


def _rows(folder: Path, name: str) -> list[tuple[int, float]]:
    with open(folder / f"{name.replace('/', '_')}.csv") as f:
        return [(int(r[0]), float(r[1])) for r in list(csv.reader(f))[1:]]


def _train_gpt(out_dir: str, extra: dict, peak: float | None = None) -> list[str]:
    """A few steps of a tiny GPT; ``peak``: the device peak the engine divides by, stubbed
    (in this rank's process only) instead of measured."""
    sys.path.insert(0, str(ROOT / "examples"))
    from contextlib import nullcontext
    from unittest import mock

    import torch
    from gpt import GPT, GPTConfig

    import terascale

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("terascale").addHandler(Collect())
    logging.getLogger("terascale").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=HIDDEN))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
        **extra,
    }
    stub = nullcontext() if peak is None else mock.patch("terascale.engine.observe.peak_flops",
                                                         return_value=(peak, "stubbed peak"))
    with stub:
        engine, *_ = terascale.initialize(model=model, config=config)
        g = torch.Generator().manual_seed(engine.rank)
        for _ in range(4 * engine.gradient_accumulation_steps()):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
            engine.backward(engine(ids, ids))
            engine.step()
            engine.eval()  # an evaluation forward counts no tokens and opens no step
            with torch.no_grad():
                engine(ids[:1], ids[:1])
            engine.train()
        engine.log_metrics({"Eval/loss": 1.5})
        engine.destroy()
    return messages


def test_tokens_flops_and_mfu_follow_their_definitions(tmp_path: Path) -> None:
    from terascale.profiling.throughput import gpt_flops_per_token

    messages, _ = run_ranks(_train_gpt, 2, str(tmp_path), {"gradient_clipping": 1.0})
    job = tmp_path / "job"
    samples = _rows(job, "Throughput/samples_per_s")
    tokens = _rows(job, "Throughput/tokens_per_s")
    tflops = _rows(job, "Throughput/tflops")
    mfu = _rows(job, "Throughput/mfu")
    assert [x for x, _ in samples] == [16, 32]  # every 2 steps of 8 samples
    # tokens/s = samples/s x sequence length (input_ids are (batch, SEQ)).
    assert [t for _, t in tokens] == pytest.approx([s * SEQ for _, s in samples], rel=1e-9)
    # TFLOP/s per rank by the GPT formula: per-token FLOPs x tokens/s over the 2 ranks.
    per_token = gpt_flops_per_token(LAYERS, HIDDEN, VOCAB, SEQ)
    assert [f for _, f in tflops] == pytest.approx([per_token * t / 2 / 1e12 for _, t in tokens], rel=1e-9)
    assert all(0 < m < 1 for _, m in mfu)
    assert [x for x, _ in _rows(job, "Train/Samples/grad_norm")] == [16, 32]  # clipping computes the norm
    assert _rows(job, "Eval/loss") == [(32, 1.5)]
    line = next(m for m in messages if m.startswith("step=4 "))
    assert " tokens/s, " in line and "TFLOP/s per rank (GPT formula)" in line and "MFU " in line and "grad_norm=" in line, line


def test_a_peak_below_the_achieved_rate_gives_no_mfu_figure(tmp_path: Path) -> None:
    # 1 MFLOP/s: far below what any CPU achieves, as a peak timed on a slow matmul path was.
    (messages,) = run_ranks(_train_gpt, 1, str(tmp_path), {}, 1e6)
    lines = [m for m in messages if m.startswith("step=")]
    assert len(lines) == 2
    for line in lines:
        assert "MFU n/a (achieved above the peak of 1e-06 TFLOP/s, stubbed peak)" in line, line
        assert "%" not in line.split("MFU")[1].split("|")[0], line
    job = tmp_path / "job"
    assert _rows(job, "Throughput/tflops") and not (job / "Throughput_mfu.csv").exists()


def test_mfu_is_a_fraction_or_says_why_not() -> None:
    from terascale.engine.observe import _mfu_text
    from terascale.profiling.throughput import utilisation

    assert utilisation(5e10, 1e11) == 0.5 and utilisation(1e11, 1e11) == 1.0
    assert utilisation(3e10, 1e9) is None  # above the peak: the peak is not the device's
    assert utilisation(3e10, 0.0) is None  # no peak known
    assert _mfu_text(0.557, 1e11, "x") == "MFU 55.7%"
    assert _mfu_text(None, 0.0, "unknown GPU 'X1'") == "MFU n/a (no peak known: unknown GPU 'X1')"
    assert _mfu_text(None, 2e9, "measured F.linear in bfloat16, 1 threads").startswith(
        "MFU n/a (achieved above the peak of 0.002 TFLOP/s")


def _timed_linears(dtype: torch.dtype, delay: float) -> tuple[float, list[tuple]]:
    """The CPU peak of ``dtype`` measured afresh, with F.linear recorded (and slowed by
    ``delay`` seconds a call); (the peak, (input dtype, weight dtype, size) per call)."""
    import time
    from unittest import mock

    import torch
    import torch.nn.functional as F

    from terascale.profiling import throughput

    calls: list[tuple] = []
    real = F.linear

    def linear(x, w, *rest):
        calls.append((x.dtype, w.dtype, x.shape[0]))
        time.sleep(delay)
        return real(x, w, *rest)

    with mock.patch.object(F, "linear", linear), mock.patch.object(torch.Tensor, "__matmul__", None), \
            mock.patch.object(torch, "mm", None), mock.patch.object(torch, "matmul", None):  # fmt: skip
        peak = throughput._measured_cpu_peak.__wrapped__(dtype, torch.get_num_threads())
    return peak, calls


@pytest.mark.alone  # bounds a wall-clock time (see conftest.py)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_cpu_peak_times_the_compute_dtypes_linear_and_grows_while_cheap(dtype_name: str) -> None:
    import time

    import torch

    from terascale.profiling.throughput import peak_flops

    dtype = getattr(torch, dtype_name)
    peak, calls = _timed_linears(dtype, 0.0)
    # nn.Linear's path (F.linear), in the compute dtype, square sizes growing from 256.
    assert calls and all(x == w == dtype for x, w, _ in calls)
    sizes = sorted({n for _, _, n in calls})
    assert sizes[0] == 256 and sizes == [256 * 2**i for i in range(len(sizes))] and sizes[-1] <= 2048
    assert peak > 1e9
    # A slow path (20 ms a product, as bf16 is on a CPU without bf16 kernels) stops at 256:
    # 8x that for 512 would be over the budget of one product.
    started = time.perf_counter()
    _, calls = _timed_linears(dtype, 0.02)
    assert {n for _, _, n in calls} == {256} and time.perf_counter() - started < 0.5
    rate, source = peak_flops(torch.device("cpu"), dtype)
    assert rate > 0 and source == f"measured F.linear in {dtype_name}, {torch.get_num_threads()} threads"


def test_gpt_flops_formula_matches_megatron() -> None:
    from terascale.profiling.throughput import gpt_flops_per_token, model_shape

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig, flops_per_iteration

    config = GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024)
    # With recompute, per token x tokens is the Megatron-LM formula the demo reports.
    megatron = flops_per_iteration(config, global_batch=8, seq_len=1024)
    assert gpt_flops_per_token(24, 1024, 50304, 1024, recompute=True) * 8 * 1024 == pytest.approx(megatron, rel=1e-12)
    # Without it: 6 x (block parameters) per token, the attention terms and the logits.
    block_params = 24 * 12 * 1024 * 1024
    expected = 6 * block_params + 3 * 24 * 4 * 1024 * 1024 + 6 * 1024 * 50304
    assert gpt_flops_per_token(24, 1024, 50304, 1024) == pytest.approx(expected, rel=1e-12)
    assert model_shape(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))) == (2, 16, 64)
    with pytest.raises(ValueError, match="seq_len"):
        gpt_flops_per_token(1, 1, 1, 0)


def test_tokens_in_finds_input_ids() -> None:
    import torch

    from terascale.profiling.throughput import tokens_in

    ids = torch.zeros(4, 128, dtype=torch.long)
    assert tokens_in(((torch.randn(4, 3),), {"input_ids": ids})) == (512, 128)
    assert tokens_in(((torch.randn(4, 128),), {})) == (0, 0)  # floats are not tokens


def _profile_at_stage(out_dir: str, stage: int, checkpointing: bool) -> list[tuple]:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if stage == 3 and checkpointing:  # and with parameters and optimizer state offloaded
        zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    extra = {"zero_optimization": zero,
             "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": 2, "top_modules": 2,
                                "output_file": f"{out_dir}/profile{stage}.txt"},
             "activation_checkpointing": {"policy": "blocks" if checkpointing else "none"}}
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from gpt import GPT, GPTConfig

    import terascale

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=HIDDEN))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}
    engine, *_ = terascale.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(engine.rank)
    losses = []
    for _ in range(3 * engine.gradient_accumulation_steps()):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    profile = engine.flops_profiler
    rows = [(p.name, p.params, p.fwd_flops, p.bwd_flops) for p in profile.profiles()]
    measured = float(profile.total_flops())
    engine.destroy()
    return rows, measured, losses


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing-and-offload"])
def test_flops_profile_at_stage3_equals_the_unsharded_one(tmp_path: Path, checkpointing: bool) -> None:
    from terascale.profiling.throughput import gpt_flops_per_token

    (rows0, flops0, losses0), _ = run_ranks(_profile_at_stage, 2, str(tmp_path), 0, checkpointing)
    (rows3, flops3, losses3), _ = run_ranks(_profile_at_stage, 2, str(tmp_path), 3, checkpointing)
    assert rows3 == rows0  # full layers and full parameter counts, not shards
    assert losses3 == pytest.approx(losses0, rel=1e-5)  # profiling step 2 changed nothing
    params = sum(r[1] for r in rows0 if r[0] == "")
    assert params == rows0[0][1] and params > 0
    # Counted: the step's 2 micro-batches of 2 x SEQ tokens on this rank, within 2% of the
    # analytic count (which leaves out element-wise work and counts recompute like torch does
    # when the blocks are checkpointed: with checkpointing, more).
    analytic = gpt_flops_per_token(LAYERS, HIDDEN, VOCAB, SEQ, recompute=checkpointing) * 2 * 2 * SEQ
    assert flops0 == flops3
    if not checkpointing:
        assert flops0 == pytest.approx(analytic, rel=0.02)
    else:
        assert gpt_flops_per_token(LAYERS, HIDDEN, VOCAB, SEQ) * 2 * 2 * SEQ < flops0 <= analytic * 1.02
    text = (tmp_path / "profile3.txt").read_text()
    assert "(blocks) ModuleList" in text and "(0) Block" in text and "aggregated profile" in text, text[:2000]


def _comms_and_trace(out_dir: str) -> list[str]:
    extra = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
             "comms_logger": {"enabled": True},
             "profiler": {"enabled": True, "start_step": 2, "num_steps": 1, "output_dir": f"{out_dir}/traces"}}
    return _train_gpt(out_dir, extra)


def test_comms_logger_and_trace_window_through_the_engine(tmp_path: Path) -> None:
    import json

    messages, _ = run_ranks(_comms_and_trace, 2, str(tmp_path))
    # destroy() logs the table; stage 3 gathers parameters and reduce-scatters gradients.
    summary = next(m for m in messages if m.startswith("communication summary"))
    assert "all_gather_into_tensor" in summary and "reduce_scatter_tensor" in summary, summary
    job = tmp_path / "job"
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        rows = _rows(job, f"Comms/{op}/busbw_gbps")
        assert [x for x, _ in rows] == [16, 32] and all(v > 0 for _, v in rows), (op, rows)
    # The trace of step 2, one file per rank, with the engine's and the ZeRO groups' ranges.
    for rank in (0, 1):
        trace = json.loads((tmp_path / "traces" / f"rank{rank}.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        for wanted in ("terascale::forward", "terascale::backward", "terascale::step", "terascale::iteration 2"):
            assert wanted in names, (wanted, sorted(n for n in names if n.startswith("terascale"))[:40])
        assert any(n.startswith("terascale::gather group") for n in names)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"comms_logger": {"enabeld": True}}, "comms_logger.enabeld: unknown key; did you mean 'enabled'"),
        ({"profiler": {"start_stp": 3}}, "profiler.start_stp: unknown key; did you mean 'start_step'"),
        ({"profiler": {"num_steps": 0}}, "profiler.num_steps"),
        ({"flops_profiler": {"top_modules": 0}}, "flops_profiler.top_modules"),
    ],
)
def test_config_errors_name_the_key(section: dict, message: str) -> None:
    from terascale.config import Config, ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Config.load({"train_batch_size": 8, **section})
