"""A one-rank terascale job for the lease tests: ``lease_job.py SAVE_DIR OUT [--steps N]``.

Initializes an engine with ``checkpoint.save_dir`` (which takes the directory's lease),
writes ``OUT/started`` (its pid), then per step trains one step, saves a checkpoint and
appends the result to ``OUT/log.jsonl``; between steps it waits while ``OUT/hold``
exists (``--pause-after N`` creates it after step N), so the test decides when it goes on. An error is written to ``OUT/error`` (its
type and message) and the exit code is 3. Short lease timings (heartbeat 0.2 s, expiry 1 s)
keep the tests quick.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

import terascale

save_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 3
pause_after = int(sys.argv[sys.argv.index("--pause-after") + 1]) if "--pause-after" in sys.argv else None
config = {
    "train_batch_size": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "checkpoint": {"save_dir": str(save_dir), "lease": {"heartbeat_s": 0.2, "expiry_s": 1.0}},
}
torch.manual_seed(0)
try:
    engine, *_ = terascale.initialize(model=torch.nn.Linear(4, 1), config=config)
    (out / "started").write_text(str(os.getpid()))
    for step in range(1, steps + 1):
        while (out / "hold").exists():
            time.sleep(0.05)
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
        tag = engine.save_checkpoint(save_dir)
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "pid": os.getpid()}) + "\n")
        if step == pause_after:
            (out / "hold").touch()
    engine.destroy()
except Exception as exc:  # noqa: BLE001 - the test reads what happened
    (out / "error").write_text(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
