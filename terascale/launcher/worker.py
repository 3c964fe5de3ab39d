"""What ``terascale run`` does in each rank's process before the script: cores and ``--local_rank``.

[Note: the rank shim]
torchrun starts every rank the same way, so what differs per rank is done here, in the
rank's own process: torchrun runs ``python -m terascale.launcher.worker [options] SCRIPT
ARGS...``, which reads ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the environment torchrun
set, then

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

and replaces itself (``exec``) with ``python -u SCRIPT ...`` (``-m`` for a module): the
script runs as torchrun would have run it, in the same process, which torchrun watches.
The affinity carries over ``exec``; this module imports neither torch nor anything that
starts threads, so ``OMP_NUM_THREADS`` is in place before any OpenMP runtime reads it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from terascale.launcher.cores import bind_cores

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m terascale.launcher.worker", allow_abbrev=False,
                                description="Run by terascale run in each rank: see [Note: the rank shim].")
    p.add_argument("--local_rank_arg", action="store_true", help="pass --local_rank=N to the script")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="pin to this rank's share of the cores")
    p.add_argument("--bind_core_list", default=None, help="the cores to share out (default: every physical core)")
    p.add_argument("--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        raise SystemExit("terascale.launcher.worker runs under terascale run (torchrun sets LOCAL_RANK)") from None
    if args.bind_cores_to_rank:
        try:
            bind_cores(args.bind_core_list, local_world_size, local_rank)
        except ValueError as exc:
            raise SystemExit(f"terascale run: error: {exc}") from None
    command = [sys.executable, "-u", *(["-m"] if args.module else []), args.script]
    if args.local_rank_arg:
        command.append(f"--local_rank={local_rank}")
    command += args.script_args
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
