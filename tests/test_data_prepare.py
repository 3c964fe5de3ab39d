"""`terascale data prepare` and the token shard format: contents, determinism, resume, damage.

The oracle for the contents is the input itself: byte-level shards hold the inputs' bytes,
BPE shards hold what the tokenizer gives for each document, document by document.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from terascale.data import ShardError, TokenStore, load_tokenizer, prepare
from terascale.launcher.cli import main as cli


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "δέλτα", "epsilon", "zeta\n", "eta", "theta", "iota", "kappa\n\n"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 400)))) for _ in range(n)]


def _text_files(folder: Path, docs: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, d in enumerate(docs):
        p = folder / f"doc{k:04d}.txt"
        p.write_text(d, encoding="utf-8")
        paths.append(p)
    return paths


def _all_documents(store: TokenStore) -> list[np.ndarray]:
    return [store.tokens(*store.document(i)) for i in range(store.num_documents)]


def test_text_files_become_their_bytes_one_document_each_whatever_the_worker_count(tmp_path):
    docs = _docs(60)
    files = _text_files(tmp_path / "in", docs)
    one = prepare(files, tmp_path / "w1", workers=1, unit_bytes=4000, progress=False)
    two = prepare(files, tmp_path / "w2", workers=2, unit_bytes=4000, progress=False)
    assert one.shards > 3 and one.shards == two.shards
    for k in range(one.shards):  # byte-identical shards: units, not workers, decide them
        for ext in ("bin", "idx"):
            assert (tmp_path / "w1" / f"shard-{k:05d}.{ext}").read_bytes() == (tmp_path / "w2" / f"shard-{k:05d}.{ext}").read_bytes()
    store = TokenStore(tmp_path / "w2", verify="full")
    assert store.dtype == np.uint16 and store.num_documents == len(docs)
    assert [bytes(d.astype(np.uint8)) for d in _all_documents(store)] == [d.encode() for d in docs]
    assert store.num_tokens == sum(len(d.encode()) for d in docs) == two.tokens


def test_jsonl_and_hugging_face_datasets_with_a_bpe_tokenizer(tmp_path):
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    docs = _docs(120, seed=1)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(docs, tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>"]))
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, eos="</s>")
    eos = bpe.token_to_id("</s>")
    expected = [bpe.encode(d, add_special_tokens=False).ids + [eos] for d in docs]

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": k, "text": d}) + "\n" for k, d in enumerate(docs)))
    table = datasets.Dataset.from_dict({"body": docs})
    table.to_parquet(str(tmp_path / "docs.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    # A DatasetDict on disk (what load_dataset(...).save_to_disk writes): its train split.
    datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(str(tmp_path / "splits"))
    for name, inputs, key in (("jsonl", [jsonl], "text"), ("parquet", [tmp_path / "docs.parquet"], "body"),
                              ("saved", [tmp_path / "saved"], "body"), ("splits", [tmp_path / "splits"], "body")):  # fmt: skip
        out = tmp_path / f"out-{name}"
        prepare(inputs, out, tokenizer=tok, workers=2, text_key=key, unit_bytes=3000, progress=False)
        store = TokenStore(out, tokenizer=tok)
        assert [d.tolist() for d in _all_documents(store)] == expected, name

    # The manifest names its tokenizer; another one is refused, naming what differs.
    with pytest.raises(ValueError, match=r"prepared with tokenizer .* differ in eos, kind, sha256, vocab_size"):
        TokenStore(tmp_path / "out-jsonl", tokenizer=load_tokenizer())
    with pytest.raises(ValueError, match="no column 'text'"):
        prepare([tmp_path / "docs.parquet"], tmp_path / "bad", progress=False)


def test_a_killed_preparation_resumes_and_ends_with_the_same_shards(tmp_path):
    files = _text_files(tmp_path / "in", _docs(40, seed=2))
    clean = prepare(files, tmp_path / "clean", workers=1, unit_bytes=2000, progress=False)
    # A tokenizer slow enough to be killed in the middle; the journal says how far it got.
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from terascale.data import ByteTokenizer, prepare
        class Slow(ByteTokenizer):
            def encode(self, texts):
                time.sleep(0.05)
                return super().encode(texts)
        prepare({[str(f) for f in files]!r}, {str(tmp_path / "killed")!r}, tokenizer=Slow(), workers=1,
                unit_bytes=2000, progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    journal = tmp_path / "killed" / "prepare.journal"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not journal.exists() or len(journal.read_text().splitlines()) < 3):
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(journal.read_text().splitlines())
    assert 3 <= done_before < clean.shards, "the kill did not land mid-preparation"
    assert not (tmp_path / "killed" / "manifest.json").exists()
    with pytest.raises(ShardError, match="no manifest.json"):
        TokenStore(tmp_path / "killed")

    resumed = prepare(files, tmp_path / "killed", workers=2, unit_bytes=2000, progress=False)
    assert resumed.written <= clean.shards - done_before + 1  # at most the shard being written when killed, again
    assert resumed.written < clean.shards
    for f in sorted((tmp_path / "clean").glob("shard-*")):
        assert (tmp_path / "killed" / f.name).read_bytes() == f.read_bytes(), f.name
    again = prepare(files, tmp_path / "killed", unit_bytes=2000, progress=False)
    assert again.written == 0


def test_a_truncated_or_damaged_shard_names_its_file_and_offset(tmp_path):
    files = _text_files(tmp_path / "in", _docs(30, seed=3))
    prepare(files, tmp_path / "ds", workers=1, unit_bytes=1 << 20, block_bytes=1024, progress=False)
    shard = tmp_path / "ds" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0xFF  # in block 4 (bytes 4096-5120)
    shard.write_bytes(bytes(data))
    store = TokenStore(tmp_path / "ds")  # lazy: opening checks sizes only
    store.tokens(0, 100)  # block 0 is fine
    with pytest.raises(ShardError, match=r"shard-00000\.bin: checksum mismatch in bytes 4096–5120 \(block 4\)"):
        store.tokens(2000, 2600)  # 2-byte tokens: bytes 4000-5200
    with pytest.raises(ShardError, match="checksum mismatch in bytes 4096"):
        TokenStore(tmp_path / "ds", verify="full")
    assert cli(["data", "check", str(tmp_path / "ds")]) == 2

    shard.write_bytes(bytes(data[:3001]))
    with pytest.raises(ShardError, match=rf"shard-00000\.bin: truncated at offset 3001 \(the manifest says {len(data)} bytes\)"):
        TokenStore(tmp_path / "ds")


def test_the_command_line_prepares_and_checks(tmp_path, capsys):
    files = _text_files(tmp_path / "in", _docs(10, seed=4))
    assert cli(["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "ds"), "--workers", "2"]) == 0
    assert cli(["data", "check", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    total = sum(f.stat().st_size for f in files)
    assert f"{total:,} tokens in 10 documents" in out and "every checksum right" in out
    assert cli(["data", "prepare", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_document_longer_than_a_piece_is_read_piece_by_piece_and_stays_one_document(tmp_path, monkeypatch):
    import terascale.data.sources as sources

    monkeypatch.setattr(sources, "PIECE_BYTES", 100)
    docs = _docs(5, seed=5)
    assert max(len(d.encode()) for d in docs) > 500
    pieces = list(sources._text_pieces(str(_text_files(tmp_path / "one", [docs[0]])[0])))
    assert len(pieces) > 3 and "".join(pieces) == docs[0]  # cut at line ends, nothing lost
    prepare(_text_files(tmp_path / "in", docs), tmp_path / "ds", workers=2, unit_bytes=300, progress=False)
    store = TokenStore(tmp_path / "ds")
    assert [bytes(d.astype(np.uint8)) for d in _all_documents(store)] == [d.encode() for d in docs]
