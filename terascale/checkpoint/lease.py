"""One writer per checkpoint directory: a lease held by the job that saves there.

[Note: checkpoint directory lease]
Two jobs writing one save directory destroy each other's checkpoints: two agents that
formed separate rounds of one elastic job (a split brain), a job started twice by a
scheduler, a stopped job that wakes up after its replacement took over. Rank 0 of a job
holds a lease on each directory it commits checkpoints to, and checks it before every
save and again just before the commit; a job that does not hold it writes nothing.

The lease is a sequence of files ``<dir>/.lease/<generation>.json``; the highest
generation present is the holder. Each file says who holds it (job id, host, pid, world
size, the step last saved) and carries a heartbeat (wall time and a counter) that the
holder renews every ``heartbeat_s`` from a thread. Only two filesystem operations are
relied on, both atomic on local filesystems and on NFS, which has no dependable locks:

* taking generation g+1 is a hard link of a complete temporary file to ``<g+1>.json``,
  which fails if the name exists, so exactly one contender wins;
* a renewal replaces the holder's own file with ``os.replace``.

A contender may take the lease when no file exists, when the holder released it (its
job ended), when the holder's process is gone (same host: its pid no longer runs) or is
the contender's own (a new engine in the same process replaces the old one), when
its wall-clock heartbeat is older than ``expiry_s``, or when its heartbeat counter did
not move for ``expiry_s`` of the contender's own clock (hosts' clocks may disagree).
Otherwise it waits up to ``wait_s`` (a holder that just died stops heartbeating) and then
refuses with the holder's description. A holder that finds a higher generation (it was
paused past the expiry and replaced) has lost the lease: its saves are refused from then
on (LeaseLostError), while the new holder's checkpoints stay intact.

The check before a commit and the commit are two steps: a holder paused between them for
longer than the expiry could still commit once. Checkpoint folders are written under
their own names and committed by rename, so even then both checkpoints stay whole.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from terascale.checkpoint.manifest import CheckpointError

__all__ = ["DirectoryLease", "Holder", "LeaseError", "LeaseHeldError", "LeaseLostError", "LeasePolicy", "LeaseSet", "job_id"]

LEASE_DIR = ".lease"


class LeaseError(CheckpointError):
    """The directory's lease stops this job from writing there."""


class LeaseHeldError(LeaseError):
    """Another live job holds the directory."""


class LeaseLostError(LeaseError):
    """This job held the directory, and another took it over while this one was silent."""


@dataclass(frozen=True)
class LeasePolicy:
    """Timing of the lease: renew every ``heartbeat_s``; a holder silent for ``expiry_s``
    may be replaced; a contender waits ``wait_s`` for a live-looking holder to go silent
    before it refuses (default: expiry plus two heartbeats)."""

    heartbeat_s: float = 1.0
    expiry_s: float = 6.0
    wait_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s * 3 <= self.expiry_s:
            raise ValueError(
                f"checkpoint lease: expiry_s ({self.expiry_s}) must be at least 3 heartbeats "
                f"(heartbeat_s {self.heartbeat_s}), or a busy holder would lose its lease"
            )

    @property
    def patience_s(self) -> float:
        return self.expiry_s + 2 * self.heartbeat_s if self.wait_s is None else self.wait_s


@dataclass(frozen=True)
class Holder:
    """One generation of a directory's lease: who holds it and its last heartbeat."""

    generation: int
    job: str
    host: str
    pid: int
    pid_start: str  # the process's start time (Linux), so a reused pid is not taken for the holder
    world: int
    heartbeat: float  # wall time of the last renewal
    beat: int  # renewals so far
    step: int | None = None  # the step of the last save
    released: bool = False

    def same_holder(self, other: Holder) -> bool:
        """Whether ``other`` is this generation held by the same process."""
        return (self.generation, self.host, self.pid) == (other.generation, other.host, other.pid)

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        state = "released" if self.released else f"last heartbeat {max(now - self.heartbeat, 0.0):.1f} s ago"
        saved = "" if self.step is None else f", last saved step {self.step}"
        return (f"job '{self.job}' (rank 0 is pid {self.pid} on {self.host}, {self.world} ranks, lease "
                f"generation {self.generation}, {state}{saved})")  # fmt: skip


def job_id(environ: dict[str, str] | os._Environ[str] | None = None) -> str:
    """The launcher's name for this job (torchrun's run id, SLURM's job id, ...), else a new one."""
    env = os.environ if environ is None else environ
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid", "PBS_JOBID", "LSB_JOBID"):
        if env.get(key):
            return env[key]
    return uuid.uuid4().hex[:12]


def _process_start(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot), '' where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _gone(holder: Holder) -> bool:
    """Whether ``holder``'s process is known not to run any more (only knowable on its host)."""
    if holder.host != socket.gethostname():
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    start = _process_start(holder.pid)
    return bool(holder.pid_start) and bool(start) and start != holder.pid_start


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _this_process(holder: Holder) -> bool:
    # A second engine of this same process (a script that builds a new one to resume) is
    # no second job: it replaces the first, whose later saves are refused.
    return holder.host == socket.gethostname() and holder.pid == os.getpid()


class DirectoryLease:
    """The lease of directory ``root`` for job ``job`` of ``world`` ranks (held by rank 0).

    :meth:`acquire` takes it (waiting out a holder that just died, else raising
    LeaseHeldError) and starts the heartbeat; :meth:`renew` checks it is still held
    (LeaseLostError otherwise) and records the step; :meth:`release` ends it.
    """

    def __init__(self, root: str | os.PathLike, job: str, world: int, policy: LeasePolicy | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.root = Path(root)
        self.folder = self.root / LEASE_DIR
        self.job, self.world = job, world
        self.policy = policy or LeasePolicy()
        self._clock = clock
        self._mine: Holder | None = None
        self._lost: LeaseLostError | None = None
        self._lock = threading.Lock()  # the heartbeat thread and the saving thread both renew
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> Holder | None:
        return self._mine

    # -- reading ---------------------------------------------------------------------------------

    def current(self) -> Holder | None:
        """The holder: the highest generation whose file can be read (None: never leased)."""
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return None
        generations = sorted((int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()), reverse=True)
        for generation in generations:
            try:
                return Holder(**json.loads((self.folder / f"{generation}.json").read_text()))
            except FileNotFoundError:  # pruned by a newer holder meanwhile: look again
                return self.current()
            except (ValueError, TypeError):
                continue  # not written by this protocol; the next one down decides
        return None

    def live_holder(self) -> Holder | None:
        """The holder when it looks alive now (not released, its process not known to be
        gone, heartbeat within the expiry), without waiting; None otherwise. For when the
        lease cannot be written (a full disk) but may still be read."""
        holder = self.current()
        if holder is None or holder.released or _gone(holder) or _this_process(holder):
            return None
        return holder if self._clock() - holder.heartbeat <= self.policy.expiry_s else None

    # -- taking ----------------------------------------------------------------------------------

    def acquire(self) -> Holder | None:
        """Take the lease; return the holder it replaced (None if it was free). Raises
        LeaseHeldError naming the holder when a live job keeps it for ``policy.patience_s``."""
        deadline = time.monotonic() + self.policy.patience_s
        seen: tuple[int, int] | None = None  # (generation, beat) of the holder being watched
        seen_since = time.monotonic()
        while True:
            holder = self.current()
            if holder is not None and (holder.generation, holder.beat) != seen:
                seen, seen_since = (holder.generation, holder.beat), time.monotonic()
            silent = holder is not None and time.monotonic() - seen_since >= self.policy.expiry_s
            if holder is None or holder.released or _gone(holder) or silent or _this_process(holder) or \
                    self._clock() - holder.heartbeat > self.policy.expiry_s:  # fmt: skip
                if self._take(0 if holder is None else holder.generation + 1):
                    self._start_heartbeat()
                    return holder
                continue  # another contender took it first: judge the new holder
            if time.monotonic() >= deadline:
                raise LeaseHeldError(
                    f"'{self.root}' is being written by another job: {holder.describe(self._clock())}. "
                    "Two jobs saving into one directory would overwrite each other's checkpoints; stop "
                    "that job or give this one another checkpoint.save_dir. (A job that stopped "
                    f"heartbeating for {self.policy.expiry_s:.0f} s is taken over automatically.)"
                )
            time.sleep(min(self.policy.heartbeat_s / 2, 0.25))

    def _take(self, generation: int) -> bool:
        """Create ``<generation>.json`` if no one has; True if this call did."""
        self.folder.mkdir(parents=True, exist_ok=True)
        holder = Holder(generation=generation, job=self.job, host=socket.gethostname(), pid=os.getpid(),
                        pid_start=_process_start(os.getpid()), world=self.world, heartbeat=self._clock(), beat=0)  # fmt: skip
        tmp = self._write_tmp(holder)
        try:
            os.link(tmp, self.folder / f"{generation}.json")
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self._mine = holder
        self._prune(generation)
        return True

    def _prune(self, generation: int) -> None:
        # Keep the previous generation for the record; older ones say nothing more, nor do
        # temporary files a holder killed mid-write left behind.
        for name in os.listdir(self.folder):
            path = self.folder / name
            if name.startswith(".tmp-"):
                stale = self._clock() - _mtime(path) > self.policy.expiry_s  # not a contender's, mid-take
            else:
                stale = name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) < generation - 1
            if stale:
                path.unlink(missing_ok=True)

    def _write_tmp(self, holder: Holder) -> Path:
        tmp = self.folder / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "w") as f:
                json.dump(asdict(holder), f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not leave one behind per heartbeat
            raise
        return tmp

    # -- holding ---------------------------------------------------------------------------------

    def renew(self, step: int | None = None) -> None:
        """Check the lease is still this job's and renew its heartbeat (recording ``step``
        when given). Raises LeaseLostError naming the new holder otherwise."""
        with self._lock:
            if self._lost is not None:
                raise self._lost
            mine = self._mine
            assert mine is not None, "renew() before acquire() or after the directory was removed"
            holder = self.current()
            if holder is None:
                # No contender deletes lease files; the directory itself was removed (a Trainer
                # rotating its checkpoint folders). Holding nothing, the heartbeat stops rather
                # than create the folder again; a later save there takes a new lease.
                self._mine = None
                self._stop.set()
                return
            if not holder.same_holder(mine):
                by = holder.describe(self._clock())
                self._lost = LeaseLostError(
                    f"this job (lease generation {mine.generation} of '{self.root}') was silent for longer than "
                    f"{self.policy.expiry_s:.0f} s and has been replaced by {by}; it must not write there any more"
                )
                self._stop.set()
                raise self._lost
            mine = replace(mine, heartbeat=self._clock(), beat=mine.beat + 1, step=mine.step if step is None else step)
            tmp = self._write_tmp(mine)
            os.replace(tmp, self.folder / f"{mine.generation}.json")
            self._mine = mine

    def check(self) -> None:
        """Renew; for the last moment before a commit."""
        self.renew()

    def release(self) -> None:
        """Mark the lease released (the next job takes it at once) and stop the heartbeat."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            mine, self._mine = self._mine, None
            if mine is None or self._lost is not None:
                return
            holder = self.current()
            if holder is None or not holder.same_holder(mine):
                return  # taken over meanwhile: not ours to release
            try:
                tmp = self._write_tmp(replace(mine, released=True, heartbeat=self._clock()))
                os.replace(tmp, self.folder / f"{mine.generation}.json")
            except OSError:
                pass  # a directory that went away needs no release

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"terascale-lease:{self.root.name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.policy.heartbeat_s):
            try:
                self.renew()
            except LeaseLostError:
                return  # reported by the next save
            except OSError:
                continue  # a transient filesystem error: the next beat tries again
            if self._mine is None:
                return  # the directory went away


class LeaseSet:
    """The leases one job's rank 0 holds, by directory: taken on first use, renewed at each
    save. Directories saved to once (a Trainer's ``checkpoint-N`` folders) would otherwise
    pile up heartbeat threads: beyond ``keep`` directories the least recently saved one is
    released, except those ``pinned`` (the configured save directory)."""

    def __init__(self, job: str, world: int, policy: LeasePolicy, keep: int = 8) -> None:
        self.job, self.world, self.policy, self.keep = job, world, policy, keep
        self._leases: dict[Path, DirectoryLease] = {}  # least recently used first
        self._pinned: set[Path] = set()

    def hold(self, root: str | os.PathLike, *, pin: bool = False, step: int | None = None) -> DirectoryLease:
        """The lease of ``root``, taken now if not yet held (may wait, may raise LeaseHeldError),
        else renewed (LeaseLostError if it was taken over)."""
        key = Path(root).resolve()
        lease = self._leases.pop(key, None)
        if lease is None or lease.held is None:
            lease = DirectoryLease(key, self.job, self.world, self.policy)
            lease.acquire()
            if step is not None:
                lease.renew(step)
        else:
            lease.renew(step)
        self._leases[key] = lease
        if pin:
            self._pinned.add(key)
        unpinned = [k for k in self._leases if k not in self._pinned]
        for old in unpinned[: max(0, len(unpinned) - self.keep)]:
            self._leases.pop(old).release()
        return lease

    def live_holder(self, root: str | os.PathLike) -> Holder | None:
        """Another job's live holder of ``root`` (see :meth:`DirectoryLease.live_holder`)."""
        return DirectoryLease(Path(root).resolve(), self.job, self.world, self.policy).live_holder()

    def check(self, root: str | os.PathLike) -> None:
        """Just before a commit into ``root``: the lease is still this job's (else LeaseLostError)."""
        lease = self._leases.get(Path(root).resolve())
        assert lease is not None, f"committing into {root} without its lease"
        lease.check()

    def release(self) -> None:
        while self._leases:
            self._leases.popitem()[1].release()
        self._pinned.clear()
