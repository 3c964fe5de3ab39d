"""Recovery in the running processes against the restart path: a node lost, a node joining.

    python bench/live_elastic.py                 # 3 repeats, interleaved (about 6 minutes)
    python bench/live_elastic.py --repeats 1 --json out.json

Nodes are ``terascale run --nnodes 1:2 --nproc 1`` agents on this machine (each in a
session of its own, so that a kill takes the node's agent and rank at once), training
``tests/scripts/live_train.py`` on packed byte tokens with an ``elasticity`` section that
keeps the global batch at 8 on 1 or 2 ranks, ZeRO-2, interval checkpoints every 3 steps
(what the restart path resumes from). Per repeat, one of each, interleaved:

* ``kill``: two nodes train; after step 12 node 2 is SIGKILLed. Measured: from the kill
  to the first step logged at world 1, and the steps trained again; for ``--elastic live``
  (the default) and ``--elastic restart`` (torchrun's agents at terascale's rendezvous
  settings: every worker restarts and resumes from the last checkpoint). The model is the
  tests' small byte model (0.05M parameters), so the time is the recovery's, not compute.
* ``join``: one node trains the 20.1M-parameter GPT (examples/gpt, 4 layers of 640);
  a second node starts. Measured: how many steps the running node made between the
  joiner's registration and the first step at world 2, and the resize's pause (the
  running rank's time from leaving its epoch to holding its new state), beside the
  step time at world 1.

Every run's sample sequence and final parameters are checked against plain PyTorch on
the same global batches (the tests' oracle).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import live_jobs as lj  # noqa: E402

KILL_AFTER = 12
STEPS = 50


def _run_kill(tokens: Path, work: Path, mode: str, ref: Path) -> dict:
    out = work / f"kill-{mode}-{time.time_ns()}"
    out.mkdir()
    port = lj.free_port()
    args = ("--steps", str(STEPS), "--step-sleep", "0.1", "--save-dir", str(out / "ckpt"), "--save-every", "3")
    agent = ("--elastic", mode, "--elastic_expiry", "1")  # the default expiry, as users get it
    a = lj.Node(port, tokens, out, "a", script_args=args, agent_args=agent).listening(port)
    b = lj.Node(port, tokens, out, "b", script_args=args, agent_args=agent)
    try:
        lj.wait_for_step(out, KILL_AFTER, world=2, timeout=180)
        reached = max(lj.steps(out))
        killed = b.kill()
        first = lj.wait_for_step(out, 0, world=1, after=killed, timeout=180)
        resumed = min(s for s, rs in lj.steps(out).items() for d in rs if d["world"] == 1 and d["time"] > killed)
        assert a.wait(240) == 0, a.text()[-2000:]
    finally:
        for n in (a, b):
            if n.proc.poll() is None:
                n.kill()
    return {"mode": mode, "kill_to_step_s": round(first - killed, 2), "steps_redone": max(0, reached - resumed + 1),
            "samples_ok": lj.sample_mismatches(out, ref) == [], "rel_diff": lj.relative_difference(out, ref)}


def _run_join(tokens: Path, work: Path, ref: Path) -> dict:
    out = work / f"join-{time.time_ns()}"
    out.mkdir()
    port = lj.free_port()
    args = ("--steps", str(STEPS), "--model", "gpt")
    env_wait = ("--elastic", "live", "--elastic_expiry", "1")
    a = lj.Node(port, tokens, out, "a", script_args=args, agent_args=env_wait).listening(port)
    try:
        lj.wait_for_step(out, 5, world=1, timeout=300)
        b = lj.Node(port, tokens, out, "b", script_args=args, agent_args=env_wait)
        assert a.wait(600) == 0 and b.wait(60) == 0, a.text()[-2000:] + b.text()[-2000:]
    finally:
        for n in (a,):
            if n.proc.poll() is None:
                n.kill()
    starts = [json.loads(p.read_text()) for p in out.glob("start-*.json")]
    registered = max(s["registered"] for s in starts)
    records = sorted((d for rs in lj.steps(out).values() for d in rs), key=lambda d: d["time"])
    grown = min(d["time"] for d in records if d["world"] == 2)
    behind = sum(1 for d in records if d["world"] == 1 and registered < d["time"] < grown)
    times = [d["time"] for d in records if d["world"] == 1 and d["time"] < registered]
    step_s = statistics.median(b_ - a_ for a_, b_ in zip(times, times[1:])) if len(times) > 2 else None
    grow = next(r for r in lj.resizes(out) if r["kind"] == "grow")
    return {"steps_after_arrival": behind, "pause_s": round(grow["pause_s"], 2),
            "step_s_world1": round(step_s, 2) if step_s else None,
            "samples_ok": lj.sample_mismatches(out, ref) == [], "rel_diff": lj.relative_difference(out, ref)}


def _run_mirror(tokens: Path, work: Path, every: int) -> float:
    """Median step time of two nodes training the GPT with mirrors every ``every`` steps (0: none)."""
    out = work / f"mirror{every}-{time.time_ns()}"
    out.mkdir()
    port = lj.free_port()
    args = ("--steps", "16", "--model", "gpt", "--mirror-every", str(every))
    agent = ("--elastic_expiry", "1")
    a = lj.Node(port, tokens, out, "a", script_args=args, agent_args=agent).listening(port)
    b = lj.Node(port, tokens, out, "b", script_args=args, agent_args=agent)
    assert a.wait(600) == 0 and b.wait(60) == 0, a.text()[-2000:]
    times = sorted(d["time"] for s, rs in lj.steps(out).items() for d in rs[:1] if s > 3)
    return statistics.median(y - x for x, y in zip(times, times[1:]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--mirror-cost", action="store_true", help="only: the GPT's step time with and without mirrors")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ts-live-elastic-"))
    try:
        tokens = lj.make_tokens(work)
        ref_tiny, ref_gpt = work / "ref-tiny", work / "ref-gpt"
        lj.reference(tokens, ref_tiny, STEPS)
        lj.subprocess.run([sys.executable, str(lj.SCRIPT), "--reference", "--model", "gpt", "--data", str(tokens),
                           "--out", str(ref_gpt), "--steps", str(STEPS)], check=True, env=lj.env())  # fmt: skip
        runs: list[dict] = []
        if a.mirror_cost:
            for k in range(a.repeats):
                off, on = _run_mirror(tokens, work, 0), _run_mirror(tokens, work, 1)
                runs.append({"case": "mirror", "step_s_off": round(off, 3), "step_s_on": round(on, 3)})
                print(f"repeat {k}: GPT 20.1M, 2 nodes: step {off:.3f} s without mirrors, {on:.3f} s with", flush=True)
            ratio = statistics.median(r["step_s_on"] / r["step_s_off"] for r in runs)
            print(f"\n| mirror every step, GPT 20.1M, 2 nodes x 1 rank | step time ratio on/off: {ratio:.3f} |")
            if a.json:
                Path(a.json).write_text(json.dumps(runs, indent=1))
            return 0
        for k in range(a.repeats):
            for mode in ("live", "restart"):
                r = _run_kill(tokens, work, mode, ref_tiny)
                print(f"repeat {k}: kill, {mode}: {r}", flush=True)
                runs.append({"case": "kill", **r})
            r = _run_join(tokens, work, ref_gpt)
            print(f"repeat {k}: join (GPT 20.1M): {r}", flush=True)
            runs.append({"case": "join", **r})
        print("\n| case | kill -> first step at world 1, s (median, runs) | steps trained again |")
        print("|---|---|---|")
        for mode in ("live", "restart"):
            rs = [r for r in runs if r["case"] == "kill" and r["mode"] == mode]
            print(f"| node lost, --elastic {mode} | {statistics.median(r['kill_to_step_s'] for r in rs):.2f} "
                  f"({', '.join(str(r['kill_to_step_s']) for r in rs)}) | "
                  f"{', '.join(str(r['steps_redone']) for r in rs)} |")  # fmt: skip
        js = [r for r in runs if r["case"] == "join"]
        print("\n| node joins (GPT 20.1M) | steps between arrival and world 2 | resize pause, s | step at world 1, s |")
        print("|---|---|---|---|")
        print(f"| --elastic live | {', '.join(str(r['steps_after_arrival']) for r in js)} | "
              f"{', '.join(str(r['pause_s']) for r in js)} | {', '.join(str(r['step_s_world1']) for r in js)} |")
        ok = all(r["samples_ok"] for r in runs)
        worst = max(r["rel_diff"] for r in runs)
        print(f"\nsample sequence identical to plain PyTorch in every run: {ok}; largest relative parameter "
              f"difference: {worst:.2e}")
        if a.json:
            Path(a.json).write_text(json.dumps(runs, indent=1))
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
