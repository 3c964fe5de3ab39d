"""The manifest: a checkpoint's layout and engine state, as one JSON file.

It lists every parameter (full shape, dtype, optimizer group, tied aliases), every
buffer, the optimizer state keys, and each rank's shard file with the spans it holds
(see ``[Note: logical checkpoints]``), so that a reader on any layout knows which byte
ranges of which files to read. Engine state (step counters, loss scaler, scheduler,
sampler position, optimizer options), every rank's RNG state and the config ride along,
and the client-state files' sizes and checksums (``[Note: client state as data]``), so
that a missing or damaged one is found as a shard file is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from terascale.checkpoint.order import SliceOrder
from terascale.checkpoint.spans import MASTER, OPTIM, ParamInfo, Span

FORMAT = "terascale-checkpoint"
VERSION = 2  # 2: parameters may record a slice order
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit the model: the message says which file or names."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint manifest")
    return dtype


@dataclass
class ShardFile:
    """One rank's file: its name in the checkpoint folder, size, the spans it holds, and
    the checksum of its bytes (``[Note: checkpoint checksums]``; None in older checkpoints)."""

    name: str
    nbytes: int
    spans: list[Span]
    checksum: str | None = None

    def to_json(self) -> dict:
        d: dict[str, Any] = {"name": self.name, "nbytes": self.nbytes}
        if self.checksum is not None:  # an extra key: readers of version 1 and 2 skip it
            d["checksum"] = self.checksum
        d["spans"] = [[s.key, s.name, s.start, s.end] for s in self.spans]
        return d

    @staticmethod
    def from_json(d: dict) -> ShardFile:
        spans = [Span(k, n, int(a), int(b)) for k, n, a, b in d["spans"]]
        return ShardFile(d["name"], int(d["nbytes"]), spans, d.get("checksum"))


@dataclass
class Manifest:
    """Everything but the tensors' values (see the module docstring)."""

    tag: str
    world_size: int
    stage: int
    params: dict[str, ParamInfo]
    aliases: dict[str, list[str]]  # a tied parameter's other names
    buffers: dict[str, ParamInfo]  # opt_group is -1
    optim_keys: dict[str, dict]  # span key -> {"dtype": name, "scalar": bool}
    files: list[ShardFile]
    engine: dict[str, Any] = field(default_factory=dict)
    rng: list[dict] = field(default_factory=list)  # one per saving rank
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. a Hugging Face model config
    client_files: list[ShardFile] = field(default_factory=list)  # the client state's (no spans)

    def stored_dtype(self, key: str, info: ParamInfo) -> torch.dtype:
        """The dtype tensor ``info`` is stored in under ``key``: masters fp32, optimizer state
        as its key records, frozen parameters and buffers in their own dtype."""
        if key == MASTER:
            return torch.float32
        if key.startswith(OPTIM):
            return parse_dtype(self.optim_keys[key]["dtype"])
        return info.dtype

    def to_json(self) -> str:
        def info(p: ParamInfo) -> dict:
            d = {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "opt_group": p.opt_group}
            if p.order is not None:
                d["order"] = p.order.to_json()
            return d

        doc = {
            "format": FORMAT,
            # A reader that does not know part-after-part orders must not read them as row-major.
            "version": 1 if all(p.order is None for p in self.params.values()) else VERSION,
            "tag": self.tag,
            "world_size": self.world_size,
            "stage": self.stage,
            "params": {n: info(p) for n, p in self.params.items()},
            "aliases": self.aliases,
            "buffers": {n: info(p) for n, p in self.buffers.items()},
            "optim_keys": self.optim_keys,
            "files": [f.to_json() for f in self.files],
            "engine": self.engine,
            "rng": self.rng,
            "config": self.config,
            "extra": self.extra,
            "client_state": [f.to_json() for f in self.client_files],
        }
        try:
            # One line: json's C encoder runs only without indentation, and the RNG states
            # make this thousands of numbers (5 ms a save indented, of a 0.19 s save).
            return json.dumps(doc, separators=(",", ":"))
        except TypeError as exc:
            raise TypeError(
                f"checkpoint state is not JSON-serialisable ({exc}); the LR scheduler's state_dict() "
                "and the optimizer's param-group options must hold plain numbers, strings and lists"
            ) from exc

    @staticmethod
    def read(folder: Path) -> Manifest:
        """The manifest of checkpoint ``folder`` (a clear error if absent or unreadable)."""
        path = folder / MANIFEST
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"'{folder}' is not a terascale checkpoint: {MANIFEST} is missing") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint manifest '{path}' is corrupt or unreadable: {exc}") from exc
        if doc.get("format") != FORMAT:
            raise CheckpointError(f"'{path}' is not a terascale checkpoint manifest")
        if int(doc.get("version", 0)) > VERSION:
            raise CheckpointError(
                f"'{path}' has format version {doc['version']}; this terascale reads up to {VERSION}: upgrade terascale"
            )

        def info(d: dict) -> ParamInfo:
            return ParamInfo(tuple(d["shape"]), parse_dtype(d["dtype"]), int(d["opt_group"]), SliceOrder.from_json(d.get("order")))

        return Manifest(
            tag=doc["tag"],
            world_size=int(doc["world_size"]),
            stage=int(doc["stage"]),
            params={n: info(d) for n, d in doc["params"].items()},
            aliases={n: list(v) for n, v in doc["aliases"].items()},
            buffers={n: info(d) for n, d in doc["buffers"].items()},
            optim_keys=doc["optim_keys"],
            files=[ShardFile.from_json(f) for f in doc["files"]],
            engine=doc.get("engine", {}),
            rng=doc.get("rng", []),
            config=doc.get("config", {}),
            extra=doc.get("extra", {}),
            client_files=[ShardFile.from_json(f) for f in doc.get("client_state", [])],
        )
