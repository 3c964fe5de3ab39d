"""DeepSpeed's op builders, answering for what terascale runs in their place.

DeepSpeed compiles C++/CUDA ops on demand; programs ask a builder whether its op can run
here (``deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME]``, ``is_compatible()``) and
``load()`` it. terascale compiles nothing: its ops are torch code or its own modules, so a
builder is *compatible* exactly when terascale has the op's function, and ``load()``
returns what terascale has of the op's module interface:

- ``async_io``: ``aio_handle``, DeepSpeed's file I/O handle over :class:`terascale.offload.AsyncIO`;
- ``utils``: ``flatten`` / ``unflatten`` of tensor lists, ``cast_to_byte_tensor``;
- ``cpu_adam``, ``fused_adam``, ``fused_lamb``, ``cpu_adagrad``, ``cpu_lion``: compatible (the optimizer
  classes of ``deepspeed.ops`` run in torch); their kernel modules do not exist, and
  ``load()`` says so;
- every other builder: not compatible; ``load()`` raises with the reason.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from terascale.offload.aio import ALIGNMENT, AioOptions, AsyncIO, IoHandle

_TORCH_OPTIMIZER = ("terascale's {cls} runs in torch (deepspeed.ops); there is no compiled {name} kernel module "
                    "to load")  # fmt: skip
_NOT_BUILT = "terascale builds no C++/CUDA ops; the {name} op has no terascale counterpart"


class OpBuilder:
    """One DeepSpeed op: ``NAME``, whether terascale runs it, and what ``load()`` gives."""

    NAME = "op"
    BUILD_VAR = "DS_BUILD_OP"
    _torch_class: str | None = None  # the deepspeed.ops class that stands for the op

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return type(self)._loader is not OpBuilder._loader or self._torch_class is not None

    def _loader(self) -> Any:
        if self._torch_class is not None:
            raise RuntimeError(_TORCH_OPTIMIZER.format(cls=self._torch_class, name=self.NAME))
        raise RuntimeError(_NOT_BUILT.format(name=self.NAME))

    def load(self, verbose: bool = True) -> Any:
        return self._loader()

    def jit_load(self, verbose: bool = True) -> Any:
        return self._loader()

    def builder(self) -> Any:
        raise RuntimeError(_NOT_BUILT.format(name=self.NAME))

    # The toolchain queries DeepSpeed's setup makes: torch's own answers.
    @staticmethod
    def is_rocm_pytorch() -> bool:
        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return (0, 0)
        major, minor = (hip.split(".") + ["0"])[:2]
        return (int(major), int(minor))

    @staticmethod
    def installed_cuda_version() -> tuple[int, int]:
        if not torch.version.cuda:
            raise RuntimeError("this torch is built without CUDA")
        major, minor = (torch.version.cuda.split(".") + ["0"])[:2]
        return (int(major), int(minor))


# -- async_io ------------------------------------------------------------------------------------


class aio_handle:  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's file I/O handle: whole-tensor reads and writes of files, synchronous or
    queued until :meth:`wait`, on a :class:`terascale.offload.AsyncIO` engine."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1) -> None:  # fmt: skip
        # terascale's engine splits requests into aligned pieces: round the block up.
        block = max(ALIGNMENT, -(-block_size // ALIGNMENT) * ALIGNMENT)
        self._block_size, self._queue_depth = block_size, queue_depth
        self._single_submit, self._overlap_events = single_submit, overlap_events
        self._intra_op_parallelism = intra_op_parallelism
        options = AioOptions(block_size=block, queue_depth=queue_depth, thread_count=intra_op_parallelism,
                             single_submit=single_submit, overlap_events=True)  # fmt: skip
        # O_DIRECT needs aligned buffers and sizes, which DeepSpeed's callers do not promise.
        self._io = AsyncIO(options, direct=False)
        self._pending: list[IoHandle] = []

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_thread_count(self) -> int:
        return self._intra_op_parallelism

    def _check_read(self, buffer: torch.Tensor, filename: str, file_offset: int) -> None:
        size = os.path.getsize(filename)
        nbytes = buffer.numel() * buffer.element_size()
        if file_offset + nbytes > size:
            raise ValueError(f"{filename}: {size} bytes, cannot read {nbytes} from offset {file_offset}")

    def pread(self, buffer: torch.Tensor, filename: str, validate: bool = False, async_op: bool = False,
              file_offset: int = 0) -> int:  # fmt: skip
        """Read ``buffer``'s size of bytes of ``filename`` from ``file_offset`` into it
        (``async_op``: queued until :meth:`wait`). Returns 0 when queued, else 1."""
        self._check_read(buffer, filename, file_offset)
        handle = self._io.read(_host(buffer), filename, file_offset)
        return self._finish(handle, async_op)

    def pwrite(self, buffer: torch.Tensor, filename: str, validate: bool = False, async_op: bool = False,
               file_offset: int = 0) -> int:  # fmt: skip
        """Write ``buffer``'s bytes into ``filename`` at ``file_offset`` (created if missing)."""
        if file_offset == 0 and os.path.exists(filename):
            os.truncate(filename, 0)  # DeepSpeed's writes replace the file's contents
        handle = self._io.write(_host(buffer), filename, file_offset)
        return self._finish(handle, async_op)

    def _finish(self, handle: IoHandle, async_op: bool) -> int:
        if async_op:
            self._pending.append(handle)
            return 0
        handle.wait()
        return 1

    def read(self, buffer: torch.Tensor, filename: str, validate: bool = False, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, validate, False, file_offset)

    def write(self, buffer: torch.Tensor, filename: str, validate: bool = False, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, validate, False, file_offset)

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, True, file_offset)

    def wait(self) -> int:
        """Wait for every queued read and write; return how many there were."""
        pending, self._pending = self._pending, []
        for h in pending:
            h.wait()
        return len(pending)

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``num_elem`` elements of ``example_tensor``'s dtype, pinned where
        a device is there to pin for."""
        return torch.empty(num_elem, dtype=example_tensor.dtype, pin_memory=torch.cuda.is_available())

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return True


def _host(buffer: torch.Tensor) -> torch.Tensor:
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError("aio_handle reads and writes contiguous host tensors (copy device tensors through one)")
    return buffer


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"

    def _loader(self) -> Any:
        return SimpleNamespace(aio_handle=aio_handle)


def cast_to_byte_tensor(tensors: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """Each contiguous tensor's bytes as a flat ``uint8`` view of the same memory."""
    if isinstance(tensors, (list, tuple)):
        return [cast_to_byte_tensor(t) for t in tensors]
    if not tensors.is_contiguous():
        raise ValueError("cast_to_byte_tensor needs a contiguous tensor (its bytes viewed in place)")
    return tensors.reshape(-1).view(torch.uint8)


class UtilsBuilder(OpBuilder):
    NAME = "utils"

    def _loader(self) -> Any:
        return SimpleNamespace(flatten=_flatten_dense_tensors, unflatten=_unflatten_dense_tensors,
                               cast_to_byte_tensor=cast_to_byte_tensor)  # fmt: skip


def _torch_op(cls_name: str, op: str) -> type[OpBuilder]:
    return type(cls_name, (OpBuilder,), {"NAME": op, "_torch_class": cls_name.replace("Builder", "")})


CPUAdamBuilder = _torch_op("CPUAdamBuilder", "cpu_adam")
FusedAdamBuilder = _torch_op("FusedAdamBuilder", "fused_adam")
FusedLambBuilder = _torch_op("FusedLambBuilder", "fused_lamb")
CPUAdagradBuilder = _torch_op("CPUAdagradBuilder", "cpu_adagrad")
CPULionBuilder = _torch_op("CPULionBuilder", "cpu_lion")
FusedLionBuilder = _torch_op("FusedLionBuilder", "fused_lion")


def _unbuilt(cls_name: str, op: str) -> type[OpBuilder]:
    return type(cls_name, (OpBuilder,), {"NAME": op})


_UNBUILT = {
    "GDSBuilder": "gds", "QuantizerBuilder": "quantizer", "FPQuantizerBuilder": "fp_quantizer",
    "TransformerBuilder": "transformer", "StochasticTransformerBuilder": "stochastic_transformer",
    "SparseAttnBuilder": "sparse_attn", "InferenceBuilder": "transformer_inference",
    "RandomLTDBuilder": "random_ltd", "SpatialInferenceBuilder": "spatial_inference",
    "CCLCommBuilder": "deepspeed_ccl_comm", "ShareMemCommBuilder": "deepspeed_shm_comm",
    "InferenceCoreBuilder": "inference_core_ops", "RaggedOpsBuilder": "ragged_device_ops",
    "RaggedUtilsBuilder": "ragged_ops", "EvoformerAttnBuilder": "evoformer_attn",
    "CUTLASSOpsBuilder": "cutlass_ops", "DeepCompileBuilder": "dc", "TransformerInferenceBuilder": "transformer_inference",
}  # fmt: skip
globals().update({cls: _unbuilt(cls, op) for cls, op in _UNBUILT.items()})

ALL_OPS: dict[str, type[OpBuilder]] = {
    b.NAME: b for b in (AsyncIOBuilder, UtilsBuilder, CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder,
                        CPUAdagradBuilder, CPULionBuilder, FusedLionBuilder,
                        *(globals()[c] for c in _UNBUILT))  # fmt: skip
}
# ``deepspeed.ops.__compatible_ops__``: one dict for the process (programs may edit it).
COMPATIBLE_OPS: dict[str, bool] = {name: b().is_compatible() for name, b in ALL_OPS.items()}
COMPATIBLE_OPS["deepspeed_not_implemented"] = False
BUILDERS = sorted(["OpBuilder", "AsyncIOBuilder", "UtilsBuilder", "CPUAdamBuilder", "FusedAdamBuilder",
                   "FusedLambBuilder", "CPUAdagradBuilder", "CPULionBuilder", "FusedLionBuilder", *_UNBUILT])
