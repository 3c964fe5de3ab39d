"""What ``terascale run`` does in each rank's process before the script: cores and ``--local_rank``.

[Note: the rank shim]
torchrun starts every rank the same way, so what differs per rank is done here, in the
rank's own process: torchrun runs ``python -m terascale.launcher.worker [options] SCRIPT
ARGS...``, which reads ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the environment torchrun
set (under ``--launcher mpi`` or ``slurm``, the launcher's own variables, read by
:func:`terascale.comm.discovery.local_placement`), then

- with ``--bind_cores_to_rank`` pins the process to its share of the cores
  (``os.sched_setaffinity``; DeepSpeed's launcher runs ``numactl -C`` for the same) and sets
  ``OMP_NUM_THREADS`` to the size of that share, as DeepSpeed's launcher does: the cores
  (``--bind_core_list``, e.g. ``0-15,32-47``, else one logical CPU per physical core of
  those this process may use) are cut into ``LOCAL_WORLD_SIZE`` equal runs in order and
  local rank r takes run r; a remainder stays unused. DeepSpeed also binds memory to the
  cores' NUMA node with ``numactl -m``; here Linux's first-touch policy places a rank's
  memory on the node of the cores it runs on, without numactl;
- with ``--local_rank_arg`` passes ``--local_rank=N`` to the script, first among its
  arguments, as DeepSpeed's launcher does (scripts written for it parse the flag);
- sets ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` in the environment, as torchrun does, where
  mpirun or srun started the rank;
- with ``--rank_log PREFIX`` (DeepSpeed's ``--enable_each_rank_log``) points its stdout and
  stderr at ``PREFIX_rank<global rank>.log``, making the folder, as DeepSpeed's launcher names
  the files;

and replaces itself (``exec``) with ``python -u SCRIPT ...`` (``-m`` for a module; SCRIPT
itself, found on PATH, with ``--no_python``): the script runs as torchrun would have run it,
in the same process, which torchrun watches; the redirected output carries over too.
The affinity carries over ``exec``; this module imports neither torch nor anything that
starts threads, so ``OMP_NUM_THREADS`` is in place before any OpenMP runtime reads it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from terascale.comm.discovery import local_placement, started_by  # imports no torch (see terascale.comm)
from terascale.launcher.cores import bind_cores

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m terascale.launcher.worker", allow_abbrev=False,
                                description="Run by terascale run in each rank: see [Note: the rank shim].")
    p.add_argument("--local_rank_arg", action="store_true", help="pass --local_rank=N to the script")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="pin to this rank's share of the cores")
    p.add_argument("--bind_core_list", default=None, help="the cores to share out (default: every physical core)")
    p.add_argument("--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("--no_python", action="store_true", help="run SCRIPT as an executable")
    p.add_argument("--rank_log", default=None, help="write this rank's output to RANK_LOG_rank<N>.log")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        placement = local_placement(os.environ)
    except ValueError as exc:
        raise SystemExit(f"terascale run: error: {exc}") from None
    if placement is None:
        raise SystemExit("terascale.launcher.worker runs under terascale run (torchrun sets LOCAL_RANK; "
                         "mpirun and srun set their own local rank)")  # fmt: skip
    local_rank, local_world_size = placement
    if args.bind_cores_to_rank:
        if local_world_size is None:
            raise SystemExit("terascale run: error: --bind_cores_to_rank needs the number of processes on this "
                             "node, which the launcher did not say: export LOCAL_WORLD_SIZE")  # fmt: skip
        try:
            bind_cores(args.bind_core_list, local_world_size, local_rank)
        except ValueError as exc:
            raise SystemExit(f"terascale run: error: {exc}") from None
    # As torchrun would have: scripts that pick their device from LOCAL_RANK before
    # initialising anything find it under mpirun and srun too.
    os.environ["LOCAL_RANK"] = str(local_rank)
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    python = [] if args.no_python else [sys.executable, "-u", *(["-m"] if args.module else [])]
    command = [*python, args.script]
    if args.local_rank_arg:
        command.append(f"--local_rank={local_rank}")
    command += args.script_args
    sys.stdout.flush()
    sys.stderr.flush()
    if args.rank_log is not None:
        _redirect_output(args.rank_log)
    if not args.no_python:
        os.execv(sys.executable, command)
    try:
        os.execvp(args.script, command)
    except OSError as exc:
        raise SystemExit(f"terascale run: error: --no_python: cannot run {args.script}: {exc.strerror}") from None


def _redirect_output(prefix: str) -> None:
    """Point fds 1 and 2 at ``PREFIX_rank<global rank>.log`` (exec keeps them)."""
    started = None if "RANK" in os.environ else started_by(os.environ)
    rank = os.environ.get("RANK", "0") if started is None else str(started.rank)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    fd = os.open(f"{prefix}_rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    main()
