"""The data runtime's throughput: preparation (tokens/s, memory against input size) and one
rank's loader (tokens/s delivered), for the demo's shapes.

    python bench/data.py                       # bytes and a small BPE, 64 and 256 MB of input
    python bench/data.py --sizes-mb 32 --bpe-vocab 0

Preparation: the input is this interpreter's standard library sources, repeated and cut
into files of about 1 MB (text, one document each) until ``--sizes-mb``; each size is
prepared with ``terascale.data.prepare`` in ``--workers`` processes with the byte tokenizer
and, with ``--bpe-vocab`` > 0, a byte-level BPE of that vocabulary trained with the
``tokenizers`` library on 4 MB of the same text. Reported: tokens/s of the whole run (file
reads, tokenizing, writing and CRCs included) and the peak RSS of the parent and of the
largest worker (``getrusage``, each size in a fresh process so the peaks are its own).

Loader: ``GlobalBatches`` over ``PackedSamples`` of the prepared bytes at the demo's
context (128) and micro-batch (8), as rank 0 of 2 with one worker process reading ahead,
iterated for ``--loader-seconds``; tokens/s delivered to the loop, to compare with the
demo's training rate (``make demo`` prints it; ``bench/RESULTS.md`` records both).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_input(folder: Path, megabytes: int) -> list[Path]:
    """``megabytes`` of stdlib source in ~1 MB text files."""
    folder.mkdir(parents=True, exist_ok=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    files, chunk, total, k = [], [], 0, 0
    while total < megabytes << 20:
        for src in sources:
            chunk.append(src.read_bytes())
            if sum(map(len, chunk)) >= 1 << 20:
                path = folder / f"{k:05d}.txt"
                path.write_bytes(b"".join(chunk))
                files.append(path)
                total += path.stat().st_size
                chunk, k = [], k + 1
                if total >= megabytes << 20:
                    break
    return files


def train_bpe(files: list[Path], vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = [f.read_text(errors="replace") for f in files[:4]]
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out))
    return out


def prepare_job(input_dir: str, out: str, tokenizer: str | None, workers: int) -> dict:
    """One preparation in this process (run in a child so that its peaks are its own)."""
    from terascale.data import load_tokenizer, prepare

    done = prepare([input_dir], out, tokenizer=load_tokenizer(tokenizer), workers=workers, progress=False)
    return {
        "tokens": done.tokens,
        "seconds": done.seconds,
        "tokens_per_s": done.tokens_per_second,
        "parent_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def loader_job(data: str, seconds: float) -> dict:
    from terascale.data import GlobalBatches, PackedSamples

    loader = GlobalBatches(PackedSamples(data, 128), 8, rank=0, world=2, num_workers=1)
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for batch in loader:
            tokens += batch["input_ids"].numel()
            if time.perf_counter() - start >= seconds:
                break
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "wait_s": loader.wait_seconds}


def child(fn: str, *args: object) -> dict:
    code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import data; print(json.dumps(data.{fn}(*{args!r})))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="64,256")
    p.add_argument("--bpe-vocab", type=int, default=4096, help="0: bytes only")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--loader-seconds", type=float, default=10.0)
    p.add_argument("--dir", default=None, help="scratch folder (default: a temporary one, deleted after)")
    p.add_argument("--out", default="runs/bench/data.json")
    args = p.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="ts-data-bench-"))
    rows = []
    try:
        sizes = [int(s) for s in args.sizes_mb.split(",")]
        for mb in sizes:
            inputs = make_input(scratch / f"in-{mb}", mb)
            tokenizers = [("bytes", None)]
            if args.bpe_vocab:
                tokenizers.append((f"BPE {args.bpe_vocab}", str(train_bpe(inputs, args.bpe_vocab, scratch / "bpe.json"))))
            for name, path in tokenizers:
                out = scratch / f"out-{mb}-{name.split()[0]}"
                r = child("prepare_job", str(scratch / f"in-{mb}"), str(out), path, args.workers)
                rows.append({"input_mb": mb, "tokenizer": name, "workers": args.workers, **r})
                print(f"prepare {mb} MB, {name}: {r['tokens']:,} tokens in {r['seconds']:.1f} s = "
                      f"{r['tokens_per_s'] / 1e6:.2f}M tokens/s; peak RSS parent {r['parent_rss_mb']:.0f} MB, "
                      f"largest worker {r['worker_rss_mb']:.0f} MB", flush=True)  # fmt: skip
                if name != "bytes":
                    shutil.rmtree(out)
            shutil.rmtree(scratch / f"in-{mb}")
        data = scratch / f"out-{sizes[0]}-bytes"
        loader = child("loader_job", str(data), args.loader_seconds)
        print(f"loader (rank 0 of 2, context 128, micro-batch 8, 1 worker): {loader['tokens_per_s']:,.0f} tokens/s "
              f"delivered, {loader['wait_s']:.2f} s of {loader['seconds']:.1f} s waiting", flush=True)  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"prepare": rows, "loader": loader}, indent=1))
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
