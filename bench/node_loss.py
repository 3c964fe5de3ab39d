"""Recovery after a whole node is lost: terascale's rendezvous settings against torch's.

    python bench/node_loss.py                # 3 repeats of each setting, interleaved (about 6 minutes)
    python bench/node_loss.py --repeats 1 --json out.json

Two ``terascale run`` agents on this machine play two nodes of an elastic job (``--nnodes
1:2 --nproc 1``, c10d rendezvous on 127.0.0.1) training tests/scripts/resilient_train.py
(an MLP, ZeRO-2, an ``elasticity`` section that keeps the global batch at 8 on 1 or 2
ranks, interval saves every 3 steps, ``auto_resume``). Before the forward of step 5 the
second node's rank kills its torchrun agent and itself (``--fault leave:5:1``), as a
machine that loses power. The survivor's worker fails at once; its agent must notice that
the other node is gone, form a new round alone and restart the worker, which resumes from
the last checkpoint at world 1.

Measured per run: from the kill (the dying rank writes the time first) to the end of the
first optimizer step after the restart (the steps log's wall time; both processes run on
this machine, so the clocks agree), and the steps trained again. Settings:

* ``terascale``: ``terascale run``'s defaults ([Note: rendezvous settings]: keep-alive every
  1 s, dead after 5, last call 2 s);
* ``torch``: torch's own defaults, passed explicitly (keep-alive every 5 s, dead after 3,
  last call 30 s), which is what torchrun does without a ``--rdzv_conf``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "resilient_train.py"
SETTINGS = {"terascale": None, "torch": "keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=30"}
STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the first agent ended before it listened")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listened on port {port}")


def _config(tmp: Path) -> Path:
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
        "elasticity": {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2, 4], "min_gpus": 1,
                       "max_gpus": 2},
        "checkpoint": {"save_dir": str(tmp / "ckpt"), "auto_resume": True, "interval_steps": 3},
    }  # fmt: skip
    path = tmp / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def run_once(setting: str, timeout: float = 300.0) -> dict:
    """One job with ``setting``'s rendezvous settings and a node lost at step 5."""
    with tempfile.TemporaryDirectory(prefix="ts-node-loss-") as tmp_name:
        tmp = Path(tmp_name)
        out = tmp / "run"
        out.mkdir()
        port = _free_port()
        args = [sys.executable, "-m", "terascale", "run", "--nnodes", "1:2", "--elastic", "restart", "--nproc", "1", "--master_addr",
                "127.0.0.1", "--master_port", str(port), "--max-restarts", "2"]  # fmt: skip
        if SETTINGS[setting] is not None:
            args += ["--rdzv_conf", SETTINGS[setting]]
        args += [str(SCRIPT), "--config", str(_config(tmp)), "--out", str(out), "--steps", str(STEPS),
                 "--fault", "leave:5:1"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TERASCALE_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
        procs: list[subprocess.Popen] = []
        try:
            for _ in range(2):
                procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True, start_new_session=True))  # fmt: skip
                _wait_for_port(port, procs[0])
            text, _ = procs[0].communicate(timeout=timeout)
            if procs[0].returncode != 0:
                raise RuntimeError(f"{setting}: the surviving node failed:\n{text[-3000:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
        killed_at = float((out / "left_at").read_text())
        rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
        first_after = next(r for r in rows if r["restart"] > 0)
        last_before = max(r["step"] for r in rows if r["restart"] == 0)
        return {
            "setting": setting,
            "recovery_s": first_after["time"] - killed_at,
            "steps_redone": last_before - first_after["step"] + 1,
            "world_after": first_after["world"],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settings", default="terascale,torch")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    settings = args.settings.split(",")
    results = []
    for repeat in range(args.repeats):
        for setting in settings if repeat % 2 == 0 else reversed(settings):  # interleaved, order alternating
            result = run_once(setting)
            results.append(result)
            print(f"  {setting:10s} recovery {result['recovery_s']:.1f} s, {result['steps_redone']} steps redone, "
                  f"world {result['world_after']} after", flush=True)  # fmt: skip
    print("\n| rendezvous settings | runs | recovery, median (min–max) | steps redone |")
    print("| --- | --- | --- | --- |")
    for setting in settings:
        times = [r["recovery_s"] for r in results if r["setting"] == setting]
        redone = sorted({r["steps_redone"] for r in results if r["setting"] == setting})
        print(f"| {setting} | {len(times)} | {statistics.median(times):.1f} s ({min(times):.1f}–{max(times):.1f}) | "
              f"{', '.join(map(str, redone))} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
