"""Fault soak: an elastic two-node job trains while a driver injects faults at random
times; at the end its parameters must match an undisturbed run of the same batches and
its checkpoint directory must be whole (issue 30, part 6).

    python bench/fault_soak.py --minutes 20     # 20 minutes of faults: about 40 minutes in all
    python bench/fault_soak.py --quick          # each fault kind once: about 3 minutes
    python bench/fault_soak.py --quick --faults kill_rank,kill_node --seed 3 --json soak.json
    python bench/fault_soak.py --minutes 5 --faults ''    # no faults: the same job left alone

Needs root (a network namespace, a loop mount, nftables). What runs, all inside a sandbox
this script creates and removes at exit (also on Ctrl-C, SIGTERM, errors and its own
deadline; a later run also sweeps what a SIGKILLed one left):

* a network namespace of its own (``ip netns``), loopback only: the "nodes" talk over
  127.0.0.1 inside it, so packet loss injected there touches nothing else and no traffic
  leaves it;
* a small loop-mounted ext4 filesystem (``--disk-mib``) holding ``checkpoint.save_dir``,
  so that a full disk can be injected without filling the machine's disk;
* two ``terascale run --nnodes 1:2 --nproc N`` agents (two "nodes", N ranks each) at the
  default rendezvous settings (no ``--rdzv_conf``: the defaults are what is measured),
  ``--max-restarts`` large. The first agent hosts the c10d rendezvous; the second starts
  once its port listens. Each rank is this file (``fault_soak.py worker``): an MLP fitted
  to a fixed teacher at ZeRO stage 2 with AdamW, ``OMP_NUM_THREADS=1``, each optimizer
  step's global batch derived from the step number (so the data position cannot drift),
  the ``elasticity`` section keeping the global batch fixed at any world size, and
  ``checkpoint.save_dir`` + ``auto_resume`` + ``interval_steps`` + ``keep_last_n``. The
  defaults make a step about 0.3 s at world 2 on 2 quiet cores and a checkpoint 7 MB.

Faults (``--faults``, default all; each comes a random gap after the job steps again at
its full world, so that each recovery is measured on its own):

* ``kill_rank``: SIGKILL of one rank process;
* ``kill_node``: SIGKILL of node 1's agent and all its processes, then (a random while
  after the survivor steps again) ``rejoin``: node 1's agent starts again, the world grows
  back. Node 0 is never killed: it hosts the c10d rendezvous store, without which no agent
  can continue (the same single point of failure as on a real cluster);
* ``straggler``: SIGSTOP of one rank, SIGCONT a few seconds later;
* ``packet_loss``: an nftables rule in the namespace drops a random share (5-40%) of
  loopback packets for a few seconds;
* ``disk_full``: a filler file takes every free block of the checkpoint filesystem for
  long enough that interval saves fail, then goes;
* ``corrupt``: with every rank stopped (SIGSTOP, so that no newer save lands), 64 bytes in
  the tensor data of a shard file of the newest committed ``global_step*`` checkpoint are
  flipped (``--corrupt header``: in its safetensors header); then one rank is SIGKILLed and
  the others continued: the resume must pass over that checkpoint.

The job ends ``--tail`` steps after the fault phase (``--minutes``; ``--quick``: once every
kind fired): the driver writes the final step into a file that rank 0 reads and broadcasts
each step. Then the undisturbed reference trains the same steps the same way (two agents,
full world, no faults, no checkpoints): as long as the soak's useful work, so a full run
takes about twice ``--minutes``.

Checks: the job finished; its final parameters are bit-identical to the reference's when
every formation that trained had the reference's world size, else within ``--rtol``
relative (a world-size change reorders float sums); every committed checkpoint left in
``save_dir`` passes terascale's ``verify`` with checksums and still has the bytes it had
when committed (a watcher hashes each one as it appears), ``latest`` names the job's last
interval save; the corrupted checkpoint was flagged by ``verify`` and no formation resumed
from it; no two formations (rendezvous rounds, named after their rank 0) stepped at the
same time (split brain) or saved the same step while both alive (double writer); the
newest committed checkpoint never vanished (lost); every fault recovered.

Per fault: restarts, the step each new formation resumed at, time lost (from the fault to
the job's first optimizer step after recovery: the first step of the last formation that
started before the next fault, or, when nothing restarted, the first step after the fault
ended), steps redone (the highest step reached before a restart minus the step it resumed
at), steps made while the fault lasted, the longest pause between steps. Prints markdown
tables and writes JSON (``--json``). A global deadline (``--deadline-min``) kills
everything and reports a failure rather than hang. The work directory (logs, step
records) is printed; it is kept on failure or with ``--keep-logs``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("kill_rank", "kill_node", "straggler", "packet_loss", "disk_full", "corrupt")
NO_STOP = 1 << 40  # "no final step yet" in the stop file's absence
NS_PREFIX, WORK_PREFIX = "tsoak-", "fault_soak-"  # + the driver's pid: how sweep_stale knows its own


# -- the worker: one rank of the job, run by terascale run -----------------------------------


def worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="fault_soak.py worker")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=0, help="0: until the step in OUT/stop_at")
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="global batch (samples per optimizer step)")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn

    import terascale

    out = Path(a.out)
    live = bool(os.environ.get("TERASCALE_ELASTIC_STORE"))  # started by the live elastic agent
    rank = int(os.environ.get("RANK", "-1"))  # a live rank learns its rank from its first epoch
    pid, node = os.getpid(), os.environ.get("GROUP_RANK", os.environ.get("TERASCALE_ELASTIC_NODE"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = open(out / "events.jsonl", "a", buffering=1)  # every rank: start, errors, end

    def event(**fields: object) -> None:
        events.write(json.dumps({"t": time.time(), "rank": rank, "pid": pid, "node": node, "restart": restart,
                                 **fields}) + "\n")

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(a.dim, a.hidden), nn.Tanh()]
    for _ in range(a.layers - 1):
        layers += [nn.Linear(a.hidden, a.hidden), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(a.hidden, a.dim))
    # The target: a fixed smooth function plus noise, so the gradients never vanish and two
    # trajectories that differ by rounding stay close (the loss landscape is contracting).
    teacher = torch.randn(a.dim, a.dim, generator=torch.Generator().manual_seed(12345)) / a.dim**0.5

    def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * step)
        x = torch.randn(a.batch, a.dim, generator=g)
        return x, torch.sin(x @ teacher) + 0.05 * torch.randn(a.batch, a.dim, generator=g)

    try:
        engine, _, _, _ = terascale.initialize(model=model, config=a.config)
        mse = nn.MSELoss()
        interval = json.loads(Path(a.config).read_text()).get("checkpoint", {}).get("interval_steps")
        shape = None
        steps = None
        while True:
            # A formation (one rendezvous round's set of ranks; under the live agent, one
            # membership epoch) is named after its rank 0: only rank 0 writes the step log,
            # and two formations alive at once have two rank 0s. A live resize changes the
            # rank, the world and the batch split in this process: read them every step.
            epoch = engine.dist.elastic.epoch.number if live else 0
            if shape != epoch:
                shape, rank, world = epoch, engine.dist.rank, engine.dist.dp_world_size
                micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
                formation = f"{pid}.{epoch}.{uuid.uuid4().hex[:4]}"  # pids get reused on a long run
                event(e="start", world=world, resumed=engine.global_steps, load_s=engine.resumed_in_s)
                steps = open(out / "steps.jsonl", "a", buffering=1) if rank == 0 else None
                if steps is not None:
                    steps.write(json.dumps({"e": "start", "f": formation, "t": time.time(), "world": world,
                                            "resumed": engine.global_steps, "micro": micro, "acc": accumulation,
                                            "node": node, "restart": restart}) + "\n")
            last = a.steps
            if not last and live:  # the driver writes the final step once, ahead: every rank reads it
                last = _read_stop(out)
            elif not last:  # rank 0 reads the final step; every rank must agree on it
                mine = torch.tensor([_read_stop(out) if rank == 0 else 0], dtype=torch.int64)
                dist.broadcast(mine, 0)
                last = int(mine)
            if engine.global_steps >= last:
                break
            before = engine.global_steps
            x, y = global_batch(engine.global_steps + 1)
            total = 0.0
            for k in range(accumulation):  # micro-batch k of this rank: a fixed slice of the global batch
                rows = slice((k * world + rank) * micro, (k * world + rank + 1) * micro)
                loss = mse(engine(x[rows]), y[rows])
                engine.backward(loss)
                engine.step()
                total += float(loss.detach()) / accumulation
            if engine.global_steps != before + 1:
                continue  # a fault: this window was not applied (the state went back to a complete step)
            if steps is not None:
                record = {"e": "step", "f": formation, "t": time.time(), "step": engine.global_steps, "world": world,
                          "loss": total}
                steps.write(json.dumps(record) + "\n")
                if interval and engine.global_steps % interval == 0:  # the engine starts a save now
                    steps.write(json.dumps({"e": "save", "f": formation, "t": time.time(),
                                            "step": engine.global_steps}) + "\n")
        engine.wait_for_checkpoint()
        state = engine.full_state_dict()
        if rank == 0:
            tmp = out / f".final.{pid}.pt"
            torch.save({"state": state, "world": world, "steps": engine.global_steps, "f": formation}, tmp)
            os.replace(tmp, out / "final.pt")
            steps.write(json.dumps({"e": "end", "f": formation, "t": time.time(), "step": engine.global_steps}) + "\n")
        event(e="end", step=engine.global_steps)
        engine.destroy()
    except BaseException as exc:
        # The survivors of a lost peer fail in a collective: when, and how, is part of the story.
        event(e="error", error=f"{type(exc).__name__}: {exc}"[:400])
        raise


def _read_stop(out: Path) -> int:
    try:
        return int((out / "stop_at").read_text())
    except (FileNotFoundError, ValueError):
        return NO_STOP


# -- the sandbox: a network namespace and a small filesystem ---------------------------------


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def sweep_stale() -> None:
    """Remove what an earlier driver that was SIGKILLed left behind: namespaces and mounts
    named after a driver pid that no longer runs (only names this script gives)."""
    def dead(name: str, prefix: str) -> bool:
        pid = name.removeprefix(prefix).split("-")[0]
        return pid.isdigit() and not Path(f"/proc/{pid}").exists()

    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(NS_PREFIX) and dead(ns, NS_PREFIX):
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", ns, check=False)
    for line in Path("/proc/mounts").read_text().splitlines():
        target = Path(line.split()[1])
        work = target.parent.name
        if target.name == "disk" and work.startswith(WORK_PREFIX) and dead(work, WORK_PREFIX):
            sh("umount", "-l", str(target), check=False)
            (target.parent / "disk.img").unlink(missing_ok=True)


class Sandbox:
    """A fresh network namespace (loopback up) and a loop-mounted ext4 filesystem of
    ``disk_mib`` MiB under ``work``; both go at :meth:`close`, with every process still
    running in the namespace."""

    def __init__(self, work: Path, disk_mib: int) -> None:
        self.work, self.disk_mib = work, disk_mib
        self.ns = f"{NS_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.image, self.mount = work / "disk.img", work / "disk"
        self.filler = self.mount / "filler"
        self._made_ns = self._mounted = False

    def open(self) -> Sandbox:
        sh("ip", "netns", "add", self.ns)
        self._made_ns = True
        sh("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        with open(self.image, "wb") as f:
            f.truncate(self.disk_mib << 20)
        # -m 0: no blocks reserved for root (the ranks run as root and would use them).
        sh("mkfs.ext4", "-q", "-F", "-m", "0", str(self.image))
        self.mount.mkdir()
        sh("mount", "-o", "loop", str(self.image), str(self.mount))
        self._mounted = True
        return self

    def cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def pids(self) -> list[int]:
        if not self._made_ns:
            return []
        return [int(x) for x in sh("ip", "netns", "pids", self.ns, check=False).stdout.split() if x.isdigit()]

    def kill_all(self) -> None:
        """SIGKILL every process in the namespace (agents, ranks, orphans of killed agents)."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.1)

    # packet loss: one nftables table in the namespace, dropping on loopback input
    def drop(self, percent: int) -> None:
        self.undrop()
        sh(*self.cmd("nft", "add", "table", "inet", "tsoak"))
        sh(*self.cmd("nft", "add", "chain", "inet", "tsoak", "input",
                     "{ type filter hook input priority 0 ; policy accept ; }"))
        sh(*self.cmd("nft", "add", "rule", "inet", "tsoak", "input", "iif", "lo",
                     "numgen", "random", "mod", "100", "<", str(percent), "drop"))

    def undrop(self) -> None:
        sh(*self.cmd("nft", "delete", "table", "inet", "tsoak"), check=False)

    # a full disk: one file taking every free block
    def fill(self) -> int:
        st = os.statvfs(self.mount)
        free = st.f_bavail * st.f_frsize
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # unbuffered: nothing left to flush at close
        try:
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, max(free - (1 << 20), 1 << 20))
            os.lseek(fd, 0, os.SEEK_END)
            for size in (1 << 16, 1 << 12, 1 << 9):  # then the last blocks, until the filesystem says no
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
            os.fsync(fd)
        finally:
            os.close(fd)
        return os.statvfs(self.mount).f_bavail * os.statvfs(self.mount).f_frsize

    def unfill(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def close(self) -> None:
        self.kill_all()
        if self._mounted:
            for _ in range(20):
                if sh("umount", str(self.mount), check=False).returncode == 0:
                    break
                time.sleep(0.25)
            else:  # something still holds it open: detach now, the kernel finishes later
                sh("umount", "-l", str(self.mount), check=False)
            self._mounted = False
        self.image.unlink(missing_ok=True)
        if self._made_ns:
            sh("ip", "netns", "del", self.ns, check=False)
            self._made_ns = False


# -- the job: two agents -------------------------------------------------------------------


class Deadline(Exception):
    """The global deadline passed."""


class Clock:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise Deadline("the global deadline passed")

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.check()
            time.sleep(min(0.2, max(end - time.monotonic(), 0)))


class Job:
    """Two ``terascale run`` agents in ``box``'s namespace, logs and step records in ``out``."""

    def __init__(self, box: Sandbox, out: Path, port: int, nproc: int, worker_args: list[str],
                 elastic: str = "live") -> None:  # fmt: skip
        self.elastic = elastic
        self.box, self.out, self.port, self.nproc = box, out, port, nproc
        self.rdzv_id = f"soak-{uuid.uuid4().hex[:8]}"
        self.worker_args = worker_args
        self.agents: dict[int, subprocess.Popen] = {}
        self.starts = 0
        self.log = StepLog(out / "steps.jsonl")
        out.mkdir(parents=True, exist_ok=True)

    def start_agent(self, node: int, clock: Clock) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TERASCALE_DEVICE": "cpu", "PYTHONPATH": str(ROOT),
               # live: the first epoch waits this long for the second node (both start within a second or two)
               "TERASCALE_ELASTIC_LAST_CALL": "4"}
        argv = self.box.cmd(sys.executable, "-m", "terascale", "run", "--nnodes", "1:2", "--elastic", self.elastic,
                            "--nproc", str(self.nproc),
                            "--master_addr", "127.0.0.1", "--master_port", str(self.port), "--rdzv_id", self.rdzv_id,
                            "--max-restarts", "100000", "--no_local_rank", str(Path(__file__).resolve()), "worker",
                            *self.worker_args)
        self.starts += 1
        with open(self.out / f"agent{node}.{self.starts}.log", "w") as log:
            self.agents[node] = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                 start_new_session=True)
        if node == 0:  # the first agent hosts the rendezvous store: the other joins once it listens
            while not self._listening(self.agents[0].pid):
                if self.agents[0].poll() is not None:
                    raise RuntimeError(f"agent 0 exited with {self.agents[0].returncode}; see {self.out}")
                clock.check()
                time.sleep(0.05)

    def _listening(self, pid: int) -> bool:
        # /proc/PID/net/tcp* are the sockets of PID's network namespace (ours, not the host's).
        for name in ("tcp", "tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == self.port:
                        return True
        return False

    def start(self, clock: Clock) -> None:
        self.start_agent(0, clock)
        self.start_agent(1, clock)

    def tree(self, node: int) -> list:
        import psutil

        proc = self.agents.get(node)
        if proc is None or proc.poll() is not None:
            return []
        try:
            root = psutil.Process(proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def ranks(self, node: int | None = None) -> list:
        """Live rank processes (of ``node``, or all): the agent's descendants running this file as a worker."""
        found = []
        for n in [node] if node is not None else sorted(self.agents):
            for p in self.tree(n):
                with contextlib.suppress(Exception):
                    cmd = p.cmdline()
                    # a rank runs "python -u .../fault_soak.py worker ..."; the agents run "python -m ..."
                    script = [i for i, c in enumerate(cmd) if c.endswith("fault_soak.py")]
                    if (script and "-m" not in cmd[: script[0]] and cmd[script[0] + 1: script[0] + 2] == ["worker"]
                            and p.status() != "zombie"):
                        found.append(p)
        return found

    def kill_node(self, node: int) -> int:
        procs = self.tree(node)
        for p in procs:
            with contextlib.suppress(Exception):
                p.send_signal(signal.SIGKILL)
        self.agents[node].wait()
        return len(procs)

    def stop(self, last: int) -> None:
        tmp = self.out / ".stop_at"
        tmp.write_text(str(last))
        os.replace(tmp, self.out / "stop_at")

    def wait_exit(self, clock: Clock) -> dict[int, int | None]:
        while any(p.poll() is None for p in self.agents.values()):
            clock.check()
            time.sleep(0.2)
        return {n: p.returncode for n, p in self.agents.items()}


class StepLog:
    """Rank 0's records (``start``/``step``/``save``/``end``), read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.records, self._offset = path, [], 0

    def refresh(self) -> list[dict]:
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next read
            self._offset += len(whole)
            self.records += [json.loads(line) for line in whole.decode().splitlines() if line.strip()]
        return self.records

    def steps(self) -> list[dict]:
        return [r for r in self.refresh() if r["e"] == "step"]

    def formations(self) -> dict[str, dict]:
        """Per formation: its start record, first and last step records, saves."""
        out: dict[str, dict] = {}
        for r in self.refresh():
            f = out.setdefault(r["f"], {"start": None, "first": None, "last": None, "saves": []})
            if r["e"] == "start":
                f["start"] = r
            elif r["e"] == "step":
                f["first"] = f["first"] or r
                f["last"] = r
            elif r["e"] == "save":
                f["saves"].append(r["step"])
        return out


def wait_stepping(job: Job, clock: Clock, *, after: float, world: int, new: bool, timeout: float) -> dict | None:
    """The first step record after time ``after`` at world ``world`` (of a formation that
    started after ``after`` when ``new``); None after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        clock.check()
        forms = job.log.formations()
        for r in job.log.steps():
            if r["t"] > after and r["world"] == world and (not new or forms[r["f"]]["start"]["t"] > after):
                return r
        time.sleep(0.2)
    return None


# -- checkpoints: a watcher that remembers every committed one --------------------------------


class CheckpointWatch(threading.Thread):
    """Polls ``save_dir``: hashes each committed ``global_step*`` folder when it appears
    (a new manifest inode is a new commit) and notes when the newest one vanished with
    nothing as new in its place (a lost checkpoint)."""

    def __init__(self, save_dir: Path, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.save_dir, self.period = save_dir, period
        self.seen: dict[tuple, dict] = {}  # (tag, manifest inode, mtime_ns) -> {files: {name: sha256}, t}
        self.lost: list[dict] = []
        self.lock = threading.RLock()
        self._halt = threading.Event()
        self._newest: tuple[int, str] | None = None

    def run(self) -> None:
        while not self._halt.wait(self.period):
            with contextlib.suppress(OSError, ValueError):
                self.poll()

    def poll(self) -> None:
        with self.lock:  # the thread and the driver both poll
            present = set()
            for folder in list(self.save_dir.iterdir()) if self.save_dir.is_dir() else []:
                # a save under an existing tag moves the old folder to .<tag>.old for an instant
                tag = folder.name.removeprefix(".").removesuffix(".old")
                if not tag.startswith("global_step") or not (folder / "manifest.json").exists():
                    continue
                present.add(tag)
                if folder.name != tag:
                    continue
                with contextlib.suppress(FileNotFoundError):  # pruned or replaced meanwhile: next poll
                    key = manifest_key(folder)
                    if key not in self.seen:
                        files = {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file()}
                        self.seen[key] = {"tag": tag, "files": files, "t": time.time()}
            newest = max(((int(t.removeprefix("global_step")), t) for t in present), default=None)
            gone = self._newest is not None and self._newest[1] not in present
            if gone and (newest is None or newest < self._newest):
                self.lost.append({"tag": self._newest[1], "t": time.time()})
            self._newest = newest

    def committed_after(self, t: float) -> bool:
        with self.lock:
            return any(v["t"] > t for v in self.seen.values())

    def newest(self) -> Path | None:
        with contextlib.suppress(OSError, ValueError):
            self.poll()
        return None if self._newest is None else self.save_dir / self._newest[1]

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_key(folder: Path) -> tuple:
    st = (folder / "manifest.json").stat()
    return (folder.name, st.st_ino, st.st_mtime_ns)


def corrupt_file(folder: Path, where: str, rng: random.Random) -> dict:
    """Flip 64 bytes of one shard file of checkpoint ``folder``: inside its tensor data
    (``where`` "data"), or inside its safetensors JSON header ("header")."""
    shard = rng.choice(sorted(folder.glob("*.safetensors")))
    with open(shard, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        size = os.fstat(f.fileno()).st_size
        lo, hi = (8 + header, size - 64) if where == "data" else (8, 8 + header - 64)
        offset = rng.randrange(lo, max(hi, lo + 1))
        f.seek(offset)
        data = f.read(64)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())
    return {"file": shard.name, "offset": offset, "bytes": 64, "where": where}


# -- faults --------------------------------------------------------------------------------


class Soak:
    """The fault phase: inject, wait for the job to step again at its full world, pause."""

    def __init__(self, args: argparse.Namespace, job: Job, box: Sandbox, watch: CheckpointWatch, clock: Clock) -> None:
        self.a, self.job, self.box, self.watch, self.clock = args, job, box, watch, clock
        self.rng = random.Random(args.seed)
        self.full = 2 * args.nproc
        self.events: list[dict] = []
        self.failed: str | None = None

    def note(self, kind: str, t0: float, t1: float | None = None, **detail: object) -> dict:
        e = {"kind": kind, "t0": t0, "t1": t1 if t1 is not None else t0, **detail}
        self.events.append(e)
        brief = {k: v for k, v in detail.items() if k not in ("key", "verify_says")}
        print(f"  [{t0 - self.started:7.1f} s] {kind} {json.dumps(brief)}", flush=True)
        return e

    def recovered(self, event: dict, world: int, *, new: bool) -> bool:
        timeout = self.a.recovery_timeout
        if wait_stepping(self.job, self.clock, after=event["t1"], world=world, new=new, timeout=timeout) is None:
            self.failed = f"{event['kind']}: the job did not step at world {world} within {timeout} s"
            print("  " + self.failed, flush=True)
            return False
        return True

    def pick_rank(self):
        """A random live rank process (there are some: the job was stepping a moment ago)."""
        for _ in range(100):
            ranks = self.job.ranks()
            if len(ranks) == self.full:
                return self.rng.choice(ranks)
            self.clock.sleep(0.1)
        raise RuntimeError(f"found {len(ranks)} rank processes, expected {self.full}")

    def run(self, kinds: list[str], until: float, once_each: bool) -> None:
        self.started = time.time()
        queue = self.rng.sample(kinds, len(kinds)) if once_each else []
        while not self.failed:
            if once_each:
                if not queue:
                    break
                kind = queue.pop()
            else:
                if time.time() >= until:
                    break
                if not kinds:  # --faults '': a baseline, the same job left alone
                    self.clock.sleep(until - time.time())
                    continue
                kind = self.rng.choice(kinds)
            self.clock.sleep(self.rng.uniform(*self.a.gap))
            getattr(self, kind)()

    def kill_rank(self) -> None:
        proc = self.pick_rank()
        rank, t0 = _env_rank(proc), time.time()
        proc.send_signal(signal.SIGKILL)
        e = self.note("kill_rank", t0, pid=proc.pid, rank=rank)
        self.recovered(e, self.full, new=True)

    def kill_node(self) -> None:
        t0 = time.time()
        n = self.job.kill_node(1)
        e = self.note("kill_node", t0, node=1, processes=n)
        if not self.recovered(e, self.a.nproc, new=True):
            return
        self.clock.sleep(self.rng.uniform(*self.a.rejoin_after))
        t0 = time.time()
        self.job.start_agent(1, self.clock)
        e = self.note("rejoin", t0, node=1)
        self.recovered(e, self.full, new=True)

    def straggler(self) -> None:
        proc, hold = self.pick_rank(), self.rng.uniform(*self.a.stop_for)
        rank, t0 = _env_rank(proc), time.time()
        proc.send_signal(signal.SIGSTOP)
        try:
            self.clock.sleep(hold)
        finally:
            with contextlib.suppress(Exception):
                proc.send_signal(signal.SIGCONT)
        e = self.note("straggler", t0, time.time(), pid=proc.pid, rank=rank, stopped_s=round(hold, 1))
        self.recovered(e, self.full, new=False)

    def packet_loss(self) -> None:
        percent, hold = self.rng.randint(*self.a.loss_percent), self.rng.uniform(*self.a.loss_for)
        t0 = time.time()
        self.box.drop(percent)
        try:
            self.clock.sleep(hold)
        finally:
            self.box.undrop()
        e = self.note("packet_loss", t0, time.time(), percent=percent, for_s=round(hold, 1))
        self.recovered(e, self.full, new=False)

    def disk_full(self) -> None:
        hold = self.rng.uniform(*self.a.full_for)
        t0 = time.time()
        left = self.box.fill()
        try:
            self.clock.sleep(hold)
        finally:
            self.box.unfill()
        e = self.note("disk_full", t0, time.time(), free_bytes_left=left, for_s=round(hold, 1))
        if self.recovered(e, self.full, new=False):
            # Recovered means saving again too: wait for a checkpoint committed after the disk emptied.
            end = time.monotonic() + self.a.recovery_timeout
            while time.monotonic() < end and not self.watch.committed_after(e["t1"]):
                self.clock.sleep(0.5)
            e["saved_again"] = self.watch.committed_after(e["t1"])

    def corrupt(self) -> None:
        end = time.monotonic() + self.a.recovery_timeout
        while self.watch.newest() is None and time.monotonic() < end:  # something to corrupt first
            self.clock.sleep(0.5)
        self.pick_rank()  # every rank is there
        ranks = self.job.ranks()
        for p in ranks:  # hold the job still, so that no newer checkpoint lands meanwhile
            p.send_signal(signal.SIGSTOP)
        try:
            folder = self.watch.newest()
            t0 = time.time()
            detail = {"tag": None}
            if folder is not None:
                key = manifest_key(folder)
                detail = {"tag": folder.name, **corrupt_file(folder, self.a.corrupt, self.rng), "key": list(key)}
                detail["verify_says"] = verify(folder)  # terascale's own check must see it
            victim = self.rng.choice(ranks)
            detail.update(killed_pid=victim.pid, killed_rank=_env_rank(victim))
            victim.send_signal(signal.SIGKILL)
        finally:
            for p in ranks:
                with contextlib.suppress(Exception):
                    p.send_signal(signal.SIGCONT)
        e = self.note("corrupt", t0, **detail)
        self.recovered(e, self.full, new=True)


def _env_rank(proc) -> int | None:
    with contextlib.suppress(Exception):
        return int(proc.environ()["RANK"])
    return None


# -- analysis ------------------------------------------------------------------------------


def analyse(events: list[dict], forms: dict[str, dict], end_t: float) -> None:
    """Per event (in place): the formations that started in its window (up to the next
    event), the steps they redid, when the job stepped again, the time lost."""
    started = sorted((f for f in forms.values() if f["start"] is not None), key=lambda f: f["start"]["t"])
    steps = sorted((r for f in forms.values() for r in f["steps"]), key=lambda r: r["t"])
    times = [r["t"] for r in steps]
    reached = list(itertools.accumulate((r["step"] for r in steps), max))  # highest step so far, in time order

    def reached_before(t: float) -> int:
        i = bisect.bisect_left(times, t)
        return reached[i - 1] if i else 0

    for i, e in enumerate(events):
        window_end = events[i + 1]["t0"] if i + 1 < len(events) else end_t
        new = [f for f in started if e["t0"] < f["start"]["t"] <= window_end]
        e["restarts"] = len(new)
        e["worlds"] = [f["start"]["world"] for f in new]
        e["resumed_at"] = [f["start"]["resumed"] for f in new]
        # redone: the highest step reached before a formation started, minus where it resumed
        e["steps_redone"] = sum(max(0, reached_before(f["start"]["t"]) - f["start"]["resumed"]) for f in new)
        if new:  # recovered when the last formation of the window made its first step
            e["recovered_t"] = new[-1]["first"]["t"] if new[-1]["first"] else None
        else:  # nothing restarted: the first step after the fault ended
            j = bisect.bisect_right(times, e["t1"])
            e["recovered_t"] = times[j] if j < len(times) and times[j] <= window_end else None
        e["recovered"] = e["recovered_t"] is not None
        e["time_lost_s"] = None if e["recovered_t"] is None else round(e["recovered_t"] - e["t0"], 2)
        # how the job fared meanwhile: steps made while the fault lasted, its longest pause
        during = times[bisect.bisect_right(times, e["t0"]):bisect.bisect_right(times, e["recovered_t"] or window_end)]
        e["steps_during"] = sum(1 for t in during if t <= e["t1"])
        e["longest_stall_s"] = round(max(b - a for a, b in zip([e["t0"], *during], during)), 2) if during else None


def formations_with_steps(log: StepLog) -> dict[str, dict]:
    forms = log.formations()
    for f in forms.values():
        f["steps"] = []
    for r in log.steps():
        forms[r["f"]]["steps"].append(r)
    return forms


def split_brain(forms: dict[str, dict]) -> tuple[list, list]:
    """Pairs of formations that stepped at the same time, and checkpoint steps saved by two
    of them while both were alive."""
    live = [(name, f["first"]["t"], f["last"]["t"], set(f["saves"])) for name, f in forms.items() if f["first"]]
    overlaps, doubles = [], []
    for i, (a, a0, a1, sa) in enumerate(live):
        for b, b0, b1, sb in live[i + 1:]:
            if a0 < b1 and b0 < a1:
                overlaps.append([a, b])
                doubles += [{"step": s, "formations": [a, b]} for s in sorted(sa & sb)]
    return overlaps, doubles


def resaved(forms: dict[str, dict]) -> dict[int, list[str]]:
    """Steps saved by more than one formation one after the other (legitimate after a resume
    from an older checkpoint, e.g. past a corrupted one)."""
    by_step: dict[int, list[str]] = {}
    for name, f in forms.items():
        for step in f["saves"]:
            by_step.setdefault(step, []).append(name)
    return {step: names for step, names in sorted(by_step.items()) if len(names) > 1}


def worker_errors(path: Path) -> dict[str, int]:
    """The ranks' errors by kind (exception type and the start of its message, numbers dropped)."""
    counts: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("e") == "error":
                text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", r["error"])  # gloo's source location
                kind = re.sub(r"\d+", "#", text)[:100]
                counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def verify(folder: Path) -> str | None:
    """terascale's own check of a checkpoint folder, checksums included (None: whole)."""
    from terascale.checkpoint.directory import verify as terascale_verify

    return terascale_verify(folder, content=True)


def check_checkpoints(save_dir: Path, watch: CheckpointWatch, corrupted: list[dict]) -> dict:
    watch.poll()
    bad, changed, ok = [], [], 0
    on_purpose = {tuple(c["key"]) for c in corrupted if c.get("key")}
    for folder in sorted(save_dir.glob("global_step*")):
        if not (folder / "manifest.json").exists():
            continue
        key = manifest_key(folder)
        problem = verify(folder)
        seen = watch.seen.get(key)
        if key in on_purpose:
            continue
        if problem is not None:
            bad.append({"tag": folder.name, "problem": problem})
        elif seen is None:
            changed.append({"tag": folder.name, "problem": "committed but never seen by the watcher"})
        elif {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file()} != seen["files"]:
            changed.append({"tag": folder.name, "problem": "its bytes changed after it was committed"})
        else:
            ok += 1
    corrupted_left = []  # the ones corrupted on purpose that are still there (not pruned, not saved again)
    for c in corrupted:
        folder = save_dir / (c.get("tag") or "-")
        with contextlib.suppress(FileNotFoundError):
            if tuple(c["key"]) == manifest_key(folder):
                corrupted_left.append({"tag": c["tag"], "verify": verify(folder)})
    latest = (save_dir / "latest").read_text().strip() if (save_dir / "latest").exists() else None
    latest_ok = latest is not None and (save_dir / latest / "manifest.json").exists() and not verify(save_dir / latest)
    # what interrupted or failed writes left behind (staging folders, temporary files)
    debris = sorted(str(q.relative_to(save_dir)) for q in [*save_dir.glob(".*"), *save_dir.glob(".lease/.*")]
                    if q.name != ".lease")
    return {"verified": ok, "bad": bad, "changed": changed, "lost": watch.lost, "latest": latest,
            "latest_ok": latest_ok, "corrupted_still_there": corrupted_left, "debris": debris}


def compare(soak: Path, ref: Path) -> dict:
    import torch

    a, b = torch.load(soak, weights_only=True), torch.load(ref, weights_only=True)
    x, y = a["state"], b["state"]
    identical = x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in y)
    rel = max(float((x[k] - y[k]).norm() / y[k].norm().clamp_min(1e-30)) for k in y)  # per tensor, the worst
    return {"bit_identical": identical, "max_rel_diff": rel, "steps": [a["steps"], b["steps"]],
            "world": [a["world"], b["world"]]}


# -- the driver ----------------------------------------------------------------------------


def config(path: Path, args: argparse.Namespace, save_dir: Path | None) -> Path:
    world = 2 * args.nproc
    cfg: dict = {
        # The global batch stays args.batch at world 1..2*nproc: micro-batch x accumulation x world.
        "elasticity": {"enabled": True, "version": 0.1, "max_train_batch_size": args.batch, "min_gpus": 1,
                       "max_gpus": world, "micro_batch_sizes": sorted({args.batch // world, args.batch // args.nproc})},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    if save_dir is not None:
        cfg["checkpoint"] = {"save_dir": str(save_dir), "auto_resume": True, "interval_steps": args.interval,
                             "keep_last_n": args.keep}
    path.write_text(json.dumps(cfg, indent=1))
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="length of the fault phase")
    p.add_argument("--quick", action="store_true", help="each fault kind once, shorter pauses (about 3 minutes)")
    p.add_argument("--faults", default=",".join(KINDS), help="comma-separated kinds: " + ", ".join(KINDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=1, help="ranks per node (world 2*nproc)")
    p.add_argument("--elastic", choices=("live", "restart"), default="live",
                   help="terascale run's elastic mode: live (ranks keep running through resizes) or restart")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=16384, help="global batch")
    p.add_argument("--interval", type=int, default=10, help="checkpoint.interval_steps")
    p.add_argument("--keep", type=int, default=4, help="checkpoint.keep_last_n")
    p.add_argument("--disk-mib", type=int, default=128, help="size of the checkpoint filesystem")
    p.add_argument("--corrupt", choices=("data", "header"), default="data", help="where the corruption flips bytes")
    p.add_argument("--tail", type=int, default=20, help="steps after the fault phase")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--recovery-timeout", type=float, default=180.0, help="seconds a fault may take to recover")
    p.add_argument("--deadline-min", type=float, default=None,
                   help="kill everything after this many minutes (default 2.5*minutes+10; --quick: 15)")
    p.add_argument("--json", default=None)
    p.add_argument("--keep-logs", dest="keep_logs", action="store_true", help="keep the work directory")
    a = p.parse_args(argv)
    a.faults = [k.strip() for k in a.faults.split(",") if k.strip()]
    unknown = set(a.faults) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    # (low, high) ranges for the random draws, in seconds (percent for the loss)
    a.gap = (3.0, 8.0) if a.quick else (10.0, 40.0)
    a.rejoin_after = (3.0, 6.0) if a.quick else (5.0, 30.0)
    a.stop_for = (3.0, 8.0) if a.quick else (3.0, 20.0)
    a.loss_for = (3.0, 6.0) if a.quick else (3.0, 15.0)
    a.loss_percent = (5, 40)
    a.full_for = (6.0, 10.0) if a.quick else (8.0, 30.0)
    if a.deadline_min is None:
        # the reference retrains every step, and the machine may get slower meanwhile
        a.deadline_min = 15.0 if a.quick else 2.5 * a.minutes + 10
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    if os.geteuid() != 0:
        raise SystemExit("fault_soak.py needs root: it creates a network namespace, a loop mount and nftables rules")
    sweep_stale()
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-"))
    box = Sandbox(work, a.disk_mib)
    clock = Clock(a.deadline_min * 60)
    result: dict = {"args": {k: v for k, v in vars(a).items()}, "work": str(work)}
    ok = False

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    began = time.time()
    print(f"work directory {work}", flush=True)
    try:
        box.open()
        result["namespace"] = box.ns
        ok = run(a, box, work, clock, result)
    except Deadline as exc:
        result["failure"] = f"{exc} ({a.deadline_min} min)"
    except KeyboardInterrupt:
        result["failure"] = "interrupted"
        print("interrupted: cleaning up", flush=True)
    except Exception:  # a bug here or a tool that failed: still clean up and report
        result["failure"] = traceback.format_exc()
        print(result["failure"], flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave the sandbox behind
        box.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    result["wall_s"] = round(time.time() - began, 1)
    result["ok"] = ok and "failure" not in result
    report(result)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    if result["ok"] and not a.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept in {work}")
    return 0 if result["ok"] else 1


def summarise(result: dict, job: Job, soak: Soak, watch: CheckpointWatch, save_dir: Path) -> None:
    """Fill ``result`` from the step log, the ranks' events and the checkpoint directory."""
    forms = formations_with_steps(job.log)
    analyse(soak.events, forms, time.time())
    overlaps, doubles = split_brain(forms)
    corrupted = [e for e in soak.events if e["kind"] == "corrupt"]
    for e in corrupted:  # the resume after a corruption must not have used the corrupted step
        step = int(e["tag"].removeprefix("global_step")) if e.get("tag") else None
        e["passed_over"] = step is not None and all(r != step for r in e.get("resumed_at", []))
        e["resumed_older"] = step is not None and all(r < step for r in e.get("resumed_at", []))
    result.update({
        "events": soak.events,
        "formations": [{"f": n, "world": f["start"]["world"], "resumed": f["start"]["resumed"],
                        "start_t": f["start"]["t"], "last_step": f["last"]["step"] if f["last"] else None}
                       for n, f in sorted(forms.items(), key=lambda kv: kv[1]["start"]["t"]) if f["start"]],
        "steps_logged": len(job.log.steps()),
        "restarts": max(0, len(forms) - 1),
        # worlds that trained (a formation that never stepped changed no parameter)
        "worlds_seen": sorted({f["start"]["world"] for f in forms.values() if f["start"] and f["first"]}),
        "split_brain": overlaps,
        "double_writers": doubles,
        "saved_by_several": resaved(forms),
        "worker_errors": worker_errors(job.out / "events.jsonl"),
        "checkpoints": check_checkpoints(save_dir, watch, corrupted),
    })


def run(a: argparse.Namespace, box: Sandbox, work: Path, clock: Clock, result: dict) -> bool:
    model = ["--dim", str(a.dim), "--hidden", str(a.hidden), "--layers", str(a.layers), "--batch", str(a.batch)]
    save_dir = box.mount / "ckpt"
    soak_out = work / "soak"
    soak_out.mkdir()
    cfg = config(work / "soak.json", a, save_dir)
    job = Job(box, soak_out, 29500, a.nproc, ["--config", str(cfg), "--out", str(soak_out), *model], a.elastic)
    watch = CheckpointWatch(save_dir)
    watch.start()
    soak = Soak(a, job, box, watch, clock)
    full = 2 * a.nproc
    print(f"soak: 2 agents x {a.nproc} rank(s) in namespace {box.ns}, checkpoints on a {a.disk_mib} MiB loop "
          f"filesystem; faults {', '.join(a.faults)}", flush=True)
    t_start = time.time()
    try:
        job.start(clock)
        if wait_stepping(job, clock, after=t_start, world=full, new=False, timeout=a.recovery_timeout) is None:
            result["failure"] = f"the job never stepped at world {full}"
            return False
        first_step_t = time.time()
        soak.run(a.faults, until=time.time() + a.minutes * 60, once_each=a.quick)
        if soak.failed:
            result["failure"] = soak.failed
            return False
        # The end: every fault undone already; the final step a little way ahead, reached at full world.
        last = max((r["step"] for r in job.log.steps()), default=0) + a.tail
        job.stop(last)
        result["fault_phase_s"] = round(time.time() - first_step_t, 1)
        result["total_steps"] = last
        result["agent_exit_codes"] = job.wait_exit(clock)
    finally:  # also after a failure, the deadline or Ctrl-C: say what happened up to then
        watch.stop()
        result["soak_s"] = round(time.time() - t_start, 1)
        try:
            summarise(result, job, soak, watch, save_dir)
        except Exception:  # noqa: BLE001 - a half-written log must not hide the real failure
            result["summary_error"] = traceback.format_exc()
    ends = [r for r in job.log.refresh() if r["e"] == "end"]
    result["finished"] = (bool(ends) and ends[-1]["step"] == last and (soak_out / "final.pt").exists()
                          and result["agent_exit_codes"].get(0) == 0)
    if not result["finished"]:
        return False
    # The undisturbed reference: the same steps, the same two agents at full world, no faults.
    ref_out = work / "reference"
    ref_out.mkdir()
    ref = Job(box, ref_out, 29600, a.nproc, ["--config", str(config(work / "ref.json", a, None)), "--out", str(ref_out),
                                             "--steps", str(last), *model])
    print(f"reference: {last} steps undisturbed", flush=True)
    t0 = time.time()
    ref.start(clock)
    ref_codes = ref.wait_exit(clock)
    result["reference_s"] = round(time.time() - t0, 1)
    result["reference_exit_codes"] = ref_codes
    if not (ref_out / "final.pt").exists():
        result["failure"] = f"the reference run did not finish (exit codes {ref_codes}); see {ref_out}"
        return False
    cmp = compare(soak_out / "final.pt", ref_out / "final.pt")
    same_world = result["worlds_seen"] == [full]
    cmp["required"] = "bit-identical" if same_world else f"within {a.rtol} relative"
    cmp["ok"] = cmp["bit_identical"] if same_world else cmp["max_rel_diff"] <= a.rtol
    result["parameters"] = cmp
    ck = result["checkpoints"]
    corrupted = [e for e in soak.events if e["kind"] == "corrupt"]
    checks = {
        "finished": result["finished"],
        "parameters": cmp["ok"],
        "checkpoints_verify": not ck["bad"] and not ck["changed"] and ck["latest_ok"],
        # the job's last interval save is there and is what latest names
        "final_checkpoint": ck["latest"] == f"global_step{last // a.interval * a.interval}",
        "no_lost_checkpoint": not ck["lost"],
        "no_split_brain": not result["split_brain"],
        "no_double_writer": not result["double_writers"],
        "corruption_detected": all(e.get("verify_says") for e in corrupted),
        "corruption_passed_over": all(e.get("passed_over") for e in corrupted),
        "all_recovered": all(e["recovered"] for e in soak.events),
    }
    result["checks"] = checks
    return all(checks.values())


def report(r: dict) -> None:
    events = r.get("events", [])
    print()
    if events:
        # Time lost runs from the fault to the first step of the formation it led to; under
        # --elastic live a joining node's start-up does not stop the job, which steps on
        # until the resize: the longest stall is what training lost there.
        print(f"elastic mode: {r['args'].get('elastic', 'restart')}")
        print("| fault | injected | recovered | time lost s (median / max) | longest stall s (median / max) | "
              "steps redone | restarts |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for kind in [*KINDS[:2], "rejoin", *KINDS[2:]]:
            es = [e for e in events if e["kind"] == kind]
            if not es:
                continue
            lost = [e["time_lost_s"] for e in es if e.get("time_lost_s") is not None]
            spread = f"{statistics.median(lost):.1f} / {max(lost):.1f}" if lost else "-"
            stalls = [e["longest_stall_s"] for e in es if e.get("longest_stall_s") is not None]
            stall = f"{statistics.median(stalls):.1f} / {max(stalls):.1f}" if stalls else "-"
            print(f"| {kind} | {len(es)} | {sum(bool(e.get('recovered')) for e in es)} | {spread} | {stall} | "
                  f"{sum(e.get('steps_redone', 0) for e in es)} | {sum(e.get('restarts', 0) for e in es)} |")
        print()
        print("| # | at s | fault | detail | restarts (worlds) | resumed at | time lost s | steps redone | "
              "steps during | longest stall s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        t_first = events[0]["t0"]
        shown = {"kind", "t0", "t1", "restarts", "worlds", "steps_redone", "resumed_at", "recovered_t", "recovered",
                 "time_lost_s", "key", "steps_during", "longest_stall_s"}
        for i, e in enumerate(events, 1):
            detail = ", ".join(f"{k}={v}" if k != "verify_says" else f"verify={'flagged' if v else 'MISSED'}"
                               for k, v in e.items() if k not in shown)
            print(f"| {i} | {e['t0'] - t_first:.1f} | {e['kind']} | {detail} | "
                  f"{e.get('restarts', '-')} {e.get('worlds', '')} | {e.get('resumed_at', '-')} | "
                  f"{e.get('time_lost_s', '-')} | {e.get('steps_redone', '-')} | "
                  f"{e.get('steps_during', '-')} | {e.get('longest_stall_s', '-')} |")
        print()
    rows = [("total steps", r.get("total_steps")), ("restarts (formations - 1)", r.get("restarts")),
            ("world sizes seen", r.get("worlds_seen")), ("fault phase wall s", r.get("fault_phase_s")),
            ("soak wall s (start to exit)", r.get("soak_s")), ("reference wall s", r.get("reference_s")),
            ("whole run wall s", r.get("wall_s"))]
    p = r.get("parameters")
    if p:
        rows.append(("final parameters vs reference",
                     f"{'bit-identical' if p['bit_identical'] else 'max rel diff %.2e' % p['max_rel_diff']} "
                     f"(required: {p['required']}; worlds {p['world']})"))
    ck = r.get("checkpoints")
    if ck:
        rows.append(("checkpoints left", f"{ck['verified']} verified, bad {ck['bad']}, changed {ck['changed']}, "
                                          f"lost {ck['lost']}, latest {ck['latest']} ok={ck['latest_ok']}"))
        rows.append(("corrupted on purpose and still there", ck["corrupted_still_there"]))
        debris = ck["debris"]
        rows.append(("left-over files in save_dir", f"{len(debris)}: {debris[:3]}{' ...' if len(debris) > 3 else ''}"))
    rows += [("split brain (overlapping formations)", r.get("split_brain")),
             ("double writers", r.get("double_writers")),
             ("steps saved again by a later formation", r.get("saved_by_several"))]
    for kind, n in (r.get("worker_errors") or {}).items():
        rows.append((f"rank errors x{n}", kind.replace("|", "/")))
    for name, ok in (r.get("checks") or {}).items():
        rows.append((f"check: {name}", "ok" if ok else "FAILED"))
    if r.get("failure"):
        rows.append(("failure", r["failure"].strip().splitlines()[-1]))
    rows.append(("result", "PASS" if r.get("ok") else "FAIL"))
    print("| | |")
    print("| --- | --- |")
    for name, value in rows:
        if value is not None:
            print(f"| {name} | {value} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
