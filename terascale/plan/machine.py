"""What the planner knows of the machine: memory per rank on each tier, the disk, the links.

[Note: machine limits]
A rank's *host limit* is the resident memory its process may reach. The ranks of a node
share its memory, so each gets an equal share of what the node has for the job: the
memory available now (``psutil``: free plus reclaimable) plus what the ranks already hold
(their RSS at plan time), divided by the ranks on the node. Three other limits lower it:

- ``planner.host_memory``, a cap on the node's memory for the job (to emulate a smaller
  machine): its share per rank;
- the memory cgroup the process runs in (v2 ``memory.max``, v1
  ``memory.limit_in_bytes``): its room left (limit less usage) shared the same way, plus
  this rank's RSS;
- the address-space limit (``RLIMIT_AS``, ``ulimit -v``) of the process: its room left
  (limit less the virtual size now) plus the RSS, since the planner's predictions are of
  resident memory and new allocations are resident.

The *device limit* is the device's memory (or ``planner.device_memory``); on a machine
without an accelerator there is none and the host is the device. The NVMe tier has the
free space at ``nvme_path`` (or ``planner.disk_space``), shared by the node's ranks, and a
speed: ``planner.disk_bandwidth``, else the aio probe's measurement if one was kept
([Note: the aio probe]), else a 64 MiB rewrite-and-read measured once and kept beside it
(``plan_disk.json``; about 0.1 s).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
import torch

_DISK_PROBE_BYTES = 64 << 20
_DISK_CACHE = "plan_disk.json"
# Collective bandwidth per rank (bytes/s) when not measured: gloo over loopback and NCCL in a node.
_LINK_BANDWIDTH = {"cpu": 1.5e9, "cuda": 50e9}
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Limit:
    """One limit on a tier: ``bytes`` per rank and where the number came from."""

    bytes: int
    source: str


@dataclass(frozen=True)
class Machine:
    """The machine one rank plans for (see [Note: machine limits])."""

    device_type: str  # "cpu" or "cuda"
    world: int  # data-parallel ranks
    local_ranks: int  # ranks sharing this node's memory and disk
    rss: int  # this rank's resident memory at plan time (bytes)
    host: Limit  # resident memory this rank may reach
    device: Limit | None  # memory of this rank's device; None: the host is the device
    disk: Limit | None  # NVMe space per rank at the NVMe path; None without one
    disk_path: str | None = None
    disk_speed: float | None = None  # bytes/s (reads and writes alike)
    disk_speed_source: str = ""
    link_bandwidth: float = _LINK_BANDWIDTH["cpu"]  # bytes/s per rank in collectives
    cores: int = 1
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def has_device(self) -> bool:
        return self.device is not None


def read_cgroup_limit(root: Path = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup, or None where unlimited or
    unreadable (v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/``usage``)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        path = path.lstrip("/")
        candidates = []
        if hid == "0" and controllers == "":
            candidates.append((root / path, "memory.max", "memory.current"))
            candidates.append((root / "unified" / path, "memory.max", "memory.current"))
        if "memory" in controllers.split(","):
            candidates.append((root / "memory" / path, "memory.limit_in_bytes", "memory.usage_in_bytes"))
        for base, limit_name, usage_name in candidates:
            try:
                text = (base / limit_name).read_text().strip()
                usage = int((base / usage_name).read_text().strip())
            except (OSError, ValueError):
                continue
            if text == "max" or int(text) >= 1 << 60:
                continue
            return int(text), usage
    return None


def host_limit(local_ranks: int, rss: int, cap: int | None = None, *, cgroup_root: Path = CGROUP_ROOT) -> Limit:
    """This rank's host limit (see [Note: machine limits])."""
    mem = psutil.virtual_memory()
    limits = [Limit(int(mem.available / local_ranks + rss), "available memory")]
    if cap is not None:
        limits.append(Limit(int(cap / local_ranks), "planner.host_memory"))
    cgroup = read_cgroup_limit(cgroup_root)
    if cgroup is not None:
        limit, usage = cgroup
        limits.append(Limit(int(max(0, limit - usage) / local_ranks + rss), "the memory cgroup's limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        vms = psutil.Process().memory_info().vms
        limits.append(Limit(int(max(0, soft - vms) + rss), "the address-space limit (ulimit -v)"))
    return min(limits, key=lambda lim: lim.bytes)


def device_limit(device_type: str, cap: int | None = None, local_rank: int = 0) -> Limit | None:
    """Memory of this rank's accelerator (less what other processes use), or None on a CPU."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(local_rank)
    used_by_us = torch.cuda.memory_reserved(local_rank)
    limits = [Limit(int(free + used_by_us), "free device memory")]
    if cap is not None:
        limits.append(Limit(int(cap), "planner.device_memory"))
    return min(limits, key=lambda lim: lim.bytes)


def disk_limit(path: str | os.PathLike | None, local_ranks: int, cap: int | None = None) -> Limit | None:
    """Free space per rank at the NVMe path (or the cap), or None without a path."""
    if path is None:
        return None
    at = Path(path)
    while not at.exists() and at != at.parent:
        at = at.parent
    # Swap files already there (zero.Init's parameter shards, an earlier run's files) are
    # rewritten in place, so their space is the plan's too, as SwapDirectory.require_free counts it.
    free = shutil.disk_usage(at).free + _swap_bytes(Path(path) / "terascale_swap")
    limits = [Limit(int(free / local_ranks), f"free space at {path}")]
    if cap is not None:
        limits.append(Limit(int(cap / local_ranks), "planner.disk_space"))
    return min(limits, key=lambda lim: lim.bytes)


def disk_speed(path: str | os.PathLike | None) -> tuple[float | None, str]:
    """(bytes/s, where it came from) of the NVMe path: the aio probe's kept measurement,
    else a 64 MiB rewrite-and-read timed once per device and kept (see [Note: machine limits])."""
    if path is None or not Path(path).is_dir():
        return None, "no NVMe path"
    home = Path(path) / "terascale_swap"
    device = os.stat(path).st_dev
    try:
        entries = json.loads((home / "aio_probe.json").read_text())
        best = max(row["GB/s"] for entry in entries if entry["key"]["device"] == device for row in entry["measured"])
        return best * 1e9, "the aio probe's measurement"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cache = home / _DISK_CACHE
    try:
        entry = json.loads(cache.read_text())
        if entry.get("device") == device:
            return float(entry["bytes_per_s"]), "measured at first use (plan_disk.json)"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        speed = _measure_disk(home)
    except (OSError, RuntimeError) as err:  # no threads or memory to spare (a tight ulimit -v): unknown
        return None, f"not measured ({type(err).__name__}: {err})"
    try:
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"device": device, "bytes_per_s": speed, "when": time.strftime("%Y-%m-%d %H:%M:%S")}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return speed, "measured now (64 MiB rewrite and read)"


def _measure_disk(home: Path) -> float:
    """Bytes/s of writing then reading ``_DISK_PROBE_BYTES`` through the I/O engine."""
    from terascale.offload.aio import AioOptions, AsyncIO
    from terascale.offload.host_buffers import aligned_empty

    home.mkdir(parents=True, exist_ok=True)
    path = home / f"plan_disk_{os.getpid()}.bin"
    buf = aligned_empty(_DISK_PROBE_BYTES, torch.uint8)
    buf.fill_(0x5A)
    try:
        with AsyncIO(AioOptions()) as aio:
            aio.sync_write(buf, path)  # lay the file out; the timed pass rewrites it
            start = time.perf_counter()
            aio.sync_write(buf, path)
            aio.sync_read(buf, path)
            elapsed = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return 2 * _DISK_PROBE_BYTES / max(elapsed, 1e-6)


def measure_machine(
    *,
    device_type: str,
    world: int,
    local_ranks: int,
    local_rank: int = 0,
    nvme_path: str | os.PathLike | None = None,
    host_cap: int | None = None,
    device_cap: int | None = None,
    disk_cap: int | None = None,
    disk_bandwidth: float | None = None,
    measure_disk: bool = True,
) -> Machine:
    """This rank's :class:`Machine` now. ``disk_bandwidth`` (GB/s) skips measuring the disk;
    ``measure_disk=False`` leaves its speed unknown (a check that needs no timing)."""
    rss = psutil.Process().memory_info().rss
    local_ranks = max(1, local_ranks)
    if disk_bandwidth is not None:
        speed, source = disk_bandwidth * 1e9, "planner.disk_bandwidth"
    elif measure_disk:
        speed, source = disk_speed(nvme_path)
    else:
        speed, source = None, "not measured"
    return Machine(
        device_type=device_type,
        world=world,
        local_ranks=local_ranks,
        rss=rss,
        host=host_limit(local_ranks, rss, host_cap),
        device=device_limit(device_type, device_cap, local_rank),
        disk=disk_limit(nvme_path, local_ranks, disk_cap),
        disk_path=None if nvme_path is None else str(nvme_path),
        disk_speed=speed,
        disk_speed_source=source,
        link_bandwidth=_LINK_BANDWIDTH.get(device_type, _LINK_BANDWIDTH["cpu"]),
        cores=max(1, torch.get_num_threads()),
    )


def emulated(machine: Machine, *, host: int | None = None, device: int | None = None, disk: int | None = None) -> Machine:
    """``machine`` with smaller limits per rank (for ``terascale plan`` and tests)."""
    out = machine
    if host is not None and host < out.host.bytes:
        out = replace(out, host=Limit(host, "the given host memory"))
    if device is not None and (out.device is None or device < out.device.bytes):
        out = replace(out, device=Limit(device, "the given device memory"))
    if disk is not None and (out.disk is None or disk < out.disk.bytes):
        out = replace(out, disk=Limit(disk, "the given disk space"))
    return out


def _swap_bytes(swap: Path) -> int:
    """Bytes of the swap files under ``swap``. Other ranks' engines create and remove their
    folders there meanwhile (one closing while this one starts): what vanishes counts 0."""
    held = 0
    for folder, _, files in os.walk(swap):  # os.walk skips a folder that vanished; rglob raises
        for name in files:
            if name.endswith(".swp"):
                try:
                    held += os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:
                    pass
    return held
