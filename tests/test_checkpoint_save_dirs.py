"""Ranks that pass different checkpoint directories ([Note: ranks that pass different
directories]): DeepSpeed's HelloDeepSpeed example names its experiment folder on each rank
(only rank 0 creates it) and saves there on every rank. The checkpoint must be one whole
folder in rank 0's directory, rank 0 must warn naming the others, and both resumes such a
script makes (rank 0's directory on every rank; each rank its own again) must continue the
unbroken run exactly (real ranks, gloo)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from distributed import run_ranks
from test_checkpoint import STEPS, SAVE_AT, _engine, _train
from toy import make_data


def _per_rank_dirs_rank(root: str) -> dict:
    rank = int(os.environ["RANK"])
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    catch = Catch(logging.WARNING)
    logging.getLogger("terascale").addHandler(catch)
    x, y = make_data(STEPS, 8)
    own = Path(root) / f"exp.rank{rank}"  # rank 1's folder is never created, as in the script
    if rank == 0:
        own.mkdir()

    torch.manual_seed(0)
    engine = _engine(2, 2)
    whole = _train(engine, x, y, range(STEPS))
    engine.destroy()

    torch.manual_seed(0)
    engine = _engine(2, 2)
    first = _train(engine, x, y, range(SAVE_AT))
    engine.save_checkpoint(own, client_state={"checkpoint_step": SAVE_AT})
    engine.save_checkpoint(own, tag="again")  # a second save: warned once
    engine.destroy()

    resumed = {}
    for how, load_dir in (("rank 0's dir", Path(root) / "exp.rank0"), ("own dir", own)):
        engine = _engine(2, 2, seed=7)
        _, client = engine.load_checkpoint(load_dir, tag=f"global_step{SAVE_AT}")
        assert client == {"checkpoint_step": SAVE_AT}, (how, client)
        resumed[how] = first + _train(engine, x, y, range(SAVE_AT, STEPS))
        engine.destroy()
    logging.getLogger("terascale").removeHandler(catch)
    return {"whole": whole, "resumed": resumed, "warnings": said}


def test_ranks_that_pass_different_save_dirs_get_one_checkpoint_in_rank0s(tmp_path):
    results = run_ranks(_per_rank_dirs_rank, 2, str(tmp_path))
    rank0 = tmp_path / "exp.rank0"
    assert not (tmp_path / "exp.rank1").exists()
    assert sorted(p.name for p in rank0.iterdir() if not p.name.startswith(".")) == ["again", f"global_step{SAVE_AT}", "latest"]
    files = sorted(p.name for p in (rank0 / f"global_step{SAVE_AT}").iterdir())
    assert [f for f in files if f.endswith(".safetensors")] == ["rank00000-of-00002.safetensors",
                                                                "rank00001-of-00002.safetensors"]
    for r in results:
        for how, losses in r["resumed"].items():
            assert losses == r["whole"], (how, r["whole"], losses)
    saves = [w for w in results[0]["warnings"] if w.startswith("save_checkpoint: the ranks passed different")]
    loads = [w for w in results[0]["warnings"] if w.startswith("load_checkpoint: the ranks passed different")]
    assert len(saves) == 1 and str(tmp_path / "exp.rank1") in saves[0] and str(rank0) in saves[0], saves
    assert len(loads) == 1 and "rank 1:" in loads[0], loads  # only the own-dir resume differs
    assert not [w for w in results[1]["warnings"] if "different directories" in w]
