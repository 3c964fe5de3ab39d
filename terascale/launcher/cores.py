"""Which cores each rank of a node takes, and the command line of the rank shim.

Pure functions (no torch, no threads) used by ``terascale run`` to check its options and
by the shim itself (see [Note: the rank shim] in :mod:`terascale.launcher.worker`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["bind_cores", "parse_core_list", "rank_cores", "usable_cores", "worker_args"]


def parse_core_list(spec: str) -> list[int]:
    """``"1,3-5,7"`` as ``[1, 3, 4, 5, 7]`` (DeepSpeed's ``--bind_core_list`` syntax: single
    cores and inclusive ranges, ascending, not overlapping). Raises ValueError naming the
    bad part."""
    cores: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"--bind_core_list {spec!r}: {part!r} is not a core number or a range like 4-7") from None
        if first < 0 or last < first:
            raise ValueError(f"--bind_core_list {spec!r}: {part!r} is not a range from a lower to a higher core")
        if cores and first <= cores[-1]:
            raise ValueError(f"--bind_core_list {spec!r}: list the cores in ascending order without overlaps")
        cores.extend(range(first, last + 1))
    return cores


def usable_cores(cpus: Sequence[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """The CPUs this process may run on (``cpus``: default its affinity), one per physical
    core: of hyperthreads sharing a core only the lowest-numbered is kept (DeepSpeed counts
    physical cores too: one OpenMP thread per core). Where the topology cannot be read,
    every CPU counts."""
    allowed = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    kept: dict[tuple[str, str], int] = {}
    for cpu in allowed:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            return allowed
        kept.setdefault(key, cpu)
    return sorted(kept.values())


def rank_cores(cores: Sequence[int], local_world_size: int, local_rank: int) -> list[int]:
    """Local rank ``local_rank``'s equal share of ``cores`` (see [Note: the rank shim]).
    Raises ValueError when there is less than one core per rank."""
    per_rank = len(cores) // local_world_size
    if per_rank < 1:
        raise ValueError(
            f"--bind_cores_to_rank: {len(cores)} core(s) ({_ranges(cores)}) cannot give each of the "
            f"{local_world_size} processes of this node one; start fewer processes or list more cores "
            "with --bind_core_list"
        )
    return list(cores[per_rank * local_rank : per_rank * (local_rank + 1)])


def _ranges(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    out: list[str] = []
    for core in cores:
        if out and core == int(out[-1].rpartition("-")[2]) + 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{core}"
        else:
            out.append(str(core))
    return ",".join(out)


def bind_cores(core_list: str | None, local_world_size: int, local_rank: int) -> list[int]:
    """Pin this process to its cores and set ``OMP_NUM_THREADS``; returns the cores."""
    available = set(os.sched_getaffinity(0))
    cores = parse_core_list(core_list) if core_list else usable_cores()
    missing = sorted(set(cores) - available)
    if missing:
        raise ValueError(
            f"--bind_core_list: core(s) {_ranges(missing)} are not available to this process (it may run on "
            f"{_ranges(sorted(available))})"
        )
    mine = rank_cores(cores, local_world_size, local_rank)
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    return mine


def worker_args(script: str, script_args: Sequence[str], *, module: bool, local_rank_arg: bool,
                bind: bool, core_list: str | None, no_python: bool = False,
                rank_log: str | None = None) -> list[str]:  # fmt: skip
    """The arguments of ``python -m terascale.launcher.worker`` for these choices."""
    args = []
    if local_rank_arg:
        args.append("--local_rank_arg")
    if bind:
        args.append("--bind_cores_to_rank")
    if core_list is not None:
        args.append(f"--bind_core_list={core_list}")
    if module:
        args.append("--module")
    if no_python:
        args.append("--no_python")
    if rank_log is not None:
        args.append(f"--rank_log={rank_log}")
    return [*args, script, *script_args]
