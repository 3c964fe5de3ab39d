"""Checkpoints whose corruption is detected ([Note: checkpoint checksums]).

Every shard file's checksum is recorded in the manifest as the file is written; a byte
changed afterwards (bit rot, a torn write, a bad copy to node-local storage) is found by
``verify(content=True)``, makes ``load_checkpoint`` raise naming the file, and makes
``auto_resume`` fall back to the newest intact checkpoint, a mirror copy at the same step
first. A manifest without checksums (older checkpoints) still loads.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import torch

from distributed import run_ranks
from parity import LR, WD
from toy import make_data, make_model

from terascale.checkpoint.directory import verify
from terascale.checkpoint.integrity import file_checksum
from terascale.checkpoint.manifest import MANIFEST, Manifest
from terascale.checkpoint.stream import SafetensorsStream, TensorEntry
from terascale.offload.aio import AsyncIO
from terascale.offload.swap import BufferPool

SHARD1 = "rank00001-of-00002.safetensors"


def flip_middle_byte(path: Path) -> None:
    """Invert one byte in the middle of ``path``'s tensor data (past the safetensors header)."""
    with open(path, "r+b") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        at = start + (path.stat().st_size - start) // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_the_stream_hashes_the_file_it_writes(tmp_path: Path) -> None:
    # Tensors of odd sizes through small staging buffers: the data section starts on a
    # block boundary, pieces straddle buffers, and the I/O engine finishes writes in any order.
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([1, 3000, 70_001, 5, 123_457])}
    tensors["b"] = torch.randint(0, 255, (9999,), dtype=torch.uint8, generator=g)
    pool = BufferPool(3)
    pool.reserve(16 << 10)
    path = tmp_path / "f.safetensors"
    with AsyncIO() as aio:
        stream = SafetensorsStream(path, [TensorEntry(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], aio, pool=pool)
        for k, t in tensors.items():
            stream.write(k, t)
        stream.close()
    expected = f"crc32:{zlib.crc32(path.read_bytes()):08x}"
    assert stream.checksum == expected == file_checksum(path)


def _config(folder: str, **checkpoint: object) -> dict:
    return {
        "train_batch_size": 8,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": 2},
        "checkpoint": {"save_dir": f"{folder}/ckpt", **checkpoint},
    }


def _engine(config: dict):
    import terascale

    engine, *_ = terascale.initialize(model=make_model(), config=config)
    return engine


def _corruption_rank(folder: str) -> dict:
    """Two ranks: interval saves to local_dir mirrored to save_dir, then corruptions."""
    import torch.distributed as dist

    from terascale.checkpoint.manifest import CheckpointError

    root = Path(folder)
    out: dict = {}
    x, y = make_data(3, 8)
    engine = _engine(_config(folder, local_dir=f"{folder}/local", interval_steps=1))
    rank = dist.get_rank()
    for s in range(3):
        loss = engine(x[s, rank * 4 : rank * 4 + 4], y[s, rank * 4 : rank * 4 + 4])
        engine.backward(loss)
        engine.step()
    engine.wait_for_checkpoint()
    engine.destroy()
    dist.barrier()

    if rank == 0:
        for base in ("local", "ckpt"):
            m = Manifest.read(root / base / "global_step3")
            out[f"{base}_checksums"] = [(f.checksum, file_checksum(root / base / "global_step3" / f.name)) for f in m.files]
        out["same_manifest"] = (root / "local/global_step3" / MANIFEST).read_text() == (
            root / "ckpt/global_step3" / MANIFEST
        ).read_text()
        flip_middle_byte(root / "local/global_step3" / SHARD1)
        bad = root / "local/global_step3"
        out["verify_meta"] = verify(bad)
        out["verify_content"] = verify(bad, content=True)
        out["verify_shares"] = [verify(bad, content=True, share=(i, 2)) for i in range(2)]
    dist.barrier()

    def resume() -> tuple[int, list[str]]:
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("terascale").addHandler(handler)
        try:
            engine = _engine(_config(folder, local_dir=f"{folder}/local", auto_resume=True))
        finally:
            logging.getLogger("terascale").removeHandler(handler)
        steps = engine.global_steps
        engine.destroy()
        return steps, [r for r in records if "not resuming" in r]

    # The local copy at step 3 is corrupted: the mirror copy of the same step in save_dir.
    out["resume_mirror"] = resume()
    if rank == 0:
        flip_middle_byte(root / "ckpt/global_step3" / SHARD1)
    dist.barrier()
    # Both copies of step 3 corrupted: step 2 (local copy first).
    out["resume_previous"] = resume()

    # An explicit load of a corrupted checkpoint raises on every rank, naming the file.
    engine = _engine(_config(folder))
    try:
        engine.load_checkpoint(f"{folder}/ckpt", tag="global_step3")
        out["load_error"] = None
    except CheckpointError as exc:
        out["load_error"] = str(exc)
    # A manifest without checksums (as older versions wrote) loads, verified by size and header.
    dist.barrier()
    if rank == 0:
        path = root / "ckpt/global_step2" / MANIFEST
        doc = json.loads(path.read_text())
        for f in doc["files"]:
            del f["checksum"]
        path.write_text(json.dumps(doc))
        out["old_verify"] = verify(root / "ckpt/global_step2", content=True)
    dist.barrier()
    out["old_load"] = engine.load_checkpoint(f"{folder}/ckpt", tag="global_step2")[0]
    out["old_steps"] = engine.global_steps
    engine.destroy()
    # With the check off the corrupted bytes are loaded as they are.
    engine = _engine(_config(folder, verify_content=False))
    out["unchecked_load"] = engine.load_checkpoint(f"{folder}/ckpt", tag="global_step3")[0]
    engine.destroy()
    return out


def test_corrupted_checkpoints_are_found_and_passed_over(tmp_path: Path) -> None:
    results = run_ranks(_corruption_rank, 2, str(tmp_path), device="cpu", timeout=300)
    first = results[0]
    for base in ("local", "ckpt"):  # recorded as written; the mirror copy keeps them
        assert all(recorded == actual and recorded.startswith("crc32:") for recorded, actual in first[f"{base}_checksums"])
    assert first["same_manifest"]
    bad = tmp_path / "local/global_step3" / SHARD1
    assert first["verify_meta"] is None  # size and header are intact
    assert f"'{bad}' is corrupted" in first["verify_content"]
    assert first["verify_shares"][0] is None and f"'{bad}' is corrupted" in first["verify_shares"][1]

    # Each rank checked its share of the files; the ranks agreed and named the file.
    steps, warnings = first["resume_mirror"]
    assert steps == 3 and any(str(bad) in w and "corrupted" in w for w in warnings), warnings
    assert results[1]["resume_mirror"][0] == 3
    steps, warnings = first["resume_previous"]
    assert steps == 2 and any(str(tmp_path / "ckpt/global_step3" / SHARD1) in w for w in warnings), warnings
    assert results[1]["resume_previous"][0] == 2

    for r in results:
        assert "cannot load checkpoint" in r["load_error"] and str(tmp_path / "ckpt/global_step3" / SHARD1) in r["load_error"]
        assert r["unchecked_load"] == str(tmp_path / "ckpt/global_step3")
        assert r["old_load"] == str(tmp_path / "ckpt/global_step2") and r["old_steps"] == 2
    assert first["old_verify"] is None
