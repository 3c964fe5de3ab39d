"""Samples, blends and the global sample order: boundaries, proportions, world-size independence.

The oracles: the token stream itself (packed samples tile it), the definition of the
order (each epoch a bijection), the weights (every prefix of a blend), and a single
replica reading the whole order (every world size reads the same global batches).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from terascale.data import Blend, DocumentSamples, GlobalBatches, PackedSamples, Permutation, SampleOrder, prepare


def _dataset(folder: Path, lengths: list[int], seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    src = folder / "src"
    src.mkdir(parents=True)
    for k, n in enumerate(lengths):
        (src / f"{k:04d}.txt").write_bytes(bytes(rng.integers(97, 123, size=n, dtype=np.uint8)))
    prepare([src], folder / "ds", workers=1, unit_bytes=500, progress=False)
    return folder / "ds"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_each_epoch_is_a_permutation_and_epochs_and_seeds_differ(n):
    orders = [Permutation(n, seed, epoch)(np.arange(n)) for seed, epoch in ((0, 0), (0, 1), (1, 0))]
    for o in orders:
        assert np.array_equal(np.sort(o), np.arange(n))
    if n >= 64:
        assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[0], orders[2])
    # Positions map to (epoch, permutation of that epoch), asked in any chunks.
    order = SampleOrder(n, seed=7)
    whole = order(np.arange(3 * n))
    assert np.array_equal(whole[n : 2 * n], Permutation(n, 7, 1)(np.arange(n)))
    assert np.array_equal(np.concatenate([order(np.arange(k, min(k + 5, 3 * n))) for k in range(0, 3 * n, 5)]), whole)


def test_packed_samples_tile_the_stream_and_mark_document_starts(tmp_path):
    lengths = [5, 17, 1, 40, 3, 60, 9]
    packed = PackedSamples(_dataset(tmp_path, lengths), 8)
    store = packed.store
    stream = store.tokens(0, store.num_tokens)
    assert len(packed) == (sum(lengths) - 1) // 8
    starts = set(np.cumsum(lengths)[:-1].tolist())
    for i in range(len(packed)):
        s = packed[i]
        lo = i * 8
        assert torch.equal(s["input_ids"], torch.from_numpy(stream[lo : lo + 8]))
        for j in range(8):
            nxt = lo + j + 1
            assert s["labels"][j] == (-100 if nxt in starts else stream[nxt])
            last_start = max([lo] + [t for t in starts if lo < t <= lo + j])
            assert s["position_ids"][j] == lo + j - last_start
    same = PackedSamples(store, 8, labels="same")[1]
    assert torch.equal(same["position_ids"], packed[1]["position_ids"])
    assert same["labels"].tolist() == [-100 if 8 + j in starts else int(stream[8 + j]) for j in range(8)]
    plain = PackedSamples(store, 8, boundaries=False)[1]
    assert plain["position_ids"].tolist() == list(range(8)) and plain["labels"].tolist() == stream[9:17].tolist()


def test_document_samples_cut_and_pad(tmp_path):
    docs = DocumentSamples(_dataset(tmp_path, [5, 1, 30, 12]), 10, pad_id=0)
    assert len(docs) == 3  # the one-token document makes no next-token sample
    short = docs[0]
    assert short["attention_mask"].tolist() == [1] * 4 + [0] * 6
    assert short["labels"].tolist()[4:] == [-100] * 6 and short["input_ids"].tolist()[4:] == [0] * 6
    long = docs[1]
    stream = docs.store.tokens(*docs.store.document(2))
    assert long["input_ids"].tolist() == stream[:10].tolist() and long["labels"].tolist() == stream[1:11].tolist()


def test_a_blend_holds_its_weights_in_every_prefix_and_walks_each_dataset_through(tmp_path):
    parts = [PackedSamples(_dataset(tmp_path / name, [400] * k, seed=k), 16) for k, name in ((1, "a"), (3, "b"), (6, "c"))]
    weights = [0.5, 0.3, 0.2]
    blend = Blend(parts, weights, size=10_000, seed=3)
    which = np.array([blend.source(i)[0] for i in range(10_000)])
    counts = np.zeros(3)
    for j, d in enumerate(which):
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(weights) * (j + 1)) <= 1.0), j
    assert np.allclose(np.bincount(which) / 10_000, weights, atol=0.001)
    # Dataset a (24 samples) is drawn ~5000 times: every sample before any repeats.
    draws = [blend.source(i)[1] for i in np.flatnonzero(which == 0)]
    n = len(parts[0])
    for epoch in range(len(draws) // n):
        assert sorted(draws[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert torch.equal(blend[5]["input_ids"], parts[blend.source(5)[0]][blend.source(5)[1]]["input_ids"])
    with pytest.raises(ValueError, match=r"sum to 1.1, not 1"):
        Blend(parts, [0.5, 0.3, 0.3])
    with pytest.raises(ValueError, match="positive"):
        Blend(parts, [1.2, -0.1, -0.1])


def _global_sequence(loaders: list[GlobalBatches], micro_steps: int) -> list[list[int]]:
    """Each micro-step's samples, replicas in rank order (what the job consumed)."""
    its = [iter(lo) for lo in loaders]
    out = []
    for _ in range(micro_steps):
        step = []
        for k, lo in enumerate(loaders):
            try:
                batch = next(its[k])
            except StopIteration:
                its[k] = iter(lo)
                batch = next(its[k])
            step.extend(batch["input_ids"][:, 0].tolist())  # a packed sample's first token names it
        out.append(step)
    return out


def test_every_world_size_reads_the_same_global_batches_and_each_epoch_once(tmp_path):
    packed = PackedSamples(_dataset(tmp_path, [50] * 40), 4)  # 499 samples: epochs straddle micro-steps
    n = len(packed)
    first_token = {i: int(packed[i]["input_ids"][0]) for i in range(n)}
    order = SampleOrder(n, seed=5)
    expected = [first_token[int(i)] for i in order(np.arange(8 * 200))]
    for world, micro in ((1, 8), (2, 4), (4, 2), (8, 1)):
        loaders = [GlobalBatches(packed, micro, rank=r, world=world, seed=5, num_workers=r % 2) for r in range(world)]
        got = [t for step in _global_sequence(loaders, 200) for t in step]
        assert got == expected, world
        assert loaders[0].position == 8 * 200 and loaders[0].epoch == 3
    # Within an epoch no sample repeats or goes missing (by index, not just first token).
    idx = order(np.arange(n))
    assert sorted(idx.tolist()) == list(range(n))


def test_a_position_saved_on_one_world_resumes_on_another(tmp_path):
    packed = PackedSamples(_dataset(tmp_path, [30] * 30), 4)
    whole = _global_sequence([GlobalBatches(packed, 8, seed=1)], 90)
    loaders = [GlobalBatches(packed, 4, rank=r, world=2, seed=1) for r in range(2)]
    part = _global_sequence(loaders, 30)
    for world, micro, steps in ((1, 8, 25), (4, 2, 35)):  # 2 -> 1 -> 4 replicas, global batch 8
        state = loaders[0].state_dict()
        loaders = [GlobalBatches(packed, micro, rank=r, world=world, seed=1) for r in range(world)]
        for lo in loaders:
            lo.load_state_dict(state)
        part += _global_sequence(loaders, steps)
    assert part == whole
    other = GlobalBatches(packed, 7, seed=1)
    with pytest.raises(ValueError, match="not a whole number of micro-steps of 1 replicas x 7"):
        other.load_state_dict(loaders[0].state_dict())
    with pytest.raises(ValueError, match="for another dataset"):
        GlobalBatches(PackedSamples(packed.store, 5), 8, seed=1).load_state_dict(loaders[0].state_dict())
    with pytest.raises(ValueError, match="seed 1"):
        GlobalBatches(packed, 8, seed=2).load_state_dict(loaders[0].state_dict())


def test_the_loader_counts_what_it_hands_out_not_what_it_read_ahead(tmp_path):
    packed = PackedSamples(_dataset(tmp_path, [30] * 30), 4)
    loader = GlobalBatches(packed, 2, num_workers=1, prefetch_factor=4)
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert loader.position == 6  # workers hold more, read ahead
    resumed = GlobalBatches(packed, 2)
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(iter(resumed))["input_ids"], next(it)["input_ids"])
    assert loader.wait_seconds > 0
    # A loop that leaves an epoch early and moves to the next one, as with a DistributedSampler.
    threes = GlobalBatches(packed, 3)
    next(iter(threes))
    threes.set_epoch(1)  # rounded down to whole micro-steps: no sample of epoch 1 is skipped
    assert len(packed) % 3 and threes.position == len(packed) // 3 * 3
    next(iter(threes))
    threes.set_epoch(0)  # never back
    assert threes.position == len(packed) // 3 * 3 + 3


def test_an_iteration_in_progress_follows_a_reshape_and_a_position_moved_back(tmp_path):
    """A live resize ([Note: membership epochs]): the loop's own iterator goes on from the
    position the resize set, as the replica and micro-batch the new world gives."""
    packed = PackedSamples(_dataset(tmp_path, [30] * 30), 4)
    whole = [b["input_ids"] for b in _take(iter(GlobalBatches(packed, 8, seed=1, num_workers=0)), 12)]
    loader = GlobalBatches(packed, 8, seed=1, num_workers=1)
    it = iter(loader)
    got = [next(it)["input_ids"] for _ in range(5)]
    back = loader.state_dict() | {"global_sample": 8 * 4}  # the resize restored step 4: step 5 again
    loader.reshape(0, 2, 4)  # replica 0 of 2, micro-batch 4: rows 0-3 of each global batch
    loader.load_state_dict(back)
    halves = [next(it)["input_ids"] for _ in range(3)]
    assert all(torch.equal(g, w) for g, w in zip(got, whole))
    assert all(torch.equal(h, w[:4]) for h, w in zip(halves, whole[4:]))
    assert loader.position == 8 * 4 + 3 * 8 and loader.batch_size == 4
    with pytest.raises(ValueError, match="rank 2 of 2"):
        loader.reshape(2, 2, 4)


def _take(it, n):
    return [next(it) for _ in range(n)]
