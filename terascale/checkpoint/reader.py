"""Reading spans back from a checkpoint on any layout.

:class:`CheckpointReader` indexes the manifest's spans by ``(key, name)``; a request for
elements ``[start, end)`` of a tensor is answered from every saved span that overlaps
it, reading only the overlapping byte range of each file (``safetensors`` slices), so a
rank of a new layout reads exactly the state it will hold.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from terascale.checkpoint.manifest import CheckpointError, Manifest, ShardFile
from terascale.checkpoint.spans import Span


class CheckpointReader:
    """Reads spans of checkpoint ``folder``. Checks up front that every shard file
    exists with the size the manifest recorded; use as a context manager."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        self._index: dict[tuple[str, str], list[tuple[int, int, ShardFile]]] = {}
        for f in self.manifest.files:
            path = self.folder / f.name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint shard '{path}' is missing") from None
            if size != f.nbytes:
                raise CheckpointError(
                    f"checkpoint shard '{path}' is corrupt: {size} bytes where the manifest records {f.nbytes}"
                )
            for s in f.spans:
                self._index.setdefault((s.key, s.name), []).append((s.start, s.end, f))
        for spans in self._index.values():
            spans.sort(key=lambda t: t[0])
        self._starts = {k: [s for s, _, _ in v] for k, v in self._index.items()}
        self._files = contextlib.ExitStack()
        self._open: dict[str, object] = {}

    def has(self, key: str, name: str) -> bool:
        return (key, name) in self._index

    @torch.no_grad()
    def read_into(self, span: Span, out: torch.Tensor) -> None:
        """Fill ``out`` (``span.numel`` elements, any shape, dtype and device) with
        elements ``[span.start, span.end)`` of the saved tensor ``span.key``/``span.name``."""
        flat = out.reshape(-1)
        assert flat.numel() == span.numel, (span, out.shape)
        saved = self._index.get((span.key, span.name))
        if saved is None:
            raise CheckpointError(f"checkpoint '{self.folder}' holds no {span.key} for '{span.name}'")
        covered = span.start
        i = max(0, bisect.bisect_right(self._starts[(span.key, span.name)], span.start) - 1)
        for start, end, f in saved[i:]:
            if start >= span.end:
                break
            a, b = max(start, span.start), min(end, span.end)
            if a >= b:
                continue
            if a > covered:
                break
            part = self._slice(f, Span(span.key, span.name, start, end), a - start, b - start)
            flat[a - span.start : b - span.start].copy_(part.reshape(-1))
            covered = max(covered, b)
        if covered < span.end:
            raise CheckpointError(
                f"checkpoint '{self.folder}' is incomplete: elements [{covered}, {span.end}) of {span.key} "
                f"'{span.name}' are in no shard file"
            )

    def read(self, key: str, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """All ``numel`` elements of saved tensor ``key``/``name`` as a flat CPU tensor of ``dtype``."""
        out = torch.empty(numel, dtype=dtype)
        self.read_into(Span(key, name, 0, numel), out)
        return out

    def _slice(self, f: ShardFile, saved: Span, lo: int, hi: int) -> torch.Tensor:
        path = self.folder / f.name
        try:
            handle = self._open.get(f.name)
            if handle is None:
                handle = self._files.enter_context(safe_open(str(path), framework="pt"))
                self._open[f.name] = handle
            return handle.get_slice(saved.tensor_key)[lo:hi]
        except (SafetensorError, OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"checkpoint shard '{path}' is corrupt or unreadable: {exc}") from exc

    def close(self) -> None:
        self._files.close()
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
