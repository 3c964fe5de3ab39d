"""``terascale data prepare``: inputs tokenized in parallel into token shards, resumable.

Each unit of the inputs ([Note: the token dataset format], ``terascale/data/sources.py``)
is tokenized by a worker process into its own shard; the parent records each finished
shard in ``prepare.journal`` (one JSON line: the unit's key, the tokenizer, the shard's
counts and CRCs) and writes the manifest once all are done. Run again after an
interruption, it re-reads the journal and prepares only the units without a finished
shard whose key and tokenizer match (and whose files still have the recorded sizes).
Memory is flat in the input size: a worker holds one batch of documents (or one piece of
a long one) at a time, the parent only the shards' records.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from terascale.data.shards import BLOCK_BYTES, MANIFEST, ShardInfo, ShardWriter, shard_name, write_manifest
from terascale.data.sources import UNIT_BYTES, Unit, documents, expand, plan_units
from terascale.data.tokenizer import Tokenizer, load_tokenizer, token_dtype

JOURNAL = "prepare.journal"
# Documents encoded per tokenizer call (the Rust tokenizer batches them), up to a size that
# keeps a worker's memory small whatever the documents' lengths.
BATCH_DOCS = 256
BATCH_CHARS = 1 << 20


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` did: the dataset's totals, and how many shards it (re)wrote."""

    folder: Path
    tokens: int
    documents: int
    shards: int
    written: int  # shards tokenized by this run (the others were done before it)
    tokens_written: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """This run's tokenizing rate."""
        return self.tokens_written / self.seconds if self.seconds > 0 else float("inf")


def prepare(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    workers: int | None = None,
    text_key: str = "text",
    unit_bytes: int = UNIT_BYTES,
    block_bytes: int = BLOCK_BYTES,
    progress: bool = True,
) -> Prepared:
    """Tokenize ``inputs`` (files and folders, see ``terascale.data.sources``) into the
    token dataset folder ``out`` with ``tokenizer`` (default: bytes), in ``workers``
    processes (default: one per CPU core). Resumes an interrupted run into the same ``out``."""
    started = time.perf_counter()
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    units = plan_units(expand(inputs), unit_bytes=unit_bytes, text_key=text_key)
    if not units:
        raise ValueError("no input documents: give text files, .jsonl files or Hugging Face datasets")
    identity = tokenizer.describe()
    dtype = token_dtype(tokenizer.vocab_size)
    done = _finished(folder, units, identity, dtype)
    todo = [k for k in range(len(units)) if k not in done]
    _remove_stale(folder, len(units))
    if todo:
        (folder / MANIFEST).unlink(missing_ok=True)  # the folder is a finished dataset again only at the end
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    bar = tqdm(total=sum(units[k].nbytes for k in todo), unit="B", unit_scale=True, desc="prepare",
               disable=not progress or not todo)  # fmt: skip
    tokens_written = 0
    with open(folder / JOURNAL, "a") as journal:

        def finished(k: int, info: ShardInfo) -> None:
            nonlocal tokens_written
            done[k] = _record(journal, units[k], identity, info)
            tokens_written += info.tokens
            _advance(bar, units[k].nbytes, tokens_written, started)

        if workers == 1:
            for k in todo:
                finished(k, prepare_unit(units[k], k, str(folder), tokenizer, text_key, dtype.name, block_bytes))
        else:
            context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init) as pool:
                pending = {}
                queue = list(todo)
                while queue or pending:
                    while queue and len(pending) < 2 * workers:  # a few ahead, not every unit at once
                        k = queue.pop(0)
                        pending[pool.submit(prepare_unit, units[k], k, str(folder), tokenizer, text_key, dtype.name,
                                            block_bytes)] = k  # fmt: skip
                    ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in ready:
                        finished(pending.pop(future), future.result())
    bar.close()
    shards = [done[k] for k in range(len(units))]
    manifest = write_manifest(folder, identity, dtype, shards, sources=sorted({p for u in units for p in u.paths}),
                              block_bytes=block_bytes)  # fmt: skip
    return Prepared(folder, manifest["tokens"], manifest["documents"], len(units), len(todo), tokens_written,
                    time.perf_counter() - started)  # fmt: skip


def prepare_unit(unit: Unit, k: int, folder: str, tokenizer: Tokenizer, text_key: str, dtype: str,
                 block_bytes: int = BLOCK_BYTES) -> ShardInfo:  # fmt: skip
    """Tokenize ``unit`` into shard ``k`` of ``folder`` (runs in a worker process)."""
    writer = ShardWriter(Path(folder), shard_name(k), np.dtype(dtype), block_bytes)
    try:
        batch: list[str] = []
        chars = 0
        for pieces in documents(unit, text_key):
            if isinstance(pieces, list):
                batch.append(pieces[0])
                chars += len(pieces[0])
                if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                    _write_batch(writer, tokenizer, batch)
                    batch, chars = [], 0
                continue
            _write_batch(writer, tokenizer, batch)
            batch, chars = [], 0
            for piece in pieces:  # one long document, piece by piece
                writer.extend(_checked(tokenizer.encode([piece])[0], tokenizer))
            writer.end_document()
        _write_batch(writer, tokenizer, batch)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _write_batch(writer: ShardWriter, tokenizer: Tokenizer, texts: list[str]) -> None:
    if texts:
        for ids in tokenizer.encode(texts):
            writer.add(_checked(ids, tokenizer))


def _checked(ids: np.ndarray, tokenizer: Tokenizer) -> np.ndarray:
    if len(ids) and int(ids.max()) >= tokenizer.vocab_size:
        raise ValueError(f"the tokenizer gave id {int(ids.max())}, beyond its vocabulary of {tokenizer.vocab_size}")
    return ids


def _worker_init() -> None:
    # Each worker is one process of the pool: the Rust tokenizer's own threads would only
    # compete with the other workers (and fork after its pool started can deadlock).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _record(journal: Any, unit: Unit, identity: dict[str, Any], info: ShardInfo) -> ShardInfo:
    journal.write(json.dumps({"unit": unit.key, "kind": unit.kind, "tokenizer": identity, "shard": asdict(info)}) + "\n")
    journal.flush()
    os.fsync(journal.fileno())
    return info


def _finished(folder: Path, units: list[Unit], identity: dict[str, Any], dtype: np.dtype) -> dict[int, ShardInfo]:
    """Shards of an earlier run still valid for ``units``: journalled for the same unit key
    and tokenizer, with both files of the recorded sizes (a later record wins)."""
    path = folder / JOURNAL
    if not path.is_file():
        return {}
    wanted = {u.key: k for k, u in enumerate(units)}
    done: dict[int, ShardInfo] = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # the line being written when the run was killed
            continue
        k = wanted.get(entry.get("unit"))
        if k is None or entry.get("tokenizer") != identity or entry["shard"]["name"] != shard_name(k):
            continue
        info = ShardInfo.from_json(entry["shard"])
        if all(p.is_file() and p.stat().st_size == n for p, n in info.files(folder, dtype)):
            done[k] = info
    return done


def _remove_stale(folder: Path, count: int) -> None:
    """Shard files of an earlier preparation beyond this one's ``count`` shards, and temporaries."""
    for f in folder.glob("shard-*"):
        stem = f.name.split(".")[0]
        if f.name.endswith(".tmp") or int(stem.split("-")[1]) >= count:
            f.unlink()


def _advance(bar: tqdm, nbytes: int, tokens: int, started: float) -> None:
    bar.update(nbytes)
    bar.set_postfix_str(f"{tokens / max(time.perf_counter() - started, 1e-9):,.0f} tokens/s", refresh=False)
