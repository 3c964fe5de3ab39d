"""Live elastic jobs on this machine, for the tests and the recovery benchmark.

Each "node" is one ``terascale run --nnodes 1:MAX --nproc 1`` agent started in a session
of its own, so that killing the session kills the node (agent and rank) at once, as a
machine that loses power. The ranks run ``tests/scripts/live_train.py``; its per-step
logs say which process trained which step at which world size and on which samples.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "live_train.py"
WORDS = "the quick brown fox jumps over a lazy dog while sharded states move between peers".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tokens(folder: Path, documents: int = 8, words: int = 400) -> Path:
    """A small token dataset (bytes of generated text) in ``folder/tokens``."""
    import random

    from terascale.data import prepare

    rng = random.Random(0)
    text = folder / "text"
    text.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        (text / f"d{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
    prepare([text], folder / "tokens", progress=False, workers=1)
    return folder / "tokens"


def env() -> dict[str, str]:
    # The first epoch waits up to 5 s for every node (they start a second or two apart here).
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "TERASCALE_ELASTIC_LAST_CALL": "5"}


class Node:
    """One agent (a node of the job) and its log."""

    def __init__(self, port: int, data: Path, out: Path, name: str, *, max_nodes: int = 2,
                 script_args: tuple[str, ...] = (), agent_args: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.log_path = out.parent / f"{out.name}.{name}.log"
        self.log = open(self.log_path, "w")
        command = [sys.executable, "-m", "terascale", "run", f"--nnodes=1:{max_nodes}", "--nproc=1",
                   "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=3", "--no_local_rank",
                   # A member counts as gone after 2 s without a heartbeat (the default 1 s is what the
                   # benchmark measures; on a machine busy with other tests 2 s keeps false drops away).
                   *(() if "--elastic_expiry" in agent_args else ("--elastic_expiry", "2")),
                   *agent_args, str(SCRIPT), "--data", str(data), "--out", str(out), *script_args]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env(),
                                     start_new_session=True)  # fmt: skip

    def listening(self, port: int, timeout: float = 60.0) -> Node:
        """Wait until this node's agent hosts the job's store at ``port`` (start it first:
        the node hosting the store must outlive the job, as a real cluster's head node)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"the agent ended before it listened:\n{self.text()[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"nothing listened on port {port}")

    def kill(self) -> float:
        """SIGKILL the whole node; returns the time of the kill."""
        import psutil

        # The whole tree: torchrun (--elastic restart) starts its workers in sessions of their own.
        tree = [psutil.Process(self.proc.pid)]
        tree += tree[0].children(recursive=True)
        t = time.time()
        for p in tree:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        return t

    def signal_ranks(self, sig: int) -> None:
        """Send ``sig`` to the node's rank processes (not its agent)."""
        ranks = r"^\S+ -u \S*live_train\.py"  # the rank processes, not the agent (whose arguments name the script)
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid), "-f", ranks], capture_output=True, text=True)
        for pid in out.stdout.split():
            if int(pid) != self.proc.pid:
                try:
                    os.kill(int(pid), sig)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")


def steps(out: Path) -> dict[int, list[dict]]:
    """Every rank's record of every completed step, by step."""
    by_step: dict[int, list[dict]] = collections.defaultdict(list)
    for f in glob.glob(str(out / "steps-*.jsonl")):
        for line in open(f):
            if line.strip():
                d = json.loads(line)
                by_step[d["step"]].append(d)
    return by_step


def wait_for_step(out: Path, step: int, timeout: float = 120.0, world: int | None = None,
                  after: float = 0.0) -> float:
    """Wait until some rank logged ``step`` or a later one (at ``world`` if given, after the
    time ``after``); returns the wall time of the first such record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [d["time"] for s, records in steps(out).items() for d in records
                 if s >= step and (world is None or d["world"] == world) and d["time"] > after]  # fmt: skip
        if found:
            return min(found)
        time.sleep(0.05)
    raise TimeoutError(f"no rank logged step {step} within {timeout:.0f} s")


def stop_at(out: Path, step: int) -> None:
    """Make the job of ``out`` (run with ``--stop-file OUT/stop``) end after ``step``."""
    (out / "stop.tmp").write_text(str(step))
    os.replace(out / "stop.tmp", out / "stop")


def wait_for_pid_step(out: Path, world: int, after: float, exclude: set[int], timeout: float = 150.0) -> None:
    """Wait until a process not in ``exclude`` logs a step at ``world`` after the time ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(d["world"] == world and d["time"] > after and d["pid"] not in exclude
               for records in steps(out).values() for d in records):  # fmt: skip
            return
        time.sleep(0.1)
    raise TimeoutError(f"no new process stepped at world {world} within {timeout:.0f} s")


def reference(data: Path, out: Path, steps_: int, batch: int = 8) -> None:
    """Plain PyTorch on the job's global batches (``batch`` samples a step), in one process."""
    subprocess.run([sys.executable, str(SCRIPT), "--reference", "--data", str(data), "--out", str(out),
                    "--steps", str(steps_), "--batch", str(batch)], check=True, env=env(), capture_output=True)  # fmt: skip


def sample_mismatches(out: Path, ref: Path) -> list[int]:
    """The steps whose global batch (the samples of every rank) differs from the reference's."""
    got = steps(out)
    refs = [json.loads(line) for line in open(ref / "reference.jsonl")]
    bad = []
    for r in refs:
        trained = sorted(got.get(r["step"], []), key=lambda d: d["time"])
        # A step trained again in a later membership epoch (the survivors went back to an
        # older snapshot): that epoch's records stand, not a fenced process's late record of
        # its own try. After a return to a checkpoint (the restart path): the last world's.
        if trained:
            newest = max(d.get("membership", 0) for d in trained)
            trained = [d for d in trained if d.get("membership", 0) == newest]
            trained = trained[-trained[-1]["world"] :]
        if sorted(h for d in trained for h in d["samples"]) != sorted(r["samples"]):
            bad.append(r["step"])
    return bad


def relative_difference(out: Path, ref: Path) -> float:
    a, b = torch.load(out / "final.pt"), torch.load(ref / "final.pt")
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


def resizes(out: Path) -> list[dict]:
    return [r for f in glob.glob(str(out / "resizes-*.json")) for r in json.loads(Path(f).read_text())]
