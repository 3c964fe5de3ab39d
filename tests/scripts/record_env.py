"""Light worker for the launcher's ssh test: records what torchrun and the launcher passed.

Writes ``OUT_DIR/rank<RANK>.json`` with the rank/world torchrun assigned, the
script arguments and selected environment variables. It imports no torch, so
the test pays only for the torchrun agents.
Usage: record_env.py [--local_rank=N] OUT_DIR [extra args recorded verbatim...]
"""

import json
import os
import sys
from pathlib import Path

args = sys.argv[1:]
local_rank_arg = args.pop(0) if args and args[0].startswith("--local_rank=") else None
out_dir = Path(args[0])
rank = int(os.environ["RANK"])
record = {
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "argv": args[1:],
    "local_rank_arg": local_rank_arg,
    "marker": os.environ.get("TS_TEST_MARKER"),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "fake_host": os.environ.get("FAKE_SSH_HOST"),
    "as_deepspeed": os.environ.get("TERASCALE_AS_DEEPSPEED"),
}
tmp = out_dir / f".rank{rank}.json.tmp"
tmp.write_text(json.dumps(record))
tmp.rename(out_dir / f"rank{rank}.json")
print(f"rank {rank} of {record['world_size']} done", flush=True)
