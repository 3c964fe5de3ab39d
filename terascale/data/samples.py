"""Training samples over a token dataset: fixed-length packed windows, or one document each.

Both are map-style ``torch.utils.data.Dataset``s of dicts of tensors (what Hugging Face
models and the Trainer take, and what ``initialize(training_data=...)`` orders globally,
[Note: the global sample order]):

- :class:`PackedSamples`: sample i is the tokens ``[i*L, i*L + L + 1)`` of the whole
  dataset (documents back to back, across shards), so no token is padding. Document
  boundaries stay visible to the model: ``position_ids`` restart at 0 where a document
  starts (Hugging Face's packed-sequence convention, ``DataCollatorWithFlattening``, that
  its flash-attention models read as "attend within the document"), and the prediction
  that would cross into the next document is masked (label -100).
- :class:`DocumentSamples`: sample i is document i (empty documents skipped), cut to L
  tokens or padded to L, with an ``attention_mask`` and labels -100 on the padding.

``labels="next"`` (the default) gives next-token targets (``labels[j]`` is token j+1, for
models that take targets as they are, like the demo GPT); ``labels="same"`` gives
Hugging Face's causal-LM convention (``labels`` aligned with ``input_ids``, the model
shifts them).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from terascale.data.shards import TokenStore

IGNORE = -100
Labels = Literal["next", "same"]


def _store(data: TokenStore | str | os.PathLike[str]) -> TokenStore:
    return data if isinstance(data, TokenStore) else TokenStore(data)


def _check(seq_len: int, labels: str) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if labels not in ("next", "same"):
        raise ValueError(f"labels must be 'next' (next-token targets) or 'same' (Hugging Face's), got {labels!r}")


class PackedSamples(Dataset):
    """``seq_len``-token windows over all documents back to back (see the module's docstring)."""

    def __init__(self, data: TokenStore | str | os.PathLike[str], seq_len: int, *, labels: Labels = "next",
                 boundaries: bool = True) -> None:  # fmt: skip
        _check(seq_len, labels)
        self.store = _store(data)
        self.seq_len, self.labels, self.boundaries = seq_len, labels, boundaries
        self._len = (self.store.num_tokens - 1) // seq_len
        if self._len < 1:
            raise ValueError(f"{self.store.folder}: {self.store.num_tokens} tokens make no sample of {seq_len} + 1")

    def __len__(self) -> int:
        return self._len

    def fingerprint(self) -> list[Any]:
        return ["packed", self.seq_len, self.labels, self.boundaries, self.store.fingerprint()]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} of {self._len}")
        L = self.seq_len
        start = i * L
        x = self.store.tokens(start, start + L + 1)
        bounds = self.store.doc_bounds
        if self.boundaries:
            lo, hi = np.searchsorted(bounds, [start + 1, start + L + 1])
            starts = bounds[lo:hi] - start  # document starts inside the window, relative to it (≥ 1)
        else:
            starts = np.empty(0, np.int64)
        j = np.arange(L)
        seg_base = np.concatenate([[0], starts])[np.searchsorted(starts, j, side="right")]
        position_ids = j - seg_base
        if self.labels == "next":
            labels = x[1:].copy()
            labels[starts - 1] = IGNORE  # token starts-1 would predict the next document's first
        else:
            labels = x[:L].copy()
            labels[starts[starts < L]] = IGNORE  # the model shifts: this label is predicted across the boundary
        return {
            "input_ids": torch.from_numpy(x[:L].copy()),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
        }


class DocumentSamples(Dataset):
    """One document per sample, cut or padded to ``seq_len`` with ``pad_id`` (see the module's docstring)."""

    def __init__(self, data: TokenStore | str | os.PathLike[str], seq_len: int, *, pad_id: int = 0,
                 labels: Labels = "next") -> None:  # fmt: skip
        _check(seq_len, labels)
        self.store = _store(data)
        self.seq_len, self.pad_id, self.labels = seq_len, pad_id, labels
        lengths = np.diff(self.store.doc_bounds)
        self._docs = np.flatnonzero(lengths > (1 if labels == "next" else 0))
        if not len(self._docs):
            raise ValueError(f"{self.store.folder}: no document long enough to make a sample")

    def __len__(self) -> int:
        return len(self._docs)

    def fingerprint(self) -> list[Any]:
        return ["documents", self.seq_len, self.labels, self.pad_id, self.store.fingerprint()]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        lo, hi = self.store.document(int(self._docs[i]))
        L = self.seq_len
        take = L + 1 if self.labels == "next" else L
        x = self.store.tokens(lo, min(hi, lo + take))
        if self.labels == "next":
            ids, targets = x[:-1], x[1:]
        else:
            ids, targets = x, x
        n = len(ids)
        input_ids = np.full(L, self.pad_id, np.int64)
        input_ids[:n] = ids
        labels = np.full(L, IGNORE, np.int64)
        labels[:n] = targets
        mask = np.zeros(L, np.int64)
        mask[:n] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(mask),
            "position_ids": torch.arange(L),
        }
