"""Fault injection on real jobs: ``terascale run`` (torchrun) over tests/scripts/resilient_train.py.

Every fault fires at a named point of a named step on one rank (see the script), never
after a wall-clock sleep, so the outcomes are the same on fast and slow machines. The
oracle is an uninterrupted run of the same job (bit-identical where the world size is the
same) or the plain-PyTorch reference over the same global batches (within fp32 rounding).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from terascale.checkpoint.directory import CheckpointDirectory, verify

from distributed import free_port, run_script

SCRIPT = Path(__file__).parent / "scripts" / "resilient_train.py"
STEPS = 12


def config(tmp: Path, *, stage: int = 2, interval: int | None = 3, local: bool = False, **sections: dict) -> Path:
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
        "checkpoint": {"save_dir": str(tmp / "ckpt"), "auto_resume": True,
                       **({"interval_steps": interval} if interval else {}),
                       **({"local_dir": str(tmp / "local")} if local else {})},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    if "elasticity" in cfg:  # the elastic section decides the batch split for the world size
        del cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"]
    path = tmp / f"config{len(list(tmp.glob('config*.json')))}.json"
    path.write_text(json.dumps(cfg))
    return path


def launch(args: list[str], *, timeout: float = 240.0) -> tuple[int, str, float]:
    """Run ``terascale ARGS``; (exit code, output, seconds). Killed whole on a timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    if torch.cuda.device_count() < 2:  # two ranks cannot share one GPU (NCCL): train on the CPU
        env["TERASCALE_DEVICE"] = "cpu"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "terascale", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"terascale {' '.join(args)} did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, time.monotonic() - started


def train(tmp: Path, cfg: Path, out: str, *extra: str, restarts: int = 0, timeout: float = 240.0,
          total: int = STEPS) -> tuple[int, str, Path]:
    folder = tmp / out
    folder.mkdir(exist_ok=True)
    rc, text, _ = launch(["run", "--nproc", "2", "--max-restarts", str(restarts), str(SCRIPT), "--config", str(cfg),
                          "--out", str(folder), "--steps", str(total), *extra], timeout=timeout)
    return rc, text, folder


def steps(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]


def final(folder: Path) -> dict:
    return torch.load(folder / "final.pt")


def reference(tmp: Path, *extra: str) -> dict:
    folder = tmp / "reference"
    folder.mkdir(exist_ok=True)
    run_script(SCRIPT, "--reference", "--out", str(folder), "--steps", str(STEPS), *extra)
    return torch.load(folder / "reference.pt")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, exact: bool) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    rc, out, folder = train(tmp, config(tmp, local=True), "run")
    assert rc == 0, out[-3000:]
    # Every interval save was written to local_dir and copied to save_dir, both complete.
    for root in (tmp / "local", tmp / "ckpt"):
        directory = CheckpointDirectory(root)
        assert directory.tags() == [f"global_step{s}" for s in (3, 6, 9, 12)] and directory.latest() == "global_step12"
        assert all(verify(root / tag) is None for tag in directory.tags())
    return {**final(folder), "ckpt": tmp / "ckpt", "steps": steps(folder)}


def test_uninterrupted_run_matches_plain_pytorch(uninterrupted: dict, tmp_path: Path) -> None:
    ref = reference(tmp_path)
    assert_same(uninterrupted["state"], ref["state"], exact=False)
    assert uninterrupted["optimizer_steps"] == STEPS


# Seeds 0 and 1 (a shared and a node-local save directory) run by default; the rest of
# the fault points are in `make test-all`.
@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if s < 2 else pytest.mark.slow) for s in range(5)])
def test_kill_a_rank_restart_and_finish_bit_identical(seed: int, uninterrupted: dict, tmp_path: Path) -> None:
    rng = random.Random(seed)
    step, rank, point = rng.randint(2, STEPS - 1), rng.randint(0, 1), rng.choice(["forward", "backward", "step", "save"])
    # Odd seeds save through a node-local directory: the restart takes the newest complete copy.
    cfg = config(tmp_path, local=seed % 2 == 1)
    rc, out, folder = train(tmp_path, cfg, "run", "--fault", f"kill:{step}:{rank}:{point}", restarts=2)
    assert rc == 0, out[-3000:]
    log = steps(folder)
    assert any(r["restart"] == 1 for r in log), "the agent did not restart the workers"
    after = [r["step"] for r in log if r["restart"] == 1]
    # The restarted job went on from its last checkpoint: every later step once, in order.
    assert after == list(range(after[0], STEPS + 1)) and after[0] <= step
    result = final(folder)
    assert result["optimizer_steps"] == STEPS  # no update applied twice
    assert_same(result["state"], uninterrupted["state"], exact=True)


def test_lose_a_node_for_good_continue_on_one(uninterrupted: dict, tmp_path: Path) -> None:
    """Two agents (nodes) of an elastic job 1:2; at step 5 one node dies with its agent:
    the other restarts at world 1 from the last checkpoint and stays on the trajectory. The
    elasticity section keeps the global batch at 8: micro-batch 4 x 1 step on 2 ranks,
    4 x 2 steps on 1."""
    elastic = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 2}
    cfg, port = config(tmp_path, elasticity=elastic), free_port()
    (tmp_path / "run").mkdir()
    args = ["run", "--nnodes", "1:2", "--elastic", "restart", "--nproc", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
            # last_call_timeout: how long the first agent waits for the second to join the first
            # rendezvous (the second starts once the first listens: seconds on a busy machine).
            "--rdzv_conf", "last_call_timeout=4", "--max-restarts", "2", str(SCRIPT), "--config", str(cfg),
            "--out", str(tmp_path / "run"), "--steps", str(STEPS), "--fault", "leave:5:1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for _ in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "terascale", *args], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
            _wait_for_port(port, procs[0])  # the first agent hosts the rendezvous; the second joins it
        out, _ = procs[0].communicate(timeout=240)
        assert procs[0].returncode == 0, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    log = steps(tmp_path / "run")
    assert {r["world"] for r in log if r["restart"] == 0} == {2}
    later = [r for r in log if r["restart"] > 0]
    assert later and {r["world"] for r in later} == {1}
    assert [r["step"] for r in later] == list(range(later[0]["step"], STEPS + 1))
    # The same global batches on one rank (accumulation doubled): the same trajectory.
    theirs = {r["step"]: r["loss"] for r in uninterrupted["steps"]}
    for r in later:
        assert abs(r["loss"] - theirs[r["step"]]) <= 1e-5 * abs(theirs[r["step"]]), r
    result = final(tmp_path / "run")
    assert result["world"] == 1 and result["optimizer_steps"] == STEPS
    assert_same(result["state"], uninterrupted["state"], exact=False)


def _wait_for_port(port: int, proc: subprocess.Popen) -> None:
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    pytest.fail(f"the first agent never listened on port {port}")


def test_sigterm_saves_before_exit_and_the_job_resumes(uninterrupted: dict, tmp_path: Path) -> None:
    cfg = config(tmp_path, interval=None)  # no interval saves: the only checkpoint is SIGTERM's
    rc, out, _ = train(tmp_path, cfg, "run", "--fault", "sigterm:6:1")
    assert rc != 0, out[-3000:]
    assert "SIGTERM: saved checkpoint" in out, out[-3000:]
    directory = CheckpointDirectory(tmp_path / "ckpt")
    assert directory.latest() == "global_step6" and verify(directory.root / "global_step6") is None
    rc, out, folder = train(tmp_path, cfg, "run")
    assert rc == 0, out[-3000:]
    # The first job ended inside step 6 (saved, then exited before logging it); the second
    # resumed after it.
    assert [r["step"] for r in steps(folder)] == [*range(1, 6), *range(7, STEPS + 1)]
    assert_same(final(folder)["state"], uninterrupted["state"], exact=True)


def test_sigterm_with_a_lost_peer_exits_without_waiting_for_the_deadline(tmp_path: Path) -> None:
    # Rank 1 signals rank 0 and then never reaches the next collective, as a dead peer
    # would not: rank 0, blocked in that collective, gives up after deadline / 5 = 0.6 s
    # instead of holding the restart back until the deadline.
    cfg = config(tmp_path, checkpoint={"signal_deadline_s": 3})
    rc, out, _ = train(tmp_path, cfg, "run", "--fault", "termpeer:4:1", timeout=120)
    assert rc != 0
    assert "SIGTERM, then blocked for 0.6 s in" in out and "a peer is probably gone" in out, out[-4000:]
    # Rank 1, signalled by torchrun while it waits outside any collective, is ended by the deadline.
    assert "no checkpoint finished within 3 s" in out, out[-4000:]
    assert CheckpointDirectory(tmp_path / "ckpt").latest() == "global_step3"


def test_disk_full_during_a_save_names_the_file_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    rc, out, _ = train(tmp_path, config(tmp_path), "run", "--fault", "enospc:5:1")
    assert rc != 0
    assert "no space left on the device" in out and ".global_step6.partial/rank00001-of-00002.safetensors" in out, out[-3000:]
    directory = CheckpointDirectory(tmp_path / "ckpt")
    assert directory.latest() == "global_step3" and verify(directory.root / "global_step3") is None
    assert not (directory.root / "global_step6").exists()


def test_a_disk_full_for_one_save_costs_that_save_and_no_work(uninterrupted: dict, tmp_path: Path) -> None:
    """The interval save at step 6 fails (rank 1's write: no space); training goes on with a
    warning, the save at step 9 succeeds, and nothing is trained twice."""
    rc, out, folder = train(tmp_path, config(tmp_path), "run", "--fault", "enospc_once:5:1")
    assert rc == 0, out[-3000:]
    assert "training goes on and saves again now (1 of 2 failures in a row allowed)" in out, out[-3000:]
    assert ".global_step6.partial/rank00001-of-00002.safetensors" in out, out[-3000:]
    directory = CheckpointDirectory(tmp_path / "ckpt")
    assert directory.tags() == ["global_step3", "global_step9", "global_step12"]
    assert [r["step"] for r in steps(folder)] == list(range(1, STEPS + 1))
    assert_same(final(folder)["state"], uninterrupted["state"], exact=True)


def test_disk_full_during_nvme_swap_names_the_swap_file(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = config(tmp_path, zero_optimization={"offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}})
    rc, out, _ = train(tmp_path, cfg, "run", "--fault", "enospc:5:1")
    assert rc != 0
    assert "no space left on the device" in out and str(swap) in out, out[-3000:]
    directory = CheckpointDirectory(tmp_path / "ckpt")
    assert directory.latest() == "global_step3" and verify(directory.root / "global_step3") is None


def test_corrupted_newest_checkpoint_falls_back_to_the_previous(uninterrupted: dict, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(uninterrupted["ckpt"], tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "global_step12" / "rank00001-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    rc, out, folder = train(tmp_path, config(tmp_path), "run", total=STEPS + 2)
    assert rc == 0, out[-3000:]
    assert "not resuming from an incomplete checkpoint" in out and str(shard) in out, out[-3000:]
    assert [r["step"] for r in steps(folder)] == list(range(10, STEPS + 3))  # resumed from step 9


def test_hung_rank_watchdog_names_it(tmp_path: Path) -> None:
    # A short signal deadline: the hung rank, sent SIGTERM by torchrun, then ends soon.
    cfg = config(tmp_path, health={"watchdog": {"timeout_s": 3}}, checkpoint={"signal_deadline_s": 2})
    rc, out, _ = train(tmp_path, cfg, "run", "--fault", "hang:4:1", timeout=180)
    assert rc != 0
    assert "terascale watchdog: rank 0 made no progress" in out, out[-4000:]
    # Rank 1 blocks outside any collective (the script's injected wait), and is named so.
    assert "Rank 1 is" in out and "not in a collective" in out and "resilient_train.py" in out, out[-4000:]


def test_nan_gradient_skip(tmp_path: Path) -> None:
    # Also the time interval: 1 ms has passed at every step, so every step saves.
    cfg = config(tmp_path, interval=None, checkpoint={"interval_seconds": 0.001, "keep_last_n": 20},
                 health={"non_finite": {"policy": "skip"}})
    rc, out, folder = train(tmp_path, cfg, "run", "--fault", "nan:5:1")
    assert rc == 0, out[-3000:]
    assert "non-finite values at step 5: the global gradient norm is nan: step skipped" in out, out[-3000:]
    assert [r["skipped"] for r in steps(folder)] == [0] * 4 + [1] * (STEPS - 4)
    assert_same(final(folder)["state"], reference(tmp_path, "--skip", "5")["state"], exact=False)
    assert CheckpointDirectory(tmp_path / "ckpt").tags() == [f"global_step{s}" for s in range(1, STEPS + 1)]


def test_nan_loss_stop(tmp_path: Path) -> None:
    cfg = config(tmp_path, health={"non_finite": {"policy": "stop"}})
    rc, out, folder = train(tmp_path, cfg, "run", "--fault", "nanloss:5:0")
    assert rc != 0
    assert "NonFiniteError: non-finite values at step 5" in out and "the loss is not finite on rank 0" in out, out[-3000:]
    assert steps(folder)[-1]["step"] == 4


def test_nan_gradient_rollback(tmp_path: Path) -> None:
    cfg = config(tmp_path, health={"non_finite": {"policy": "rollback"}})
    rc, out, folder = train(tmp_path, cfg, "run", "--fault", "nan:5:1")
    assert rc == 0, out[-3000:]
    assert "rolling back" in out and "rolled back from step 5" in out, out[-3000:]
    result = final(folder)
    assert result["optimizer_steps"] == STEPS
    assert_same(result["state"], reference(tmp_path, "--rollback", "5:3")["state"], exact=False)


@pytest.mark.alone  # bounds a wall-clock time (see conftest.py)
def test_straggler_is_named_at_zero3(tmp_path: Path) -> None:
    """Rank 1 computes 0.2 s longer per micro-step. At ZeRO-3 rank 0 waits for it inside the
    parameter gathers, so wall times are equal; compute time (less the waits) tells them apart."""
    cfg = config(tmp_path, stage=3, interval=None, health={"straggler": {"enabled": True, "every_n_steps": 2}})
    rc, out, _ = train(tmp_path, cfg, "run", "--fault", "slow:0:1", total=4)
    assert rc == 0, out[-3000:]
    assert "straggler at step 2: rank 1 computed for" in out and "straggler at step 4: rank 1" in out, out[-3000:]
    assert "rank 0 computed" not in out


@pytest.mark.parametrize(
    "section, message",
    [
        ({"checkpoint": {"interval_steps": 5}}, "checkpoint.interval_steps needs checkpoint.save_dir"),
        ({"checkpoint": {"save_dir": "a", "local_dir": "a"}}, "local_dir is the same directory as checkpoint.save_dir"),
        ({"health": {"non_finite": {"policy": "skp"}}}, "expected one of 'none', 'skip', 'stop' or 'rollback'"),
        ({"health": {"watchdg": {}}}, "did you mean 'watchdog'"),
        ({"health": {"straggler": {"threshold": 1.0}}}, "health.straggler.threshold"),
    ],
)
def test_config_errors_name_the_key(section: dict, message: str) -> None:
    from terascale.config import Config, ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Config.load({"train_batch_size": 8, **section})


def test_rollback_needs_a_save_dir() -> None:
    from distributed import run_ranks

    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "health": {"non_finite": {"policy": "rollback"}}}
    [message] = run_ranks(_engine_error, 1, cfg)
    assert "health.non_finite.policy 'rollback'" in message and "checkpoint.save_dir" in message


def _engine_error(cfg: dict) -> str:
    import terascale

    try:
        terascale.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    except ValueError as exc:
        return str(exc)
    return "no error"
