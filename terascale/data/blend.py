"""Weighted blending of several sample datasets, in exact proportions.

[Note: exact blending]
A :class:`Blend` of datasets ``d`` with weights ``w_d`` (summing to 1) is a dataset of
``size`` samples in which every prefix of j samples holds within one sample of ``w_d * j``
from each ``d``. Its k-th draw from ``d`` is placed at the "ideal time" ``(k + 1/2) / w_d``
and the blend is all draws sorted by that time (ties by dataset), so the proportions are
exact in every window, not just on average; the index is computed once, vectorized, for
``size`` samples. Draw k of ``d`` is sample ``order_d(k)`` of ``d``: the draws walk through
``d`` in an order of its own (seeded per dataset, a fresh permutation each time a small
dataset is repeated), so upsampling repeats a dataset's samples only after all of them
were drawn. The blend is deterministic in its datasets, weights, size and seed; the
global sample order ([Note: the global sample order]) then shuffles the blend itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from terascale.data.order import SampleOrder


class Blend(Dataset):
    """``datasets`` mixed by ``weights`` (see the note); ``size`` samples (default: the
    datasets' total)."""

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], *, size: int | None = None,
                 seed: int = 0) -> None:  # fmt: skip
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"a blend needs one weight per dataset: {len(datasets)} datasets, {len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"blend weights must be positive numbers, got {list(weights)}")
        if not math.isclose(float(w.sum()), 1.0, rel_tol=0, abs_tol=1e-6):
            raise ValueError(
                f"blend weights {list(weights)} sum to {w.sum():.6g}, not 1: give proportions that add up to 1 "
                f"(e.g. {[round(float(x), 6) for x in w / w.sum()]})"
            )
        self.datasets = list(datasets)
        self.weights = w
        self.seed = seed
        self.size = int(size if size is not None else sum(len(d) for d in self.datasets))
        if self.size < 1:
            raise ValueError("a blend needs at least one sample")
        self._orders = [SampleOrder(len(d), seed=seed * 1_000_003 + k + 1) for k, d in enumerate(self.datasets)]
        self._which: np.ndarray | None = None
        self._draw: np.ndarray | None = None

    def __len__(self) -> int:
        return self.size

    def fingerprint(self) -> list[Any]:
        return ["blend", self.size, self.seed, self.weights.tolist(),
                [getattr(d, "fingerprint", lambda: len(d))() for d in self.datasets]]  # fmt: skip

    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        if self._which is None:
            times, which, draws = [], [], []
            for d, weight in enumerate(self.weights):
                count = math.ceil(weight * self.size) + 1
                k = np.arange(count, dtype=np.float64)
                times.append((k + 0.5) / weight)
                which.append(np.full(count, d, np.int32))
                draws.append(np.arange(count, dtype=np.int64))
            t, wh, dr = np.concatenate(times), np.concatenate(which), np.concatenate(draws)
            first = np.lexsort((wh, t))[: self.size]
            self._which, self._draw = wh[first], dr[first]
        assert self._draw is not None
        return self._which, self._draw

    def source(self, i: int) -> tuple[int, int]:
        """Which dataset sample ``i`` of the blend comes from, and its index there."""
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} of a blend of {self.size}")
        which, draw = self._index()
        d = int(which[i])
        return d, int(self._orders[d](np.array([draw[i]]))[0])

    def __getitem__(self, i: int) -> Any:
        d, k = self.source(i)
        return self.datasets[d][k]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_which"] = state["_draw"] = None  # rebuilt where used (a worker), not pickled
        return state
