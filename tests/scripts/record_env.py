"""Light worker for the launcher's ssh test: records what torchrun and the launcher passed.

Writes ``OUT_DIR/rank<RANK>.json`` with the rank/world torchrun assigned, the
script arguments and selected environment variables. It imports no torch, so
the test pays only for the torchrun agents.
Usage: record_env.py OUT_DIR [extra args recorded verbatim...]
"""

import json
import os
import sys
from pathlib import Path

out_dir = Path(sys.argv[1])
rank = int(os.environ["RANK"])
record = {
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "argv": sys.argv[2:],
    "marker": os.environ.get("TS_TEST_MARKER"),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "fake_host": os.environ.get("FAKE_SSH_HOST"),
}
tmp = out_dir / f".rank{rank}.json.tmp"
tmp.write_text(json.dumps(record))
tmp.rename(out_dir / f"rank{rank}.json")
print(f"rank {rank} of {record['world_size']} done", flush=True)
