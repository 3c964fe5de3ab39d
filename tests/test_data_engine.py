"""The data position through the engine: killed runs resume on the same or another world size
and consume exactly the undisturbed run's global sample sequence (real ranks, gloo).

The oracle is the definition of the order ([Note: the global sample order]): position p of
training is sample ``SampleOrder(n, seed)(p)``. Every run records, for each micro-batch it
trained on, the global position of its first sample and the token ids; the records of an
undisturbed run and of every chain of killed-and-resumed runs must each cover positions
0 .. STEPS * GLOBAL_BATCH exactly once with those samples' ids.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_ranks
from terascale.data import PackedSamples, SampleOrder, prepare

STEPS, GLOBAL_BATCH, MICRO, SEQ = 12, 8, 2, 8


def _config() -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 16)
        self.head = torch.nn.Linear(16, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(input_ids))
        return torch.nn.functional.cross_entropy(logits.view(-1, 256), labels.view(-1), ignore_index=-100)


def _train(data: str, resume: str | None, save: str | None, until: int) -> list[tuple[int, list[list[int]]]]:
    """Train to step ``until`` from ``resume`` (a checkpoint, or the start); save at ``until``
    to ``save``; then read one more micro-batch and run its forward, as a run killed in the
    next step would have, and stop without saving."""
    import terascale

    torch.manual_seed(0)
    engine, _, loader, _ = terascale.initialize(model=_TinyLM(), config=_config(), training_data=PackedSamples(data, SEQ))
    if resume is not None:
        engine.load_checkpoint(resume)
    rank, micro = engine.dist.dp_rank, engine.micro_batch_size
    records = []
    batches = iter(loader)

    def next_batch():
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:  # the epoch ended: the next pass is the next epoch
            batches = iter(loader)
            return next(batches)

    while engine.global_steps < until:
        position = loader.position
        batch = next_batch()
        records.append((position + rank * micro, batch["input_ids"].tolist()))
        engine.backward(engine(batch["input_ids"], batch["labels"]))
        engine.step()
    if save is not None:
        engine.save_checkpoint(save)
    if until < STEPS:
        batch = next_batch()  # read and computed on, never saved: the kill loses it
        engine(batch["input_ids"], batch["labels"])
    engine.destroy()
    return records


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    (folder / "src").mkdir()
    for k in range(12):  # ~300 tokens: 37 samples of 8 + 1, so the 12 steps cross two epochs mid-step
        (folder / "src" / f"{k:02d}.txt").write_bytes(bytes(rng.integers(32, 127, size=int(rng.integers(10, 40)),
                                                                            dtype=np.uint8)))  # fmt: skip
    prepare([folder / "src"], folder / "ds", workers=1, progress=False)
    return str(folder / "ds")


def _expected(data: str) -> dict[int, list[int]]:
    packed = PackedSamples(data, SEQ)
    order = SampleOrder(len(packed), seed=0)
    return {p: packed[int(order(np.array([p]))[0])]["input_ids"].tolist() for p in range(STEPS * GLOBAL_BATCH)}


def _consumed(runs: list[list[list[tuple[int, list[list[int]]]]]]) -> dict[int, list[int]]:
    """Position -> token ids over every rank of every run (a position consumed twice fails)."""
    out: dict[int, list[int]] = {}
    for ranks in runs:
        for records in ranks:
            for first, ids in records:
                for k, sample in enumerate(ids):
                    assert first + k not in out, f"position {first + k} consumed twice"
                    out[first + k] = sample
    return out


def test_an_undisturbed_run_reads_the_global_order(data):
    n = len(PackedSamples(data, SEQ))
    assert STEPS * GLOBAL_BATCH > 2 * n and n % GLOBAL_BATCH, "the run must cross epochs in the middle of a step"
    assert _consumed([run_ranks(_train, 2, data, None, None, STEPS)]) == _expected(data)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_run_killed_at_a_random_step_resumes_on_the_next_samples(data, tmp_path, world):
    kill = random.Random(world).randrange(1, STEPS)
    first = run_ranks(_train, world, data, None, str(tmp_path / "ckpt"), kill)
    rest = run_ranks(_train, world, data, str(tmp_path / "ckpt"), None, STEPS)
    assert _consumed([first, rest]) == _expected(data), f"killed after step {kill}"


def test_resumes_across_world_sizes_two_one_four(data, tmp_path):
    k1, k2 = sorted(random.Random(7).sample(range(1, STEPS), 2))
    a = run_ranks(_train, 2, data, None, str(tmp_path / "a"), k1)
    b = run_ranks(_train, 1, data, str(tmp_path / "a"), str(tmp_path / "b"), k2)
    c = run_ranks(_train, 4, data, str(tmp_path / "b"), None, STEPS)
    assert _consumed([a, b, c]) == _expected(data), f"2 ranks to step {k1}, 1 to {k2}, 4 to {STEPS}"


def test_a_checkpoint_of_other_data_is_refused(data, tmp_path):
    run_ranks(_train, 1, data, None, str(tmp_path / "ckpt"), 2)
    other = Path(data).parent / "other"
    (other / "src").mkdir(parents=True)
    (other / "src" / "x.txt").write_bytes(bytes(range(32, 127)) * 4)
    prepare([other / "src"], other / "ds", workers=1, progress=False)
    with pytest.raises(AssertionError, match="for another dataset"):
        run_ranks(_train, 1, str(other / "ds"), str(tmp_path / "ckpt"), None, 3)
