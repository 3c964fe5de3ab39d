"""Worker launched by tests/test_launcher.py through `terascale run`.

Initialises torch.distributed (gloo) from the environment torchrun sets,
all-reduces ``rank + 1`` and writes what it saw to ``OUT_DIR/rank<R>.json``.
Usage: allreduce_worker.py OUT_DIR [extra args recorded verbatim...]
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    record = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "result": value.item(),
        "argv": sys.argv[2:],
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
