"""Worker launched by tests/test_launcher.py through `terascale run`.

Initialises torch.distributed (gloo) from the environment torchrun sets,
all-reduces ``rank + 1`` and writes what it saw to ``OUT_DIR/rank<R>.json``: also the
``--local_rank=N`` the launcher put first (DeepSpeed's launcher does), the CPUs the
process may run on and its thread counts.
Usage: allreduce_worker.py [--local_rank=N] OUT_DIR [extra args recorded verbatim...]
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    args = sys.argv[1:]
    local_rank_arg = args.pop(0) if args and args[0].startswith("--local_rank=") else None
    out_dir = Path(args[0])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    record = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "result": value.item(),
        "argv": args[1:],
        "local_rank_arg": local_rank_arg,
        "cpus": sorted(os.sched_getaffinity(0)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "marker": os.environ.get("TS_TEST_MARKER"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "fake_host": os.environ.get("FAKE_SSH_HOST"),
    }
    tmp = out_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(out_dir / f"rank{rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
