"""Token shards on disk: the format ``terascale data prepare`` writes and every reader maps.

[Note: the token dataset format]
A prepared dataset is a folder:

- ``shard-NNNNN.bin``: the token ids of whole documents, back to back, in the manifest's
  ``dtype`` (uint16 for vocabularies up to 65,536 ids, else uint32), no header;
- ``shard-NNNNN.idx``: int64, the end offset (in tokens, within the shard) of each of its
  documents: document k of the shard is ``bin[idx[k-1]:idx[k]]``;
- ``manifest.json``: the tokenizer's identity, the dtype, the totals, and per shard its
  token and document counts and CRC-32s — one per ``block_bytes`` block of the ``.bin``
  and one for the ``.idx`` — so a damaged file is found and named with the offset of the
  block that fails.

Shard k holds the documents of preparation unit k (a run of whole input documents), so
the shards, their order and their contents depend only on the inputs, never on how many
worker processes prepared them. A shard is written under a temporary name and renamed
when complete; the manifest is written last, so a folder with a manifest is a finished
dataset. Readers map the files (``numpy.memmap``): opening costs nothing in the data's
size, and the operating system's page cache is the read cache.

A reader checks at open that every file has the manifest's size (a truncated file names
itself and the offset where it ends) and, by default, each ``.bin`` block's CRC the first
time a read touches it in that process (``verify="lazy"``; ``"full"`` checks all at
open, ``"none"`` skips the CRCs).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from terascale.data.tokenizer import Tokenizer, check_tokenizer

FORMAT = "terascale-tokens"
VERSION = 1
MANIFEST = "manifest.json"
BLOCK_BYTES = 1 << 22  # 4 MiB: a CRC every 4 MiB costs ~1 µs per KiB read once

Verify = Literal["lazy", "full", "none"]


class ShardError(ValueError):
    """A prepared dataset's file is missing, truncated or fails its checksum."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    tokens: int
    documents: int
    bin_crc32: tuple[int, ...]
    idx_crc32: int

    @staticmethod
    def from_json(record: dict[str, Any]) -> ShardInfo:
        """The record as the manifest and the preparation journal hold it (``asdict``)."""
        return ShardInfo(**{**record, "bin_crc32": tuple(record["bin_crc32"])})

    def files(self, folder: Path, dtype: np.dtype) -> tuple[tuple[Path, int], tuple[Path, int]]:
        """The ``.bin`` and ``.idx`` files of this shard in ``folder``, each with its size in bytes."""
        return (
            (folder / f"{self.name}.bin", self.tokens * dtype.itemsize),
            (folder / f"{self.name}.idx", self.documents * 8),
        )


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


class ShardWriter:
    """Writes one shard: documents appended whole, CRCs computed as the bytes go out."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype, block_bytes: int = BLOCK_BYTES) -> None:
        self.folder, self.name, self.dtype, self.block_bytes = folder, name, np.dtype(dtype), block_bytes
        self._bin = open(folder / f"{name}.bin.tmp", "wb")  # noqa: SIM115 - closed in close()
        self._ends: list[int] = []
        self._tokens = 0
        self._crcs: list[int] = []
        self._crc = 0
        self._in_block = 0

    def add(self, ids: np.ndarray) -> None:
        """Append one whole document's token ids."""
        self.extend(ids)
        self.end_document()

    def extend(self, ids: np.ndarray) -> None:
        """Append ids to the document being written (a long document arrives in pieces)."""
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._bin.write(data)
        self._tokens += len(ids)
        view = memoryview(data)
        while view:
            take = min(len(view), self.block_bytes - self._in_block)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._in_block += take
            view = view[take:]
            if self._in_block == self.block_bytes:
                self._crcs.append(self._crc)
                self._crc, self._in_block = 0, 0

    def end_document(self) -> None:
        self._ends.append(self._tokens)

    def close(self) -> ShardInfo:
        """Finish both files under their final names (the ``.bin`` last renamed is the commit)."""
        if self._in_block:
            self._crcs.append(self._crc)
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        idx = np.asarray(self._ends, dtype=np.int64).tobytes()
        idx_tmp = self.folder / f"{self.name}.idx.tmp"
        with open(idx_tmp, "wb") as f:
            f.write(idx)
            f.flush()
            os.fsync(f.fileno())
        os.replace(idx_tmp, self.folder / f"{self.name}.idx")
        os.replace(self.folder / f"{self.name}.bin.tmp", self.folder / f"{self.name}.bin")
        return ShardInfo(self.name, self._tokens, len(self._ends), tuple(self._crcs), zlib.crc32(idx))

    def abort(self) -> None:
        self._bin.close()
        (self.folder / f"{self.name}.bin.tmp").unlink(missing_ok=True)


def write_manifest(folder: Path, tokenizer: dict[str, Any], dtype: np.dtype, shards: Iterable[ShardInfo],
                   sources: list[str], block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:  # fmt: skip
    """Write ``manifest.json`` (atomically: a reader sees the old one or the new one)."""
    shards = list(shards)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer,
        "dtype": np.dtype(dtype).name,
        "block_bytes": block_bytes,
        "tokens": sum(s.tokens for s in shards),
        "documents": sum(s.documents for s in shards),
        "sources": sources,
        "shards": [asdict(s) for s in shards],
    }
    tmp = folder / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ShardError(
            f"{folder}: no {MANIFEST}, so not a prepared token dataset, or its preparation did not finish "
            "(run `terascale data prepare ... --out DIR` again: it resumes)"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ShardError(f"{path}: format {manifest.get('format')!r} v{manifest.get('version')}, expected {FORMAT} v{VERSION}")
    return manifest


class TokenStore:
    """A prepared dataset's tokens and documents, mapped from its shards (see the note).

    ``tokenizer``, when given, must be the one the dataset was prepared with (refused if not).
    Pickles by path: a DataLoader worker maps the files again instead of copying them."""

    def __init__(self, folder: str | Path, *, verify: Verify = "lazy", tokenizer: Tokenizer | None = None) -> None:
        if verify not in ("lazy", "full", "none"):
            raise ValueError(f"verify must be 'lazy', 'full' or 'none', got {verify!r}")
        self.folder = Path(folder)
        self.verify: Verify = verify
        self.manifest = read_manifest(self.folder)
        if tokenizer is not None:
            check_tokenizer(self.manifest["tokenizer"], tokenizer, str(self.folder))
        self.dtype = np.dtype(self.manifest["dtype"])
        self.block_bytes = int(self.manifest["block_bytes"])
        self.shards = [ShardInfo.from_json(s) for s in self.manifest["shards"]]
        counts = np.array([s.tokens for s in self.shards], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)])
        self._open()

    @property
    def num_tokens(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def num_documents(self) -> int:
        return len(self.doc_bounds) - 1

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def fingerprint(self) -> int:
        """A number that changes whenever the tokens do (a CRC of the shards' CRCs)."""
        return zlib.crc32(json.dumps([[s.tokens, s.bin_crc32] for s in self.shards]).encode())

    def _open(self) -> None:
        self._bins: list[np.ndarray] = []
        ends = []
        for s, base in zip(self.shards, self.shard_starts[:-1]):
            (bin_path, bin_size), (idx_path, idx_size) = s.files(self.folder, self.dtype)
            _check_size(bin_path, bin_size)
            _check_size(idx_path, idx_size)
            idx_bytes = idx_path.read_bytes()
            if self.verify != "none" and zlib.crc32(idx_bytes) != s.idx_crc32:
                raise ShardError(f"{idx_path}: checksum mismatch (the document index is damaged); prepare it again")
            ends.append(np.frombuffer(idx_bytes, dtype=np.int64) + base)
            # A zero-length file cannot be mapped; an empty shard is an empty array.
            data = np.memmap(bin_path, dtype=self.dtype, mode="r") if s.tokens else np.empty(0, self.dtype)
            self._bins.append(data)
        self.doc_bounds = np.concatenate([np.zeros(1, np.int64), *ends])
        self._verified: set[tuple[int, int]] = set()
        if self.verify == "full":
            for k, s in enumerate(self.shards):
                self._check_blocks(k, 0, s.tokens)

    def __getstate__(self) -> dict[str, Any]:
        # A worker's copy checks what it reads; "full" was done once, where the store opened.
        return {"folder": str(self.folder), "verify": "lazy" if self.verify == "full" else self.verify}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], verify=state["verify"])  # type: ignore[misc]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the whole dataset (the shards in order), as int64."""
        assert 0 <= start <= stop <= self.num_tokens, (start, stop, self.num_tokens)
        first = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pieces = []
        k = first
        while start < stop:
            base = int(self.shard_starts[k])
            hi = min(stop, int(self.shard_starts[k + 1]))
            if hi > start:
                if self.verify == "lazy":
                    self._check_blocks(k, start - base, hi - base)
                pieces.append(self._bins[k][start - base : hi - base])
            start = max(start, hi)
            k += 1
        if not pieces:
            return np.empty(0, np.int64)
        return np.concatenate(pieces).astype(np.int64) if len(pieces) > 1 else pieces[0].astype(np.int64)

    def document(self, i: int) -> tuple[int, int]:
        """Token range ``[start, stop)`` of document ``i``."""
        return int(self.doc_bounds[i]), int(self.doc_bounds[i + 1])

    def _check_blocks(self, k: int, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        size = self.dtype.itemsize
        shard = self.shards[k]
        raw = self._bins[k]
        for b in range(lo * size // self.block_bytes, (hi * size - 1) // self.block_bytes + 1):
            if (k, b) in self._verified:
                continue
            begin = b * self.block_bytes
            block = raw[begin // size : (begin + self.block_bytes) // size]
            if zlib.crc32(memoryview(np.ascontiguousarray(block)).cast("B")) != shard.bin_crc32[b]:
                raise ShardError(
                    f"{self.folder / (shard.name + '.bin')}: checksum mismatch in bytes {begin}–"
                    f"{begin + block.nbytes} (block {b}): the file is damaged; prepare the dataset again"
                )
            self._verified.add((k, b))


def _check_size(path: Path, expected: int) -> None:
    if not path.is_file():
        raise ShardError(f"{path}: missing (the manifest lists it); prepare the dataset again")
    size = path.stat().st_size
    if size < expected:
        raise ShardError(f"{path}: truncated at offset {size} (the manifest says {expected} bytes)")
    if size > expected:
        raise ShardError(f"{path}: {size} bytes, the manifest says {expected}: written by another preparation?")
