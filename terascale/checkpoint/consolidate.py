"""One ordinary state dict (or file, or Hugging Face folder) from a sharded checkpoint.

Parameters are assembled one at a time from the spans of every rank's file: the fp32
master where the parameter was trained, the saved compute-dtype value where it was
frozen. Writing a file streams parameter by parameter (``[Note: streamed shard files]``),
so peak memory is about the largest parameter, not the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from terascale.checkpoint.directory import CheckpointDirectory
from terascale.checkpoint.manifest import CheckpointError, Manifest
from terascale.checkpoint.reader import CheckpointReader
from terascale.checkpoint.spans import BUFFER, MASTER, PARAM, ParamInfo
from terascale.checkpoint.stream import SafetensorsStream, TensorEntry
from terascale.offload.aio import AsyncIO

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _folder(path: str | os.PathLike, tag: str | None) -> Path:
    """A checkpoint folder: ``path`` itself, or ``path/<tag>`` (default: ``latest``)."""
    folder = CheckpointDirectory.find(path, tag)
    if folder is None:
        raise CheckpointError(f"'{path}' holds no checkpoint: no manifest.json and no 'latest' file")
    return folder


def _entries(m: Manifest, *, with_aliases: bool) -> list[tuple[str, str, str, ParamInfo]]:
    """``(output name, span key, saved name, info)`` for every tensor of the state dict."""
    out = []
    for name, info in m.params.items():
        key = PARAM if info.opt_group < 0 else MASTER
        out.append((name, key, name, info))
        if with_aliases:
            out.extend((alias, key, name, info) for alias in m.aliases.get(name, []))
    out.extend((name, BUFFER, name, info) for name, info in m.buffers.items())
    return out


def _tensors(
    reader: CheckpointReader, dtype: torch.dtype | None, *, with_aliases: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for out_name, key, name, info in _entries(reader.manifest, with_aliases=with_aliases):
        t = reader.read(key, name, info.numel, reader.manifest.stored_dtype(key, info))
        t = t.view(info.shape) if info.order is None else info.order.to_full(t, info.shape)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield out_name, t


def consolidated_state_dict(
    path: str | os.PathLike, tag: str | None = None, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """The model's state dict from checkpoint ``path`` (a checkpoint folder, or a save
    directory with ``tag``/``latest``): every parameter and persistent buffer by name, as
    ``model.state_dict()`` has them, tied parameters under each of their names (sharing
    one tensor). Floating tensors in ``dtype`` (None: fp32 masters, frozen parameters in
    their compute dtype)."""
    with CheckpointReader(_folder(path, tag)) as reader:
        out: dict[str, torch.Tensor] = {}
        for name, t in _tensors(reader, dtype, with_aliases=False):
            out[name] = t
        for name, aliases in reader.manifest.aliases.items():
            for alias in aliases:
                out[alias] = out[name]
    return out


def write_consolidated(
    path: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    tag: str | None = None,
    dtype: torch.dtype | None = torch.float32,
    with_aliases: bool = True,
    metadata: dict[str, str] | None = None,
) -> int:
    """Stream the consolidated state dict of checkpoint ``path`` into one safetensors file
    ``out_file``, one parameter at a time (a tied parameter is written under each name
    with ``with_aliases``, since safetensors files cannot share tensors). Returns bytes written."""
    with CheckpointReader(_folder(path, tag)) as reader:
        m = reader.manifest
        entries = []
        for out_name, key, _, info in _entries(m, with_aliases=with_aliases):
            stored = m.stored_dtype(key, info)
            if dtype is not None and stored.is_floating_point:
                stored = dtype
            entries.append(TensorEntry(out_name, stored, tuple(info.shape)))
        out_file = Path(out_file)
        out_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_file.with_name(f".{out_file.name}.tmp")
        with AsyncIO() as aio:
            stream = SafetensorsStream(tmp, entries, aio, metadata={"format": "pt", **(metadata or {})})
            try:
                for name, t in _tensors(reader, dtype, with_aliases=with_aliases):
                    stream.write(name, t)
                nbytes = stream.close()
            except BaseException:
                stream.abort()
                tmp.unlink(missing_ok=True)
                raise
        os.replace(tmp, out_file)
    return nbytes


def write_pretrained(path: str | os.PathLike, out_dir: str | os.PathLike, *, tag: str | None = None,
                     dtype: torch.dtype | None = None) -> Path:  # fmt: skip
    """A folder ``from_pretrained`` loads: ``config.json`` (the Hugging Face config the
    checkpoint recorded) and ``model.safetensors`` without the tied duplicates, which
    ``transformers`` re-ties itself."""
    folder = _folder(path, tag)
    m = Manifest.read(folder)
    hf_config = m.extra.get("hf_config")
    if hf_config is None:
        raise CheckpointError(
            f"checkpoint '{folder}' was not saved from a Hugging Face PreTrainedModel (no config recorded); "
            "use `terascale consolidate` to write a plain safetensors file"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_consolidated(folder, out_dir / "model.safetensors", dtype=dtype, with_aliases=False)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    return out_dir
