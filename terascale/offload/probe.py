"""``aio: "auto"``: the I/O engine's settings measured on the NVMe path at start-up.

[Note: the aio probe]
DeepSpeed users tune ``block_size`` and ``queue_depth`` by hand for their drives (its
``ds_nvme_tune`` sweeps them in minutes). A config may instead say ``"aio": "auto"``, or
``"auto"`` for any of ``block_size``, ``queue_depth``, ``thread_count`` and ``backend``;
the values it gives are kept. The probe then writes one file of ``PROBE_BYTES`` in the
NVMe directory and, for each candidate (``block_size`` x pieces in flight, on threads),
rewrites it and reads it back, twice, interleaved: the swap files' own pattern (each is
rewritten and read every step). The candidate with the least total time wins; one within
3% of it that keeps fewer pieces in flight, or smaller ones, is preferred (less memory
pinned by the kernel, shorter waits for the piece a step needs). The winner is then timed
on the kernel's AIO queue too, which is kept only if 3% faster (the simpler threads win
ties). It takes three to four seconds on this project's disk.

The result is kept in ``<nvme_path>/terascale_swap/aio_probe.json`` for the device
(``st_dev``) and the given values, so a restart or the next rank reuses it. Ranks of a
node share the file under an exclusive lock: the first measures, the others wait for it
and read its answer, so they never measure each other's traffic. Delete the file to
measure again (after moving ``nvme_path`` to another disk this happens by itself).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import torch

from terascale.offload.aio import AioOptions, AsyncIO
from terascale.offload.host_buffers import aligned_empty
from terascale.offload.kernel_aio import open_queue

PROBE_BYTES = 256 << 20
BLOCK_SIZES = (1 << 20, 4 << 20, 16 << 20)
IN_FLIGHT = (4, 8, 16)
_VERSION = 2
_KEYS = ("block_size", "queue_depth", "thread_count", "backend")


def aio_options(aio: object, directory: str | os.PathLike | None = None) -> AioOptions:
    """The :class:`AioOptions` of a :class:`terascale.config.schema.AioConfig` (or anything
    with its fields).

    ``"auto"`` values are measured on ``directory`` (the NVMe path the engine will use) by
    :func:`probe_options`, once per device; without a directory they are the defaults.
    """
    given = {name: getattr(aio, name) for name in _KEYS}
    if "auto" in given.values():
        given = probe_options(directory, {k: v for k, v in given.items() if v != "auto"})
    return AioOptions(**given, single_submit=aio.single_submit, overlap_events=aio.overlap_events)


def probe_options(directory: str | os.PathLike | None, given: dict[str, object]) -> dict[str, object]:
    """``block_size``, ``queue_depth``, ``thread_count`` and ``backend`` for NVMe I/O under
    ``directory``: the values in ``given``, the others measured (see [Note: the aio probe]).

    Without a directory to measure (``None``), the missing values are the defaults.
    """
    if directory is None:
        defaults = AioOptions()
        return {k: given.get(k, getattr(defaults, k)) for k in _KEYS}
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"nvme_path '{root}' is not an existing directory; create it or point nvme_path elsewhere")
    home = root / "terascale_swap"
    home.mkdir(exist_ok=True)
    key = {"version": _VERSION, "device": os.stat(home).st_dev, "given": {k: given[k] for k in sorted(given)}}
    with open(home / "aio_probe.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        cache = home / "aio_probe.json"
        entries = _read(cache)
        for entry in entries:
            if entry.get("key") == key:
                return entry["options"]
        options, table = _measure(home, given)
        entries.append({"key": key, "options": options, "measured": table, "when": time.strftime("%Y-%m-%d %H:%M:%S")})
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, cache)
        return options


def _read(cache: Path) -> list[dict]:
    try:
        entries = json.loads(cache.read_text())
    except (OSError, ValueError):
        return []
    return entries if isinstance(entries, list) else []


def candidates(given: dict[str, object]) -> list[dict[str, object]]:
    """The settings the probe tries first: every block size x pieces in flight that
    ``given`` allows (a given ``thread_count`` divides the pieces in flight among its
    threads), on the given backend or on threads."""
    threads = given.get("thread_count", 1)
    blocks = [given["block_size"]] if "block_size" in given else list(BLOCK_SIZES)
    if "queue_depth" in given:
        depths = [given["queue_depth"]]
    else:
        depths = sorted({max(1, n // threads) for n in IN_FLIGHT})
    backend = given.get("backend", "threads")
    return [{"block_size": b, "queue_depth": q, "thread_count": threads, "backend": backend} for b in blocks for q in depths]


def _measure(home: Path, given: dict[str, object]) -> tuple[dict[str, object], list[dict]]:
    """Time each candidate's rewrite and read of one file; the pick and the table."""
    path = home / f"aio_probe_{os.getpid()}.bin"
    buf = aligned_empty(PROBE_BYTES, torch.uint8)
    buf.fill_(0x5A)
    try:
        with AsyncIO(AioOptions()) as aio:
            aio.sync_write(buf, path)  # lay the file out once: what follows are rewrites
        trial = candidates(given)
        best = _time(trial, buf, path)
        fastest = min(best)
        # Among those within 3% of the fastest: fewest pieces in flight, then the smallest.
        pick = min(
            (i for i in range(len(trial)) if best[i] <= 1.03 * fastest),
            key=lambda i: (trial[i]["queue_depth"] * trial[i]["thread_count"], trial[i]["block_size"]),
        )
        if "backend" not in given and open_queue(1) is not None:
            kernel = {**trial[pick], "backend": "kernel"}
            (kernel_s,) = _time([kernel], buf, path)
            trial.append(kernel)
            best.append(kernel_s)
            if kernel_s * 1.03 < best[pick]:
                pick = len(trial) - 1
    finally:
        path.unlink(missing_ok=True)
    table = [{**opts, "GB/s": round(2 * PROBE_BYTES / t / 1e9, 3)} for opts, t in zip(trial, best)]
    return dict(trial[pick]), table


def _time(trial: list[dict[str, object]], buf: torch.Tensor, path: Path) -> list[float]:
    """The best of two interleaved rounds of each setting's rewrite and read of ``path``."""
    best = [float("inf")] * len(trial)
    for _ in range(2):
        for i, opts in enumerate(trial):
            with AsyncIO(AioOptions(**opts)) as aio:
                start = time.perf_counter()
                aio.sync_write(buf, path)
                aio.sync_read(buf, path)
                best[i] = min(best[i], time.perf_counter() - start)
    return best
