"""Tokenizers for data preparation: bytes (the default, nothing to load) or a local Hugging Face one.

A tokenizer here is what ``terascale data prepare`` and the readers agree on: it turns a
document's text into token ids, and it has an identity (``describe()``) that goes into the
dataset's manifest, so that a dataset prepared with one tokenizer is never read as if it
had been prepared with another (``check_tokenizer``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (one array per text, int64 or narrower)."""
        ...

    def describe(self) -> dict[str, Any]:
        """The identity written into a manifest: equal for tokenizers that give the same ids."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (the demo's vocabulary): ids 0–255, no merges, no special tokens."""

    vocab_size = 256

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", errors="surrogateescape"), dtype=np.uint8) for t in texts]

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": 256}


class HuggingFaceTokenizer:
    """A local ``tokenizer.json`` (the ``tokenizers`` library's format; a Hugging Face model
    folder holds one), encoded without special tokens; ``eos``, a token of its vocabulary,
    is appended to every document when given."""

    def __init__(self, path: str | Path, eos: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _Rust
        except ImportError as exc:  # pragma: no cover - the library comes with transformers
            raise ValueError(
                "--tokenizer needs the 'tokenizers' library (pip install tokenizers, or terascale[data])"
            ) from exc
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(
                f"tokenizer {str(path)!r}: no such file; give a tokenizer.json or a folder holding one "
                "(a Hugging Face model folder)"
            )
        self.path = file
        self._raw = file.read_bytes()
        self._tok = _Rust.from_str(self._raw.decode("utf-8"))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos = eos
        self._eos_id: int | None = None
        if eos is not None:
            eos_id = self._tok.token_to_id(eos)
            if eos_id is None:
                raise ValueError(f"--append-eos {eos!r} is not a token of {file}")
            self._eos_id = int(eos_id)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        # The fast variant skips the character offsets, which preparation never reads.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encodings = encode(texts, add_special_tokens=False)
        out = []
        for e in encodings:
            ids = np.asarray(e.ids, dtype=np.int64)
            if self._eos_id is not None:
                ids = np.append(ids, self._eos_id)
            out.append(ids)
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "huggingface",
            "vocab_size": self.vocab_size,
            "sha256": hashlib.sha256(self._raw).hexdigest(),
            "eos": self.eos,
        }

    # Worker processes get the tokenizer by pickling: the JSON travels, the Rust object is rebuilt.
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "eos": self.eos}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["eos"])  # type: ignore[misc]


def load_tokenizer(path: str | Path | None = None, eos: str | None = None) -> Tokenizer:
    """Bytes when ``path`` is None, else the Hugging Face tokenizer at ``path``."""
    if path is None:
        if eos is not None:
            raise ValueError("--append-eos needs --tokenizer: the byte tokenizer has no special tokens")
        return ByteTokenizer()
    return HuggingFaceTokenizer(path, eos)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def check_tokenizer(expected: dict[str, Any], tokenizer: Tokenizer, where: str) -> None:
    """Refuse ``tokenizer`` if it is not the one ``where``'s manifest was prepared with."""
    got = tokenizer.describe()
    if got != expected:
        differ = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        raise ValueError(
            f"{where} was prepared with tokenizer {expected}, not {got} (they differ in {', '.join(differ)}): "
            "its token ids would mean other text; prepare the data again with this tokenizer, or use the one "
            "it was prepared with"
        )
