"""Checkpoints: exact resume, load-time resharding, atomic writes, errors (real ranks, gloo).

Exact resume: a run that saves at step K and a fresh process that loads and continues
produce the uninterrupted run's losses as equal floats. Resharding: a checkpoint saved
on N ranks at stage s loads on M ranks at stage t (offloaded or not) and training
continues on plain PyTorch's trajectory (fp32, 1e-5 relative).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_forked, run_ranks
from parity import LR, WD
from toy import make_data, make_model, reference_train

STEPS, SAVE_AT = 6, 3
GLOBAL_BATCH = 8


def _config(world: int, stage: int, *, gas: int = 1, offload: str | None = None, extra: dict | None = None) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": offload}
        zero["offload_param"] = {"device": "nvme", "nvme_path": offload}
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": zero,
        **(extra or {}),
    }


def _engine(world: int, stage: int, seed: int = 0, **kw):
    import terascale
    from torch import nn

    from terascale.zero import WrapPolicy

    model = make_model(seed=seed)
    engine, *_ = terascale.initialize(
        model=model, config=_config(world, stage, **kw), wrap_policy=WrapPolicy(module_classes=(nn.Linear,))
    )
    return engine


def _train(engine, x, y, steps: range) -> list[float]:
    """Optimizer steps ``steps`` on the global batches ``x[s], y[s]``; the step's mean loss."""
    world, rank, gas = engine.world_size, engine.dist.dp_rank, engine.gradient_accumulation_steps()
    micro = GLOBAL_BATCH // (world * gas)
    losses = []
    for s in steps:
        total = 0.0
        for m in range(gas):
            lo = (m * world + rank) * micro
            loss = engine(x[s, lo : lo + micro], y[s, lo : lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    t = torch.tensor(losses)
    torch.distributed.all_reduce(t)  # every rank's mean: the global batch's loss
    return (t / world).tolist()


# -- resharding ---------------------------------------------------------------------------------


def _save_rank(jobs: list[tuple[int, str | None, int, str]]) -> list[list[float]]:
    world = int(os.environ["WORLD_SIZE"])
    x, y = make_data(STEPS, GLOBAL_BATCH)
    out = []
    for stage, offload, gas, folder in jobs:
        engine = _engine(world, stage, offload=offload, gas=gas)
        out.append(_train(engine, x, y, range(SAVE_AT)))
        held = engine.memory_breakdown()["offload_buffers"]
        engine.save_checkpoint(folder)
        # State on NVMe streams through the swap buffers a step uses: none are added.
        assert engine.memory_breakdown()["offload_buffers"] == held
        engine.destroy()
    return out


def _load_rank(jobs: list[tuple[int, str | None, int, str]]) -> list[list[float]]:
    world = int(os.environ["WORLD_SIZE"])
    x, y = make_data(STEPS, GLOBAL_BATCH)
    out = []
    for stage, offload, gas, folder in jobs:
        engine = _engine(world, stage, seed=7, offload=offload, gas=gas)  # other weights: all must come from the file
        path, client = engine.load_checkpoint(folder)
        loading = engine.memory_breakdown()["offload_buffers"]
        assert path is not None and path.endswith(f"global_step{SAVE_AT}"), path
        assert engine.global_steps == SAVE_AT
        out.append(_train(engine, x, y, range(SAVE_AT, STEPS)))
        # State on NVMe streams in through the swap buffers a step uses: no more of them.
        assert loading <= engine.memory_breakdown()["offload_buffers"], (loading, engine.memory_breakdown())
        engine.destroy()
    return out


def test_checkpoints_reshard_at_load_and_continue_the_trajectory(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    # (saved on world, stage, offload, accumulation) -> (loaded on world, stage, offload, accumulation);
    # the global batch stays 8, so fewer ranks accumulate over more micro-batches.
    matrix = [
        ((2, 3, None, 2), (1, 0, None, 4)),  # 2 -> 1 ranks, stage 3 -> 0, accumulation 2 -> 4
        ((2, 0, None, 1), (4, 3, None, 1)),  # 2 -> 4, stage 0 -> 3
        ((1, 2, None, 4), (2, 1, None, 1)),  # 1 -> 2, stage 2 -> 1, accumulation 4 -> 1
        ((2, 3, str(nvme), 1), (2, 2, None, 2)),  # offloaded -> not, accumulation 1 -> 2
        ((2, 2, None, 1), (2, 3, str(nvme), 1)),  # not -> offloaded
    ]
    folders = [str(tmp_path / f"ckpt{i}") for i in range(len(matrix))]
    saves: dict[int, list] = {}
    loads: dict[int, list] = {}
    for i, ((sw, ss, so, sg), (lw, ls, lo, lg)) in enumerate(matrix):
        saves.setdefault(sw, []).append((i, (ss, so, sg, folders[i])))
        loads.setdefault(lw, []).append((i, (ls, lo, lg, folders[i])))
    ref, _ = reference_train(STEPS, GLOBAL_BATCH, lr=LR, weight_decay=WD, clip=0.0)
    for world, jobs in saves.items():
        # CPU ranks at every world size, as the CPU reference they are held to within 1e-5.
        results = run_ranks(_save_rank, world, [j for _, j in jobs], device="cpu")
        for k, (i, _) in enumerate(jobs):
            torch.testing.assert_close(torch.tensor(results[0][k]), torch.tensor(ref[:SAVE_AT]), rtol=1e-5, atol=0, msg=f"save {matrix[i]}")
    for world, jobs in loads.items():
        results = run_ranks(_load_rank, world, [j for _, j in jobs], device="cpu")
        for k, (i, _) in enumerate(jobs):
            torch.testing.assert_close(
                torch.tensor(results[0][k]), torch.tensor(ref[SAVE_AT:]), rtol=1e-5, atol=0, msg=f"continue {matrix[i]}"
            )
    assert not any((nvme / "terascale_swap").glob("*/*.swp")), "swap files left behind"


# -- exact resume -------------------------------------------------------------------------------

RESUME_CASES = [
    dict(stage=0),
    dict(stage=1),
    dict(stage=2, gas=2),
    dict(stage=3),
    # fp16 with a loss scale that overflows, shrinks and grows within the run.
    dict(stage=2, extra={"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 32, "loss_scale_window": 2, "hysteresis": 1}}),
]


def _steps_from_loader(engine, loader, n: int) -> list[float]:
    """``n`` optimizer steps over the loader (epochs advance on exhaustion), with input
    noise from the global RNG: the trajectory depends on data position and RNG state."""
    sampler = loader.sampler
    it = iter(loader)
    losses = []
    while len(losses) < n:
        total = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            try:
                x, y = next(it)
            except StopIteration:
                sampler.set_epoch(sampler.epoch + 1)
                it = iter(loader)
                x, y = next(it)
            loss = engine(x + 0.01 * torch.randn_like(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total)
    return losses


def _resume_rank(folder: str) -> list[tuple[list[float], list[float], float, float]]:
    import terascale
    from torch import nn
    from torch.utils.data import TensorDataset

    from terascale.zero import WrapPolicy

    world = int(os.environ["WORLD_SIZE"])
    x, y = make_data(8, GLOBAL_BATCH)
    data = TensorDataset(x.view(-1, x.shape[-1]), y.view(-1))  # 64 samples: save lands mid-epoch

    def engine_for(case: dict, seed: int):
        config = _config(world, case["stage"], gas=case.get("gas", 1), extra=case.get("extra"))
        return terascale.initialize(
            model=make_model(seed=seed), config=config, training_data=data,
            wrap_policy=WrapPolicy(module_classes=(nn.Linear,)),
        )  # fmt: skip

    out = []
    for i, case in enumerate(RESUME_CASES):
        torch.manual_seed(1234)
        engine, _, loader, _ = engine_for(case, 0)
        whole = _steps_from_loader(engine, loader, STEPS)
        engine.destroy()

        torch.manual_seed(1234)
        engine, _, loader, _ = engine_for(case, 0)
        first = _steps_from_loader(engine, loader, SAVE_AT)
        engine.save_checkpoint(f"{folder}/{i}", client_state={"note": "hello", "step": SAVE_AT})
        scale_at_save = engine.loss_scale
        engine.destroy()

        torch.manual_seed(99)  # the checkpoint's RNG state must win
        engine, _, loader, _ = engine_for(case, 5)
        path, client = engine.load_checkpoint(f"{folder}/{i}")
        assert client == {"note": "hello", "step": SAVE_AT}, client
        assert engine.loss_scale == scale_at_save
        rest = _steps_from_loader(engine, loader, STEPS - SAVE_AT)
        out.append((whole, first + rest, scale_at_save, engine.loss_scale))
        engine.destroy()
    return out


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    results = run_ranks(_resume_rank, 2, str(tmp_path), timeout=300)
    for rank_out in results:
        for case, (whole, resumed, scale_at_save, _) in zip(RESUME_CASES, rank_out):
            assert resumed == whole, f"{case}: {whole} != {resumed}"
    fp16 = results[0][-1]
    assert fp16[2] != 2.0**32, "the fp16 case never changed its loss scale: it tests nothing"


# -- files, errors, async ----------------------------------------------------------------------


def _files_rank(folder: str) -> dict:
    """One rank: sync vs async bytes, retention and latest, then every error case."""
    from terascale.checkpoint import CheckpointError

    x, y = make_data(STEPS, GLOBAL_BATCH)
    out: dict = {}
    # The same training saved by an engine configured for asynchronous saves.
    twin = _engine(1, 2, extra={"checkpoint": {"async": True}})
    _train(twin, x, y, range(2))
    twin.save_checkpoint(f"{folder}/async", tag="t")
    twin.wait_for_checkpoint()
    twin.destroy()
    engine = _engine(1, 2, extra={"checkpoint": {"keep_last_n": 2}})
    _train(engine, x, y, range(2))
    engine.save_checkpoint(f"{folder}/sync", tag="t")
    out["sync"] = (Path(folder) / "sync/t/rank00000-of-00001.safetensors").read_bytes()
    out["async"] = (Path(folder) / "async/t/rank00000-of-00001.safetensors").read_bytes()

    for s in range(2, 5):  # keep_last_n: 2 keeps the two newest
        _train(engine, x, y, range(s, s + 1))
        engine.save_checkpoint(f"{folder}/keep")
    out["kept"] = sorted(p.name for p in Path(f"{folder}/keep").iterdir() if p.name != ".lease")  # the job's lease stays
    out["latest"] = (Path(folder) / "keep/latest").read_text()
    engine.destroy()

    def error_of(fn) -> str:
        try:
            fn()
        except (CheckpointError, ValueError) as exc:
            return str(exc)
        raise AssertionError("no error raised")

    fresh = _engine(1, 2)
    out["no_tag"] = error_of(lambda: fresh.load_checkpoint(f"{folder}/keep", tag="global_step1"))
    out["nothing"] = fresh.load_checkpoint(f"{folder}/empty")
    shard = Path(folder) / "keep/global_step5/rank00000-of-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    out["truncated"] = error_of(lambda: fresh.load_checkpoint(f"{folder}/keep"))
    shard.write_bytes(data[:16] + b"\xff" * 64 + data[80:])  # same size, header clobbered
    out["corrupt"] = error_of(lambda: fresh.load_checkpoint(f"{folder}/keep"))
    shard.unlink()
    out["missing"] = error_of(lambda: fresh.load_checkpoint(f"{folder}/keep"))
    out["bad_tag"] = error_of(lambda: fresh.save_checkpoint(f"{folder}/keep", tag="../x"))
    fresh.destroy()

    import terascale

    other = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Linear(24, 3))
    engine, *_ = terascale.initialize(model=other, config=_config(1, 2))
    out["other_model"] = error_of(lambda: engine.load_checkpoint(f"{folder}/keep", tag="global_step4"))
    engine.destroy()
    return out


def test_checkpoint_files_retention_and_errors(tmp_path):
    (out,) = run_ranks(_files_rank, 1, str(tmp_path))
    assert out["sync"] == out["async"], "the asynchronous save wrote different bytes"
    assert out["kept"] == ["global_step4", "global_step5", "latest"], out["kept"]
    assert out["latest"] == "global_step5"
    assert "no checkpoint with tag 'global_step1'" in out["no_tag"] and "global_step4, global_step5" in out["no_tag"]
    assert out["nothing"] == (None, None)
    assert "rank00000-of-00001.safetensors" in out["truncated"] and "corrupt" in out["truncated"]
    assert "rank00000-of-00001.safetensors" in out["corrupt"] and "corrupt" in out["corrupt"]
    assert "rank00000-of-00001.safetensors' is missing" in out["missing"]
    assert "not usable as a folder name" in out["bad_tag"]
    msg = out["other_model"]
    assert "not of this model" in msg and "missing from the checkpoint: 0.bias, 0.weight" in msg
    assert "unexpected (not in the model):" in msg and "head.weight" in msg


# -- a save killed at any moment -----------------------------------------------------------------

# [Note: kill points] The saves are killed at points the process itself counts, not after
# a sleep: every file-system call a save makes (Python's audit events for open, rename,
# remove, mkdir, rmtree) and every data write (os.pwritev, which the I/O engine looks up at
# each call) is a point, and the script SIGKILLs itself at the N-th one. The same points
# happen whatever the machine's speed, so each kill lands where the test says.
def _killed_save(root: str, kill_at: int, counted: mp.Queue) -> None:  # type: ignore[valid-type]
    """(In a process of its own, which may be killed) train two steps and save three
    checkpoints, killing itself with SIGKILL at the ``kill_at``-th file-system call of the
    last two saves (0: never); put how many such calls there were."""
    import threading

    import terascale

    torch.set_num_threads(1)
    events = {"open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate"}
    lock = threading.Lock()
    points = {"armed": False, "count": 0}

    def point() -> None:
        with lock:
            if points["armed"]:
                points["count"] += 1
                if points["count"] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(lambda event, args: point() if event in events else None)
    real_pwritev = os.pwritev

    def pwritev(*args: object) -> int:
        point()
        return real_pwritev(*args)

    os.pwritev = pwritev  # this process only: it ends with the test's saves
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)

    def step() -> None:
        loss = engine(torch.randn(2, 256)).square().mean()
        engine.backward(loss)
        engine.step()

    step()
    engine.save_checkpoint(root, tag="first")
    step()
    points["armed"] = True
    engine.save_checkpoint(root, tag="second")
    engine.save_checkpoint(root, tag="first")  # replacing a tag: the old folder is swapped out
    points["armed"] = False
    counted.put(points["count"])


KILL_POINTS = 10


def _run_saves(root: Path, kill_at: int) -> tuple[int, object]:
    return run_forked(_killed_save, str(root), kill_at)


@pytest.fixture(scope="module")
def save_points(tmp_path_factory) -> int:
    """How many kill points the two saves pass (a run that is not killed counts them)."""
    code, count = _run_saves(tmp_path_factory.mktemp("count") / "ckpt", 0)
    assert code == 0 and isinstance(count, int), f"the saves failed (exit code {code}): see the test's stderr"
    assert count >= 2 * KILL_POINTS, f"only {count} points in two saves"
    return count


@pytest.mark.parametrize("which", range(KILL_POINTS))
def test_a_save_killed_at_any_moment_leaves_a_loadable_checkpoint(tmp_path, which, save_points):
    from terascale.checkpoint import CheckpointDirectory, consolidated_state_dict

    root = tmp_path / "ckpt"
    kill_at = 1 + which * save_points // KILL_POINTS  # spread over both saves, first to last
    code, _ = _run_saves(root, kill_at)
    assert code == -signal.SIGKILL, f"not killed at point {kill_at} of {save_points}: exit code {code}"
    folder = CheckpointDirectory(root).resolve(None)  # what `latest` names (or its swapped-out copy)
    state = consolidated_state_dict(folder)
    assert len(state) == 16 and all(torch.isfinite(t).all() for t in state.values())
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["engine"]["global_steps"] in (1, 2)


# -- consolidation ------------------------------------------------------------------------------


def _consolidate_rank(folder: str) -> dict:
    import terascale
    from torch import nn

    from terascale.zero import WrapPolicy

    world = int(os.environ["WORLD_SIZE"])
    out: dict = {}
    # The toy model with tied weights, at stage 3 (every parameter sharded).
    engine, *_ = terascale.initialize(
        model=make_model(tied=True), config=_config(world, 3), wrap_policy=WrapPolicy(module_classes=(nn.Linear,))
    )
    x, y = make_data(2, GLOBAL_BATCH)
    _train(engine, x, y, range(2))
    engine.save_checkpoint(f"{folder}/toy")
    out["toy"] = engine.full_state_dict()
    engine.destroy()

    # Hugging Face GPT-2 (tiny), stage 3, bf16: its output head is tied to the embedding.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    config = {**_config(world, 3), "bf16": {"enabled": True}}
    engine, *_ = terascale.initialize(model=hf, config=config)
    tokens = torch.randint(0, 96, (GLOBAL_BATCH, 16), generator=torch.Generator().manual_seed(0))
    micro = GLOBAL_BATCH // world
    rows = tokens[engine.dist.dp_rank * micro : (engine.dist.dp_rank + 1) * micro]
    loss = engine(input_ids=rows, labels=rows).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(f"{folder}/gpt2")
    engine.save_pretrained(f"{folder}/gpt2_pretrained")
    out["gpt2"] = engine.full_state_dict()
    engine.destroy()
    return out


def test_consolidation_gives_state_dicts_that_plain_models_and_from_pretrained_load(tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from terascale.checkpoint import consolidated_state_dict
    from terascale.launcher.cli import main

    results = run_ranks(_consolidate_rank, 2, str(tmp_path), timeout=300)
    want = results[0]

    # The toy model: in memory, and through the CLI into one file, into a fresh model.
    state = consolidated_state_dict(tmp_path / "toy")
    assert state["emb.weight"] is state["head.weight"], "tied names must share one tensor"
    fresh = make_model(seed=3, tied=True)
    fresh.load_state_dict(state)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, want["toy"][k], rtol=0, atol=0, msg=k)
    assert main(["consolidate", str(tmp_path / "toy"), str(tmp_path / "toy.safetensors")]) == 0
    fresh = make_model(seed=4, tied=True)
    fresh.load_state_dict(load_file(tmp_path / "toy.safetensors"))
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, want["toy"][k], rtol=0, atol=0, msg=k)

    # GPT-2: `terascale consolidate --hf` and engine.save_pretrained both load with from_pretrained.
    assert main(["consolidate", str(tmp_path / "gpt2"), str(tmp_path / "gpt2_hf"), "--hf"]) == 0
    for folder in ("gpt2_hf", "gpt2_pretrained"):
        model = GPT2LMHeadModel.from_pretrained(tmp_path / folder)
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
        for k, v in model.state_dict().items():
            if k in want["gpt2"]:
                # from_pretrained loads in the dtype its config names: the masters cast to it.
                torch.testing.assert_close(v, want["gpt2"][k].to(v.dtype), rtol=0, atol=0, msg=f"{folder}: {k}")
    assert main(["consolidate", str(tmp_path / "toy"), str(tmp_path / "x"), "--hf"]) == 2  # not a HF model


def _full_disk_save(root: str, said: mp.Queue) -> None:  # type: ignore[valid-type]
    """(In a process of its own) save a checkpoint, then another with files capped at 1 MiB
    (a full disk); put what the failed save said."""
    import resource

    import terascale
    from terascale.checkpoint import CheckpointError

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}  # fmt: skip
    engine, *_ = terascale.initialize(model=model, config=config)
    loss = engine(torch.randn(2, 256)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(root, tag="good")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))  # files up to 1 MiB: a full disk
    try:
        engine.save_checkpoint(root, tag="bad")
    except CheckpointError as exc:
        said.put(f"ERROR {exc}")
    else:
        said.put("no error")


def test_a_save_that_runs_out_of_space_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    from terascale.checkpoint import CheckpointDirectory, consolidated_state_dict

    root = tmp_path / "ckpt"
    code, said = run_forked(_full_disk_save, str(root))
    assert code == 0 and isinstance(said, str), f"exit code {code}: see the test's stderr"
    assert "ERROR saving checkpoint 'bad' failed" in said, said
    assert "rank00000-of-00001.safetensors" in said and "earlier checkpoints are untouched" in said
    directory = CheckpointDirectory(root)
    assert directory.latest() == "good" and directory.tags() == ["good"]
    assert not (root / ".bad.partial").exists()
    assert len(consolidated_state_dict(directory.resolve(None))) == 8
