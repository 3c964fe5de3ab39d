"""A byte-level text corpus every machine already has: the Python standard library.

The sources of the running interpreter's standard library (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and without test
suites) are read as raw bytes, so the vocabulary is the 256 byte values and nothing
needs to be downloaded or tokenized. File order is sorted, then shuffled with a fixed
seed so that a size cap still samples the whole library rather than its first few
packages alphabetically; the last files form the held-out split, so no held-out file
is seen in training.
"""

from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256

# Directory names whose contents are test suites (CPython's Lib/test, lib2to3/tests,
# idlelib/idle_test, ...) or not part of the standard library proper.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})


def stdlib_source_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """All ``*.py`` files under the standard library ``root``, sorted by relative path.

    ``root`` defaults to the running interpreter's stdlib directory. Directories named
    in ``_SKIPPED_DIRS`` are not descended into.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"standard library directory {str(base)!r} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Pruning in place stops os.walk from descending; sorting makes the walk order
        # (and so the result) independent of the file system's directory order.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        files.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


@dataclass(frozen=True)
class Corpus:
    """Train and held-out byte streams (uint8 tensors) and the files they came from."""

    train: torch.Tensor
    held_out: torch.Tensor
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    root: str = ""  # the folder the file names are relative to


def load_stdlib_corpus(
    max_bytes: int = 4_000_000,
    held_out_fraction: float = 0.05,
    seed: int = 0,
    root: str | os.PathLike[str] | None = None,
) -> Corpus:
    """Read up to ``max_bytes`` of stdlib source, split at a file boundary.

    Files are taken whole in a seeded shuffle of the sorted file list until the cap
    is reached (a file that would overshoot is skipped, so the cap is a hard limit);
    files are joined with a blank line. The trailing ``held_out_fraction`` of the
    bytes, rounded to whole files (at least one), is the held-out split. The result
    depends only on the library's contents, ``max_bytes``, the fraction and ``seed``.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files(base)
    random.Random(seed).shuffle(files)

    chosen: list[tuple[str, bytes]] = []
    total = 0
    for path in files:
        data = path.read_bytes() + b"\n\n"
        if total + len(data) > max_bytes:
            continue
        chosen.append((path.relative_to(base).as_posix(), data))
        total += len(data)
    if len(chosen) < 2:
        raise ValueError(
            f"max_bytes={max_bytes} holds {len(chosen)} stdlib file(s); "
            "need at least 2 for a train/held-out split"
        )

    # Walk back from the end until the held-out share is reached.
    held_bytes, split = 0, len(chosen)
    while split > 1 and held_bytes < held_out_fraction * total:
        split -= 1
        held_bytes += len(chosen[split][1])

    def stream(part: list[tuple[str, bytes]]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(d for _, d in part)), dtype=torch.uint8)

    return Corpus(
        train=stream(chosen[:split]),
        held_out=stream(chosen[split:]),
        train_files=tuple(name for name, _ in chosen[:split]),
        held_out_files=tuple(name for name, _ in chosen[split:]),
        root=str(base),
    )


class ByteBlocks(Dataset):
    """Fixed-length next-byte-prediction samples over a byte stream.

    Sample ``i`` is ``(input_ids, labels)``, both int64 of length ``block_size``:
    ``input_ids = data[i*block_size : (i+1)*block_size]`` and ``labels`` the same
    window shifted one byte right. Blocks do not overlap (except for the one byte a
    label window shares with the next block), so one epoch sees each byte once.
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be a 1-D tensor of token ids, got shape {tuple(data.shape)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if data.numel() < block_size + 1:
            raise ValueError(
                f"data has {data.numel()} tokens; need at least block_size + 1 = {block_size + 1}"
            )
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} out of range for {len(self)} blocks")
        start = (index % len(self)) * self.block_size
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor of token ids."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    """Token ids back to text; byte sequences that are not valid UTF-8 become U+FFFD."""
    return bytes(ids.tolist()).decode("utf-8", errors="replace")
