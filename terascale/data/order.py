"""The global sample order: which sample is the g-th of training, from the seed and g alone.

[Note: the global sample order]
Training consumes one endless sequence of samples: position g of it is sample
``perm(seed, epoch)(g % n)`` of an n-sample dataset, ``epoch = g // n``, where ``perm`` is a
pseudo-random bijection of ``[0, n)``. Nothing in it depends on the world size, ranks or
loader workers: they only decide who reads which positions ([Note: global batches]). So
each epoch is every sample exactly once, and a run that stops after g samples resumes
at position g on any world size.

The bijection is a Feistel network over the smallest even number of bits that covers n,
with round keys drawn from (seed, epoch); a value that falls outside ``[0, n)`` is passed
through the network again until it lands inside ("cycle walking", which keeps it a
bijection of ``[0, n)``). It is computed for just the positions asked for, so the order of
a billion samples costs no memory and no start-up time, and needs no cached index file.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), 0x9E3779B97F4A7C15


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a 64-bit mixing function (uint64 in, uint64 out, wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A pseudo-random bijection of ``[0, n)`` chosen by ``(seed, epoch)`` (see the note)."""

    def __init__(self, n: int, seed: int, epoch: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got n={n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        base = (seed * 0x100000001B3 + epoch * _GOLDEN) & 0xFFFFFFFFFFFFFFFF
        self._keys = _mix(np.arange(1, _ROUNDS + 1, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(base))

    def _network(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, index: np.ndarray | int) -> np.ndarray:
        """The images of ``index`` (values in ``[0, n)``), as int64."""
        x = np.asarray(index, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"permutation of {self.n} elements indexed at {int(x.min())}..{int(x.max())}")
        y = self._network(x.astype(np.uint64))
        outside = y >= np.uint64(self.n)
        while outside.any():
            y[outside] = self._network(y[outside])
            outside = y >= np.uint64(self.n)
        return y.astype(np.int64)


class SampleOrder:
    """Global positions to sample indices of an ``n``-sample dataset: epoch by epoch, each a
    fresh permutation of ``(seed, epoch)`` (``shuffle=False``: the samples in order)."""

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True) -> None:
        if n < 1:
            raise ValueError("the dataset has no samples")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perms: dict[int, Permutation] = {}

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        within = positions % self.n
        if not self.shuffle:
            return within
        epochs = positions // self.n
        out = np.empty_like(within)
        for e in np.unique(epochs):
            here = epochs == e
            out[here] = self._perm(int(e))(within[here])
        return out

    def _perm(self, epoch: int) -> Permutation:
        if epoch not in self._perms:
            if len(self._perms) > 4:  # epochs are consumed in order: keep the last few
                self._perms.pop(min(self._perms))
            self._perms[epoch] = Permutation(self.n, self.seed, epoch)
        return self._perms[epoch]
