"""A checkpoint's client state as data: JSON text plus a safetensors file, never a pickle.

[Note: client state as data]
``engine.save_checkpoint(dir, client_state={...})`` keeps the caller's dict with the
checkpoint. Unpickling a file from elsewhere can run any code it names, so the dict is
written as ``client_state.json`` and its tensors as ``client_state.safetensors`` (only when
there are any), and read back with ``json`` and ``safetensors``, which only ever build
data. What cannot be written this way is refused when ``save_checkpoint`` is called,
naming where it is inside the dict, before any file is written.

What a client state may hold, and what comes back:

- ``None``, ``bool``, ``int``, ``str``, ``float`` (``nan`` and infinities too), ``complex``,
  ``bytes``, ``bytearray``: themselves;
- ``list``, ``tuple``, ``set``, ``frozenset``: the same container type; ``dict`` with keys of
  any of these kinds (``int`` keys, as in optimizer state dicts, included): a ``dict``;
  ``OrderedDict`` and ``Counter`` come back as themselves, other dict subclasses
  (``defaultdict``, Lightning's ``AttributeDict``) as a plain ``dict``, other list subclasses
  as a ``list``. Subclasses of ``int``, ``float`` and ``str`` (``IntEnum`` and ``str``-mixin
  enum members) come back as the plain value, which compares equal;
- ``torch.Tensor`` (and ``nn.Parameter``) of any dtype safetensors stores: a tensor with the
  same values, dtype and shape, on the CPU (as DeepSpeed's loader returns them), detached;
  one tensor object referenced twice comes back as one object;
- ``numpy.ndarray`` of a bool, integer, float16/32/64 or complex64 dtype, and numpy scalars
  (``np.random.get_state()`` is ``('MT19937', uint32 array, int, int, float)``): the same
  numpy types; ``random.getstate()``'s nested tuples round-trip as tuples;
- ``argparse.Namespace`` (Megatron-style ``args``), ``torch.Size``, ``torch.dtype``,
  ``torch.device``: themselves.

Anything else (an object of a user class, a plain ``Enum`` member, a namedtuple, a
function) raises ValueError: store its ``state_dict()`` or its plain values instead.

Encoding: JSON-native values are themselves; everything else is a JSON object tagged with
the key ``"__ts__"`` (``{"__ts__": "tuple", "items": [...]}``). A user dict that has that
key itself is written in the tagged form too, so any object carrying the key is a tag.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from terascale.checkpoint.integrity import ALGORITHM, Checksum
from terascale.checkpoint.manifest import CheckpointError, ShardFile

STATE_FILE = "client_state.json"
TENSOR_FILE = "client_state.safetensors"
FILES = (STATE_FILE, TENSOR_FILE)
PICKLED_FILE = "client_state.pt"  # how checkpoints before issue 30 held it
TAG = "__ts__"
FORMAT = "terascale-client-state"
VERSION = 1

# The dtypes safetensors writes (its own table is private). float8 kinds exist on newer torch.
_TENSOR_DTYPES = {
    getattr(torch, name)
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                 "bfloat16", "float32", "float64", "complex64", "float8_e4m3fn", "float8_e5m2",
                 "float8_e4m3fnuz", "float8_e5m2fnuz")  # fmt: skip
    if isinstance(getattr(torch, name, None), torch.dtype)
}
# numpy scalars and arrays: the kinds whose values are plain numbers. The array dtypes are
# those torch.from_numpy takes and safetensors stores (not complex128, not float128).
_NUMPY_SCALARS = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                  "float16", "float32", "float64", "complex64", "complex128"}  # fmt: skip
_NUMPY_ARRAYS = _NUMPY_SCALARS - {"complex128"}
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode(client_state: Mapping[Any, Any]) -> tuple[str, dict[str, torch.Tensor]]:
    """``client_state`` as JSON text and the tensors it references by name (CPU copies,
    contiguous, owning their memory: the caller may change its own afterwards). ValueError,
    naming the place inside ``client_state``, for anything that is not data (see
    ``[Note: client state as data]``)."""
    if not isinstance(client_state, Mapping):
        raise ValueError(f"client_state must be a dict, got {_type_name(client_state)}")
    encoder = _Encoder()
    doc = {"format": FORMAT, "version": VERSION, "state": encoder.value(client_state, "client_state")}
    # allow_nan=False: non-finite floats are tagged, so the file stays strict JSON.
    return json.dumps(doc, separators=(",", ":"), allow_nan=False), encoder.tensors


def decode(text: str, tensors: Mapping[str, torch.Tensor]) -> dict[Any, Any]:
    """The client state :func:`encode` gave as ``text`` and ``tensors``. CheckpointError
    (a ValueError) when the text is not such a document or names a missing tensor."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"the client state is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "state" not in doc:
        raise CheckpointError("the client state is not a terascale client-state document")
    if int(doc.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"the client state has format version {doc['version']}; this terascale reads up to {VERSION}: upgrade terascale"
        )
    return _Decoder(tensors).value(doc["state"])


def to_files(client_state: Mapping[Any, Any]) -> dict[str, bytes]:
    """What a checkpoint folder holds for ``client_state``: file name -> contents, the
    tensor file only when there are tensors. Serialised now, so later changes to the
    caller's dict or tensors do not reach the checkpoint."""
    text, tensors = encode(client_state)
    files = {STATE_FILE: text.encode()}
    if tensors:
        files[TENSOR_FILE] = safetensors.torch.save(tensors)
    return files


def manifest_entries(files: Mapping[str, bytes]) -> list[ShardFile]:
    """The manifest's record of :func:`to_files`'s ``files``: names, sizes, checksums."""
    return [ShardFile(name, len(data), [], _checksum(data)) for name, data in files.items()]


def file_problem(folder: Path, entry: ShardFile) -> str | None:
    """None when client-state file ``entry`` of checkpoint ``folder`` is there with the size
    the manifest records; otherwise what is wrong. (Its checksum is compared as a shard
    file's is, by ``integrity.content_problem``, and whenever it is read.)"""
    path = folder / entry.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"'{path}' is missing"
    except OSError as exc:
        return f"'{path}' cannot be read ({exc})"
    if size != entry.nbytes:
        return f"'{path}' has {size} bytes, the manifest records {entry.nbytes}"
    return None


def read(folder: Path, recorded: Sequence[ShardFile]) -> dict[Any, Any] | None:
    """The client state saved in checkpoint ``folder``, whose manifest ``recorded`` its
    files; None when it holds none in this form. A file missing, or of another size or
    checksum than recorded, is a CheckpointError naming it, as for a shard file."""
    entries = {e.name: e for e in recorded}
    if not entries and not (folder / STATE_FILE).exists():
        return None
    names = list(entries) or [n for n in FILES if (folder / n).exists()]
    data: dict[str, bytes] = {}
    for name in names:
        path = folder / name
        try:
            data[name] = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint '{folder}': '{path}' is missing") from None
        except OSError as exc:
            raise CheckpointError(f"checkpoint '{folder}': '{path}' cannot be read ({exc})") from exc
        problem = _bytes_problem(data[name], entries[name]) if name in entries else None
        if problem is not None:
            raise CheckpointError(f"checkpoint '{folder}': '{path}' {problem}")
    if STATE_FILE not in data:
        raise CheckpointError(f"checkpoint '{folder}': '{folder / STATE_FILE}' is missing")
    try:
        text = data[STATE_FILE].decode()
        tensors = safetensors.torch.load(data[TENSOR_FILE]) if TENSOR_FILE in data else {}
        return decode(text, tensors)
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type for a corrupt file, bad UTF-8
        raise CheckpointError(f"checkpoint '{folder}': its client state is corrupt or unreadable ({exc})") from exc


def _bytes_problem(data: bytes, entry: ShardFile) -> str | None:
    if len(data) != entry.nbytes:
        return f"has {len(data)} bytes, the manifest records {entry.nbytes}"
    if entry.checksum is not None and entry.checksum.startswith(f"{ALGORITHM}:") and _checksum(data) != entry.checksum:
        return f"is corrupted: its bytes have checksum {_checksum(data)}, the manifest records {entry.checksum}"
    return None


def _checksum(data: bytes) -> str:
    checksum = Checksum()
    checksum.update(data)
    return checksum.value


def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _refuse(path: str, value: Any, hint: str = "store its state_dict() or plain values") -> ValueError:
    return ValueError(f"{path}: type {_type_name(value)} cannot be saved as data; {hint}")


class _Encoder:
    """One :func:`encode` call: the tensors met so far, by name."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] = {}  # id of a tensor or array already stored -> its name
        self._keep: list[Any] = []  # those objects, alive so that their ids stay theirs
        self._open: set[int] = set()  # containers being encoded: one met again is a cycle

    def value(self, v: Any, path: str) -> Any:
        t = type(v)
        if v is None or t in (bool, int, str):
            return v
        if t is float:
            return v if math.isfinite(v) else {TAG: "float", "value": repr(v)}
        if isinstance(v, np.generic):  # before float: np.float64 subclasses float
            return self._numpy_scalar(v, path)
        if isinstance(v, torch.Tensor):
            return {TAG: "tensor", "name": self._tensor(v, path)}
        if isinstance(v, np.ndarray):
            return {TAG: "ndarray", "name": self._array(v, path)}
        if isinstance(v, (torch.dtype, torch.device)):
            return {TAG: f"torch.{t.__name__}", "name": str(v).removeprefix("torch.")}
        if t is complex:
            return {TAG: "complex", "real": self.value(v.real, path), "imag": self.value(v.imag, path)}
        if t in (bytes, bytearray):
            return {TAG: t.__name__, "base64": base64.b64encode(v).decode()}
        if isinstance(v, Enum) and not isinstance(v, (int, float, str)):
            raise _refuse(path, v, "store its .value")
        for plain in (int.__int__, float.__float__, str.__str__):  # IntEnum, str-mixin enums
            if isinstance(v, plain.__objclass__):
                return self.value(plain(v), path)  # the plain value: a subclass's str() may differ
        if id(v) in self._open:
            raise ValueError(f"{path}: refers to a container it is inside; a checkpoint holds trees of data")
        self._open.add(id(v))
        try:
            return self._container(v, path)
        finally:
            self._open.discard(id(v))

    def _container(self, v: Any, path: str) -> Any:
        if isinstance(v, Mapping):
            return self._mapping(v, path)
        if isinstance(v, torch.Size):
            return {TAG: "torch.Size", "items": [int(d) for d in v]}
        if type(v) is tuple:
            return {TAG: "tuple", "items": [self.value(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, tuple):  # a namedtuple: its class would have to be imported back
            raise _refuse(path, v, "store v._asdict() or a plain tuple")
        if isinstance(v, list):
            return [self.value(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            kind = "frozenset" if isinstance(v, frozenset) else "set"
            return {TAG: kind, "items": [self._key(x, f"{path} (an element)") for x in v]}
        if isinstance(v, argparse.Namespace):
            attrs = vars(v)
            for name in attrs:
                if not isinstance(name, str):
                    raise ValueError(f"{path}: a Namespace attribute named {name!r} is not a string")
            return {TAG: "Namespace", "attrs": {n: self.value(x, f"{path}.{n}") for n, x in attrs.items()}}
        raise _refuse(path, v)

    def _mapping(self, v: Mapping[Any, Any], path: str) -> Any:
        kind = "OrderedDict" if isinstance(v, OrderedDict) else "Counter" if isinstance(v, Counter) else "dict"
        if kind == "dict" and all(type(k) is str for k in v) and TAG not in v:
            return {k: self.value(x, f"{path}[{k!r}]") for k, x in v.items()}
        # Keys that JSON objects cannot hold, or the tag key itself: pairs of encoded values.
        items = [[self._key(k, f"{path} (the key {k!r})"), self.value(x, f"{path}[{k!r}]")] for k, x in v.items()]
        return {TAG: kind, "items": items}

    def _key(self, k: Any, path: str) -> Any:
        # A dict key or set element must come back hashable and equal to itself.
        if isinstance(k, (torch.Tensor, np.ndarray, list, dict, set, bytearray)):
            raise _refuse(path, k, "use keys of plain values (str, int, float, tuples of them)")
        return self.value(k, path)

    def _tensor(self, t: torch.Tensor, path: str) -> str:
        if id(t) in self._names:
            return self._names[id(t)]
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise _refuse(path, t, "store a plain tensor")
        if t.layout != torch.strided:
            raise ValueError(f"{path}: a {t.layout} tensor cannot be saved as data; store t.to_dense()")
        if t.dtype not in _TENSOR_DTYPES:
            raise ValueError(
                f"{path}: a tensor of dtype {t.dtype} cannot be saved as data (safetensors does not store it)"
            )
        if t.device.type == "meta":
            raise ValueError(f"{path}: a tensor on the meta device has no values to save")
        # A copy of its own: the caller may change the tensor after save_checkpoint returns.
        copy = t.detach().resolve_conj().resolve_neg().to("cpu", memory_format=torch.contiguous_format, copy=True)
        return self._store(t, copy)

    def _array(self, a: np.ndarray, path: str) -> str:
        if id(a) in self._names:
            return self._names[id(a)]
        if type(a) is not np.ndarray:
            raise _refuse(path, a, "store a plain numpy array")
        if a.dtype.name not in _NUMPY_ARRAYS or a.dtype.fields is not None:
            raise ValueError(f"{path}: a numpy array of dtype {a.dtype} cannot be saved as data; "
                             "store arrays of bool, integer, float16/32/64 or complex64 values")  # fmt: skip
        native = np.array(a, dtype=a.dtype.newbyteorder("="), order="C", copy=True)
        return self._store(a, torch.from_numpy(native))

    def _store(self, original: Any, copy: torch.Tensor) -> str:
        name = f"t{len(self.tensors)}"
        self.tensors[name] = copy
        self._names[id(original)] = name
        self._keep.append(original)
        return name

    def _numpy_scalar(self, v: np.generic, path: str) -> Any:
        if isinstance(v, (np.str_, np.bytes_)):  # subclasses of str and bytes: their plain value
            return self.value(str(v) if isinstance(v, np.str_) else bytes(v), path)
        if v.dtype.name not in _NUMPY_SCALARS:
            raise ValueError(f"{path}: a numpy scalar of dtype {v.dtype} cannot be saved as data; store a plain value")
        return {TAG: "numpy", "dtype": v.dtype.name, "value": self.value(v.item(), path)}


class _Decoder:
    """One :func:`decode` call over the tensors the document names."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._arrays: dict[str, np.ndarray] = {}

    def value(self, v: Any) -> Any:
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if not isinstance(v, dict):
            return v
        if TAG not in v:
            return {k: self.value(x) for k, x in v.items()}
        kind = v[TAG]
        try:
            return self._tagged(kind, v)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"a malformed {kind!r} entry ({type(exc).__name__}: {exc})") from exc

    def _tagged(self, kind: Any, v: dict[str, Any]) -> Any:
        if kind in ("dict", "OrderedDict", "Counter"):
            pairs = [(self.value(k), self.value(x)) for k, x in v["items"]]
            return {"dict": dict, "OrderedDict": OrderedDict, "Counter": Counter}[kind](dict(pairs))
        if kind in ("tuple", "set", "frozenset"):
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](self.value(x) for x in v["items"])
        if kind == "float":
            return _NON_FINITE[v["value"]]
        if kind == "complex":
            return complex(self.value(v["real"]), self.value(v["imag"]))
        if kind in ("bytes", "bytearray"):
            data = base64.b64decode(v["base64"], validate=True)
            return data if kind == "bytes" else bytearray(data)
        if kind == "tensor":
            return self._tensor(v["name"])
        if kind == "ndarray":
            name = v["name"]
            if name not in self._arrays:  # one array object per name, as saved
                self._arrays[name] = self._tensor(name).numpy()
            return self._arrays[name]
        if kind == "numpy":
            if v["dtype"] not in _NUMPY_SCALARS:
                raise CheckpointError(f"a numpy scalar of dtype {v['dtype']!r}, which terascale does not write")
            return np.dtype(v["dtype"]).type(self.value(v["value"]))
        if kind == "Namespace":
            return argparse.Namespace(**{str(n): self.value(x) for n, x in v["attrs"].items()})
        if kind == "torch.Size":
            return torch.Size(int(d) for d in v["items"])
        if kind == "torch.dtype":
            dtype = getattr(torch, str(v["name"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown torch dtype {v['name']!r}")
            return dtype
        if kind == "torch.device":
            return torch.device(str(v["name"]))
        raise CheckpointError(f"an entry of unknown kind {kind!r} (written by a newer terascale?)")

    def _tensor(self, name: Any) -> torch.Tensor:
        if name not in self._tensors:
            raise CheckpointError(f"it references tensor {name!r}, which the tensor file does not hold")
        return self._tensors[name]
