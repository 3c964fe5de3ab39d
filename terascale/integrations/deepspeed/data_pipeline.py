"""Two standalone pieces of DeepSpeed's data pipeline: the curriculum difficulty schedule
and Megatron's memory-mapped token dataset format.

:class:`CurriculumScheduler` maps the global step to a difficulty (a sequence length, say)
between ``min_difficulty`` and ``max_difficulty`` by DeepSpeed's schedules; the program
applies the difficulty itself. (The engine-driven curriculum and data-efficiency
pipeline, ``curriculum_learning`` / ``data_efficiency`` in the config, is not built.)

:class:`MMapIndexedDataset` reads Megatron's ``.bin``/``.idx`` pair (written by Megatron's
``preprocess_data.py`` or :class:`MMapIndexedDatasetBuilder`): an index of sequence lengths,
byte offsets and document boundaries, and the tokens, memory-mapped.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

_SCHEDULES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")


class CurriculumScheduler:
    """DeepSpeed's curriculum schedule (``schedule_type`` and ``schedule_config`` as in its config)."""

    def __init__(self, config: dict[str, Any]) -> None:
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if key not in config:
                raise ValueError(f"curriculum learning config needs {key!r}")
        self.min_difficulty, self.max_difficulty = config["min_difficulty"], config["max_difficulty"]
        self.schedule_type = config["schedule_type"]
        if self.schedule_type not in _SCHEDULES:
            raise ValueError(f"schedule_type {self.schedule_type!r}: expected one of {', '.join(_SCHEDULES)}")
        self.schedule = dict(config.get("schedule_config", {}))
        if self.schedule_type == "fixed_discrete":
            d, s = self.schedule.get("difficulty"), self.schedule.get("max_step")
            if not d or s is None or len(d) != len(s) + 1:
                raise ValueError("fixed_discrete needs schedule_config.difficulty with one more entry than max_step")
        elif self.schedule_type in ("fixed_linear", "fixed_root"):
            need = ["total_curriculum_step", "difficulty_step"] + (["root_degree"] * (self.schedule_type == "fixed_root"))
            for key in need:
                if key not in self.schedule:
                    raise ValueError(f"{self.schedule_type} needs schedule_config.{key}")
        self.current_difficulty = self.min_difficulty
        self.first_step = True
        self.custom_get_difficulty: Callable[[int], Any] | None = None

    def get_current_difficulty(self) -> Any:
        return self.current_difficulty

    def set_current_difficulty(self, difficulty: Any) -> None:
        self.current_difficulty = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict[str, Any]:
        return {"current_difficulty": self.current_difficulty, "min_difficulty": self.min_difficulty,
                "max_difficulty": self.max_difficulty, "schedule_type": self.schedule_type,
                "schedule": dict(self.schedule)}  # fmt: skip

    def set_state(self, state: dict[str, Any]) -> None:
        self.current_difficulty = state["current_difficulty"]
        self.min_difficulty, self.max_difficulty = state["min_difficulty"], state["max_difficulty"]
        self.schedule_type, self.schedule = state["schedule_type"], dict(state["schedule"])

    def _root(self, global_steps: int, degree: float) -> int:
        s = self.schedule
        fraction = (float(global_steps) / s["total_curriculum_step"]) ** (1.0 / degree)
        value = math.floor(fraction * (self.max_difficulty - self.min_difficulty) + self.min_difficulty)
        value -= value % s["difficulty_step"]
        return min(value, self.max_difficulty)

    def get_difficulty(self, global_steps: int) -> Any:
        if self.schedule_type == "fixed_discrete":
            for difficulty, max_step in zip(self.schedule["difficulty"], self.schedule["max_step"]):
                if global_steps <= max_step:
                    return difficulty
            return self.schedule["difficulty"][-1]
        if self.schedule_type == "fixed_linear":
            return self._root(global_steps, 1)
        if self.schedule_type == "fixed_root":
            return self._root(global_steps, self.schedule["root_degree"])
        if self.custom_get_difficulty is None:
            raise ValueError("schedule_type 'custom' needs set_custom_get_difficulty(fn) first")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        if self.current_difficulty < self.max_difficulty:
            self.current_difficulty = self.get_difficulty(global_steps)
        return self.current_difficulty


# -- Megatron's memory-mapped indexed dataset ------------------------------------------------------

_MAGIC = b"MMIDIDX\x00\x00"
_DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                            7: np.double, 8: np.uint16, 9: np.uint32, 10: np.uint64}  # fmt: skip


def _code(dtype: Any) -> int:
    for code, t in _DTYPES.items():
        if np.dtype(t) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {dtype} has no code in the indexed dataset format")


def index_file_path(prefix_path: str) -> str:
    return prefix_path + ".idx"


def data_file_path(prefix_path: str) -> str:
    return prefix_path + ".bin"


class MMapIndexedDataset:
    """Sequences of tokens from ``<path>.bin`` indexed by ``<path>.idx``; ``ds[i]`` is sequence
    ``i`` as a NumPy array, ``ds[a:b]`` a list of them; ``doc_idx`` the document boundaries."""

    def __init__(self, path: str, skip_warmup: bool = False) -> None:
        self._path = path
        with open(index_file_path(path), "rb") as f:
            if f.read(9) != _MAGIC:
                raise ValueError(f"{index_file_path(path)} is not an indexed dataset index (bad magic)")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != 1:
                raise ValueError(f"{index_file_path(path)}: index version {version}, expected 1")
            (code,) = struct.unpack("<B", f.read(1))
            self._dtype = np.dtype(_DTYPES[code])
            (count,) = struct.unpack("<Q", f.read(8))
            (doc_count,) = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        index = np.memmap(index_file_path(path), mode="r", order="C")
        self._sizes = np.frombuffer(index, dtype=np.int32, count=count, offset=offset)
        self._pointers = np.frombuffer(index, dtype=np.int64, count=count, offset=offset + self._sizes.nbytes)
        self._doc_idx = np.frombuffer(index, dtype=np.int64, count=doc_count,
                                      offset=offset + self._sizes.nbytes + self._pointers.nbytes)  # fmt: skip
        self._index = index
        self._bin = np.memmap(data_file_path(path), mode="r", order="C")

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("indexed datasets slice contiguously (step 1)")
            return [self.get(i) for i in range(start, stop)]
        if idx < 0:
            idx += len(self)
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Sequence ``idx`` from token ``offset`` on, ``length`` tokens (default: to its end)."""
        size = int(self._sizes[idx])
        length = size - offset if length is None else length
        start = int(self._pointers[idx]) + offset * self._dtype.itemsize
        return np.frombuffer(self._bin, dtype=self._dtype, count=length, offset=start)

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


class MMapIndexedDatasetBuilder:
    """Writes ``out_file`` (the ``.bin``) item by item; ``finalize(index_file)`` writes the index."""

    def __init__(self, out_file: str, dtype: Any = np.int64) -> None:
        self._file = open(out_file, "wb")  # noqa: SIM115 - closed in finalize
        self._dtype = np.dtype(dtype)
        self._sizes: list[int] = []
        self._doc_idx = [0]

    def add_item(self, tensor: Any) -> None:
        array = np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor, dtype=self._dtype)
        self._file.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file: str) -> None:
        self._file.close()
        sizes = np.array(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes):
            pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64) * self._dtype.itemsize)
        with open(index_file, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _code(self._dtype)))
            f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(self._doc_idx)))
            f.write(sizes.tobytes(order="C") + pointers.tobytes(order="C"))
            f.write(np.array(self._doc_idx, dtype=np.int64).tobytes(order="C"))
