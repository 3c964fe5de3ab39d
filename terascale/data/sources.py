"""What ``terascale data prepare`` reads: text files, JSONL, Hugging Face datasets — cut into units.

A *unit* is a run of whole input documents, prepared by one worker into one shard
([Note: the token dataset format]). The units depend only on the inputs and the unit size,
so the same inputs give the same shards whatever the number of workers, and an
interrupted preparation knows which shards are done (each unit has a key naming its
inputs, their sizes and modification times). Kinds of input:

- a text file (any name not below): one document. Files are grouped into units of about
  ``unit_bytes``; a larger file is a unit of its own, read in line-aligned pieces so that
  memory stays flat (a tokenizer with merges then sees piece boundaries at line ends);
- ``*.jsonl``: one document per line, its ``text_key`` field; cut into line-aligned byte
  ranges of about ``unit_bytes``;
- ``*.parquet``, ``*.arrow`` and folders written by ``datasets``' ``save_to_disk``: one
  document per row, its ``text_key`` column, read with the ``datasets`` library (memory-
  mapped Arrow); cut into row ranges;
- any other folder: the files under it, in sorted order, by the rules above.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

UNIT_BYTES = 16 << 20
ROWS_PER_UNIT = 20_000
PIECE_BYTES = 1 << 20
HF_SUFFIXES = (".parquet", ".arrow")


@dataclass(frozen=True)
class Unit:
    """Documents of one shard: ``kind`` 'text' (whole ``paths``), 'jsonl' (lines starting in
    bytes ``[lo, hi)`` of ``paths[0]``) or 'hf' (rows ``[lo, hi)`` of dataset ``paths[0]``)."""

    kind: str
    paths: tuple[str, ...]
    lo: int = 0
    hi: int = 0
    key: str = ""  # what the unit read: paths, sizes, mtimes, the range (for resuming)

    @property
    def nbytes(self) -> int:
        """Input bytes, for the progress bar (rows for 'hf')."""
        if self.kind == "text":
            return sum(os.path.getsize(p) for p in self.paths)
        return self.hi - self.lo


def _stamp(path: str) -> str:
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def expand(inputs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The input files and datasets named by ``inputs``, folders expanded, in order."""
    out: list[str] = []
    for item in inputs:
        p = Path(item)
        if not p.exists():
            raise ValueError(f"input {str(item)!r} does not exist")
        if p.is_dir() and _is_saved_dataset(p):
            out.append(str(p))
        elif p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            if not found:
                raise ValueError(f"input folder {str(item)!r} holds no files")
            out.extend(found)
        else:
            out.append(str(p))
    return out


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_info.json").is_file() or (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()


def plan_units(files: Sequence[str], unit_bytes: int = UNIT_BYTES, rows_per_unit: int = ROWS_PER_UNIT,
               text_key: str = "text") -> list[Unit]:  # fmt: skip
    """Cut ``files`` (from :func:`expand`) into units, in input order."""
    units: list[Unit] = []
    group: list[str] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            units.append(Unit("text", tuple(group), key="|".join(_stamp(p) for p in group)))
            group, group_bytes = [], 0

    for path in files:
        if path.endswith(".jsonl"):
            flush()
            units.extend(_jsonl_units(path, unit_bytes))
        elif path.endswith(HF_SUFFIXES) or os.path.isdir(path):
            flush()
            rows = len(open_hf(path, text_key))
            stamp = _stamp(path) if os.path.isfile(path) else _dir_stamp(path)
            units.extend(Unit("hf", (path,), lo, min(lo + rows_per_unit, rows), f"{stamp}:{lo}")
                         for lo in range(0, rows, rows_per_unit))  # fmt: skip
        else:
            size = os.path.getsize(path)
            if group and group_bytes + size > unit_bytes:
                flush()
            group.append(path)
            group_bytes += size
    flush()
    return units


def _dir_stamp(path: str) -> str:
    return "|".join(_stamp(str(f)) for f in sorted(Path(path).rglob("*")) if f.is_file())


def _jsonl_units(path: str, unit_bytes: int) -> list[Unit]:
    size = os.path.getsize(path)
    stamp = _stamp(path)
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + unit_bytes < size:
            f.seek(bounds[-1] + unit_bytes)
            f.readline()  # to the end of the line the cut falls in
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    bounds.append(size)
    return [Unit("jsonl", (path,), lo, hi, f"{stamp}:{lo}") for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def open_hf(path: str, text_key: str):  # -> datasets.Dataset
    """A Hugging Face dataset from a local parquet/arrow file or a ``save_to_disk`` folder."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - the library comes with the test extras
        raise ValueError(f"{path}: reading Hugging Face datasets needs the 'datasets' library (pip install datasets, or terascale[data])") from exc
    if os.path.isdir(path):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{path}: a DatasetDict without a 'train' split ({sorted(ds)}); give one split's folder")
            ds = ds["train"]
    elif path.endswith(".arrow"):
        ds = datasets.Dataset.from_file(path)
    else:
        ds = datasets.Dataset.from_parquet(path)
    if text_key not in ds.column_names:
        raise ValueError(f"{path}: no column {text_key!r} (columns: {ds.column_names}); name the text with --text-key")
    return ds


def documents(unit: Unit, text_key: str = "text") -> Iterator[list[str] | Iterator[str]]:
    """``unit``'s documents: a list of one text each, except a text file longer than
    ``PIECE_BYTES``, which comes as an iterator of its line-aligned pieces (read as they
    are consumed, so that no more than a piece is in memory)."""
    if unit.kind == "text":
        for path in unit.paths:
            if os.path.getsize(path) <= PIECE_BYTES:
                with open(path, "rb") as f:
                    yield [f.read().decode("utf-8", errors="surrogateescape")]
            else:
                yield _text_pieces(path)
    elif unit.kind == "jsonl":
        with open(unit.paths[0], "rb") as f:
            f.seek(unit.lo)
            while f.tell() < unit.hi:
                line = f.readline()
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{unit.paths[0]}: the line ending at byte {f.tell()} is not JSON ({exc})") from exc
                if text_key not in record:
                    raise ValueError(f"{unit.paths[0]}: the line ending at byte {f.tell()} has no {text_key!r} field "
                                     f"(fields: {sorted(record)}); name the text with --text-key")  # fmt: skip
                yield [record[text_key]]
    else:
        ds = open_hf(unit.paths[0], text_key).select_columns([text_key])
        for start in range(unit.lo, unit.hi, 1000):
            for text in ds[start : min(start + 1000, unit.hi)][text_key]:
                yield [text or ""]


def _text_pieces(path: str) -> Iterator[str]:
    with open(path, "rb") as f:
        while True:
            piece = f.read(PIECE_BYTES)
            if not piece:
                return
            if len(piece) == PIECE_BYTES:
                piece += f.readline()  # end the piece at a line end
            yield piece.decode("utf-8", errors="surrogateescape")
