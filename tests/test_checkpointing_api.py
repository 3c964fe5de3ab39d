"""terascale.checkpointing (DeepSpeed's API), the RNG tracker, partitioned checkpoints, activation
memory reports, config errors, and models that checkpoint themselves (torch.utils.checkpoint,
HF gradient checkpointing) under every ZeRO stage."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import terascale
import terascale.checkpointing as ckpt
from act_model import Block, config, make_net, train
from distributed import run_ranks
from terascale.config import Config, ConfigError


@pytest.fixture(autouse=True)
def _fresh_api():
    ckpt._close_owned()
    yield
    ckpt._close_owned()


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def test_checkpoint_takes_keywords_and_returns_tuples_with_non_tensors() -> None:
    torch.manual_seed(0)
    block = Block(8)
    x = torch.randn(3, 8, requires_grad=True)

    def fn(h, *, scale):
        out = block(h, scale=scale)
        return out, "tag", None, out.sum()

    torch.manual_seed(1)
    out, tag, nothing, total = fn(x, scale=0.5)
    (out.square().sum() + total).backward()
    want, want_x = _grads(block), x.grad.clone()
    block.zero_grad()
    x.grad = None

    torch.manual_seed(1)  # same dropout mask in forward; the recompute must replay it
    out, tag, nothing, total = ckpt.checkpoint(fn, x, scale=0.5)
    assert (tag, nothing) == ("tag", None)
    (out.square().sum() + total).backward()
    for a, b in zip(_grads(block), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want_x, rtol=0, atol=0)
    assert ckpt.is_configured()


def test_recompute_without_replay_would_differ() -> None:
    """The oracle above can fail: dropout drawn afresh in backward changes the gradients."""
    torch.manual_seed(0)
    block = Block(8)
    x = torch.randn(3, 8)
    torch.manual_seed(1)
    block(x).sum().backward()
    want = _grads(block)
    block.zero_grad()
    torch.manual_seed(1)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
    out.sum().backward()
    assert any(not torch.equal(a, b) for a, b in zip(_grads(block), want))


def test_checkpoint_sequential_and_configure_from_a_deepspeed_config(tmp_path) -> None:
    ckpt.configure(
        deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True, "nvme_path": str(tmp_path),
                                                        "profile": True}},
        contiguous_checkpointing=True, num_checkpoints=3,
    )  # fmt: skip
    store = ckpt._API.checkpointing.store
    assert store.options.tier == "nvme" and store.options.contiguous and store.options.number_checkpoints == 3
    torch.manual_seed(0)
    seq = nn.Sequential(*(Block(8) for _ in range(5)))
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(3)
    seq(x).sum().backward()
    want = _grads(seq)
    seq.zero_grad()
    torch.manual_seed(3)
    ckpt.checkpoint_sequential(seq, 3, x).sum().backward()
    for a, b in zip(_grads(seq), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    rows = ckpt._API.checkpointing.report()
    assert [r["block"] for r in rows] == ["segment0", "segment1"]
    assert all(r["recompute_ms"] > 0 and r["recompute_bytes"] > 0 for r in rows)
    ckpt.reset()
    assert ckpt._API.checkpointing.report() == []


class _FakeMpu:
    def __init__(self, rank: int, group=None) -> None:
        self.rank, self.group = rank, group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank

    def get_tensor_model_parallel_group(self):
        return self.group


def test_rng_tracker_streams_and_their_replay() -> None:
    draws = {}
    for tp_rank in (0, 1):
        ckpt.configure(mpu_=_FakeMpu(tp_rank))
        ckpt.model_parallel_manual_seed(1234)
        with ckpt.get_rng_tracker().fork():
            sliced = torch.rand(4)
        shared = torch.rand(4)
        draws[tp_rank] = (sliced, shared)
    assert not torch.equal(draws[0][0], draws[1][0]), "tensor-parallel ranks must drop different elements"
    assert torch.equal(draws[0][1], draws[1][1]), "replicated activations must drop the same elements"

    tracker = ckpt.get_rng_tracker()
    with pytest.raises(ValueError, match="no stream 'other'"):
        with tracker.fork("other"):
            pass
    x = torch.randn(6, requires_grad=True)

    def fn(h):
        with tracker.fork():
            return F.dropout(h, 0.5) * 2

    states = tracker.get_states()
    fn(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    tracker.set_states(states)
    ckpt.checkpoint(fn, x).sum().backward()
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def _partition_rank() -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    for partition in (False, True):
        ckpt.configure(mpu_=_FakeMpu(rank, dist.group.WORLD), partition_activations=partition)
        torch.manual_seed(0)  # both ranks hold the same replicated block and input
        block = Block(8)
        x = torch.randn(5, 8, requires_grad=True)
        torch.manual_seed(1)
        ckpt.checkpoint(block, x, scale=2.0).sum().backward()
        stats = ckpt._API.checkpointing.store.stats["checkpoint"]
        out[partition] = (_grads(block) + [x.grad], stats.bytes)
        ckpt._close_owned()
    return out


def test_partitioned_checkpoints_keep_a_slice_per_rank_and_gather_for_the_recompute() -> None:
    for result in run_ranks(_partition_rank, 2):
        for a, b in zip(result[True][0], result[False][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert result[True][1] * 2 == result[False][1] == 5 * 8 * 4  # half the input on each rank


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"policy": "layers"}, "policy"),
        ({"nvme_path": "/tmp"}, "set activation_checkpointing.cpu_checkpointing: true"),
        ({"cpu_checkpointing": True, "nvme_path": ""}, "nvme_path is empty"),
        ({"every_n": 0}, "every_n"),
    ],
)
def test_config_errors_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.load({"activation_checkpointing": section})


def _missing_nvme_rank(path: str) -> str:
    cfg = config(1, 1, 3, {"policy": "blocks", "cpu_checkpointing": True, "nvme_path": path})
    try:
        terascale.initialize(model=make_net(), config=cfg)
    except ValueError as e:
        return str(e)
    return ""


def test_spill_to_a_missing_nvme_path_is_a_clear_error(tmp_path) -> None:
    [message] = run_ranks(_missing_nvme_rank, 1, str(tmp_path / "absent"))
    assert "is not an existing directory" in message and "absent" in message


def _memory_rank(nvme: str) -> dict:
    rank = int(os.environ["RANK"])
    out = {}
    for name, activation in {
        "none": {"policy": "none"},
        "blocks": {"policy": "blocks"},
        "nvme": {"policy": "blocks", "cpu_checkpointing": True, "nvme_path": nvme, "profile": True},
    }.items():
        cfg = config(1, 1, 3, activation, memory_breakdown=True)
        engine, *_ = terascale.initialize(model=make_net(), config=cfg)
        train(engine, 1, rank, 1)
        out[name] = (engine.memory_breakdown(), engine.activation_report())
        engine.destroy()
    return out


def test_memory_breakdown_measures_activations_by_block(tmp_path) -> None:
    [out] = run_ranks(_memory_rank, 1, str(tmp_path))
    none, blocks, nvme = (out[k][0] for k in ("none", "blocks", "nvme"))
    block_input = 2 * 6 * 16 * 4  # micro-batch x tokens x width, fp32
    report = {r["block"]: r for r in out["none"][1]}
    assert {f"blocks.{i}" for i in range(4)} <= set(report)
    per_block = report["blocks.0"]["saved_bytes"]
    assert per_block > 4 * block_input
    # blocks: each block keeps only its input (4 blocks of 4), the rest is outside the blocks
    assert blocks["checkpoint_inputs"] == 4 * block_input
    assert blocks["activations"] <= none["activations"] - 4 * per_block + 4 * block_input
    # spilled to disk: at most the prefetch window (2) plus the block in recompute on the device
    assert 0 < nvme["checkpoint_inputs"] <= 3 * block_input
    assert nvme["activations"] < blocks["activations"]
    rows = {r["block"]: r for r in out["nvme"][1]}
    for i in range(4):  # profile: per-block forward, recompute, offload and fetch-wait times
        row = rows[f"blocks.{i}"]
        assert row["checkpoints"] == 1 and row["input_bytes"] == block_input
        assert row["forward_ms"] > 0 and row["recompute_ms"] > 0 and row["offload_ms"] > 0
        assert row["recompute_bytes"] >= per_block  # the recompute rebuilds what the block saves


def test_contiguous_checkpoints_share_one_buffer_sized_by_number_checkpoints() -> None:
    ckpt.configure(contiguous_checkpointing=True, num_checkpoints=4)
    store = ckpt._API.checkpointing.store
    torch.manual_seed(0)
    block = Block(8)
    x = torch.randn(16, 8, requires_grad=True)
    buffers = []
    for step in range(3):
        h = x
        for _ in range(4):
            h = ckpt.checkpoint(block, h, scale=0.5)
        buffers.append(store._arena.buffer)
        assert store._arena.offset == 4 * 16 * 8 * 4  # every checkpoint of the step is in it
        h.sum().backward()
    assert buffers[0].numel() == 4 * 16 * 8 * 4
    assert all(b is buffers[0] for b in buffers), "the buffer is allocated once and reused every step"


def test_estimate_activations_by_policy(capsys) -> None:
    from terascale.activation.estimate import estimate_activations
    from terascale.launcher.cli import main

    rows = {e.policy: e for e in estimate_activations(layers=32, hidden=4096, heads=32, seq=4096, micro_batch=1)}
    sbh = 4096 * 4096
    assert rows["none"].device == 32 * 34 * sbh  # Korthikanti et al., fused attention
    assert rows["blocks"].device == 32 * 2 * sbh + 34 * sbh  # inputs + one layer recomputed
    assert rows["blocks + cpu"].device < rows["blocks"].device and rows["blocks + cpu"].host == 32 * 2 * sbh
    assert rows["none"].device > rows["selective"].device > rows["blocks"].device
    assert main(["estimate", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "32",
                 "--seq", "4096", "--offload", "none"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "activations per rank, sequence 4096" in out and "blocks + cpu" in out
    assert main(["estimate", "--params", "7e9", "--layers", "32"]) == 2


class _Mpu:
    """Two tensor-parallel ranks holding the same replicated model; each its own data-parallel group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        self.dp = groups[dist.get_rank()]

    def get_data_parallel_group(self):
        return self.dp

    def get_model_parallel_group(self):
        import torch.distributed as dist

        return dist.group.WORLD

    def get_model_parallel_world_size(self) -> int:
        return 2


def _engine_partition_rank() -> int:
    import torch.distributed as dist

    from act_model import reference

    dist.init_process_group("gloo")
    ref_losses, ref_weights = reference(1, 0, 2)  # both ranks see rank 0's data, as tensor-parallel ranks do
    cfg = config(1, 2, 3, {"policy": "blocks", "partition_activations": True, "cpu_checkpointing": True})
    engine, *_ = terascale.initialize(model=make_net(), config=cfg, mpu=_Mpu())
    losses = train(engine, 1, 0, 2)
    kept = engine.activations.checkpointing.store.stats["blocks.0"].bytes
    weights = engine.full_state_dict()
    engine.destroy()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)
    return kept


def test_engine_partitions_checkpoints_over_the_mpu_model_parallel_group() -> None:
    kept = run_ranks(_engine_partition_rank, 2)
    block_input = 2 * 6 * 16 * 4
    assert kept == [6 * block_input // 2] * 2  # 6 micro-steps, each keeping half a block input per rank


def test_a_function_that_changes_its_input_in_place_is_warned_about() -> None:
    # Its recompute may start from the changed input: wrong gradients unless the change is
    # idempotent. torch's checkpoint refuses this; terascale says so (once per label).
    ckpt.configure()
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="changed its input in place"):
        ckpt.checkpoint(lambda h: linear(h.add_(1.0)), x * 2).sum().backward()

    ckpt.configure()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # out of place: nothing to say
        ckpt.checkpoint(lambda h: linear(h + 1.0), x * 2).sum().backward()
