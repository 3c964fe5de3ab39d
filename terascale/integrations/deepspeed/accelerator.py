"""``get_accelerator()``: DeepSpeed's device abstraction, for the CPU and CUDA.

DeepSpeed programs write ``get_accelerator().device_name()``, ``.current_device_name()``,
``.synchronize()``, ``.memory_allocated()``, ``.manual_seed_all(s)`` ... instead of
``torch.cuda``. :class:`Accelerator` answers those calls for the device terascale trains
on: CUDA when it is available, else the CPU; ``TERASCALE_DEVICE`` (or DeepSpeed's
``DS_ACCELERATOR``) set to ``cpu`` or ``cuda`` chooses, as in
:func:`terascale.comm.init_distributed`. On the CPU, memory figures are the process's
resident set (what DeepSpeed's CPU accelerator reports too), streams are torch's CPU
stubs and events are host timers, so timing code written for CUDA runs unchanged.

``get_op_builder(name)`` / ``create_op_builder(name)`` give DeepSpeed's builder classes as
terascale answers them (:mod:`terascale.integrations.deepspeed.op_builders`: compatible
where terascale runs the op in torch or its own modules); what only building extensions
needs (``build_extension``, ``op_builder_dir``) is refused by name: terascale builds no
C++/CUDA extension.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

_NO_COMPILED_OPS = (
    "get_accelerator().{name}: terascale builds no C++/CUDA ops (DeepSpeed's op builders); "
    "its optimizers and I/O engine are plain PyTorch and Python (terascale.optim, terascale.offload.AsyncIO)"
)
_REFUSED = {"build_extension", "op_builder_dir"}


class _HostEvent:
    """A CUDA-event lookalike on the host: ``record()`` takes the time (CPU work is
    synchronous, so that is when everything before it finished)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _HostEvent) -> float:
        """Milliseconds from this event to ``end``, as ``torch.cuda.Event.elapsed_time``."""
        if self._t is None or end._t is None:
            raise ValueError("elapsed_time: both events must be recorded first")
        return (end._t - self._t) * 1000.0


def _device_type() -> str:
    choice = os.environ.get("TERASCALE_DEVICE") or os.environ.get("DS_ACCELERATOR")
    if choice:
        if choice not in ("cpu", "cuda"):
            raise ValueError(f"TERASCALE_DEVICE/DS_ACCELERATOR={choice!r}: terascale runs on 'cpu' or 'cuda'")
        return choice
    return "cuda" if torch.cuda.is_available() else "cpu"


class Accelerator:
    """DeepSpeed's accelerator interface for ``device_type`` (``"cuda"`` or ``"cpu"``)."""

    def __init__(self, device_type: str) -> None:
        self._name = device_type
        self._cuda = device_type == "cuda"
        self._peak_rss = 0

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    def __getattr__(self, name: str) -> Any:
        if name in _REFUSED:
            raise AttributeError(_NO_COMPILED_OPS.format(name=name))
        raise AttributeError(f"get_accelerator() has no attribute {name!r}")

    # -- devices ---------------------------------------------------------------------------------

    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        """A context that makes ``device_index`` current (``torch.cuda.device``); None on the CPU."""
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """The current CUDA device index; on the CPU, the local rank (as DeepSpeed's)."""
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """CUDA devices; on the CPU, as DeepSpeed's CPU accelerator counts: one "device" per
        local rank (``LOCAL_SIZE``, which launchers set), else 1."""
        if self._cuda:
            return torch.cuda.device_count()
        local = os.environ.get("LOCAL_SIZE", "")
        return int(local) if local.isdigit() and int(local) > 0 else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_synchronized_device(self) -> bool:
        return not self._cuda  # the CPU runs each op to completion

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda else []

    # -- random numbers --------------------------------------------------------------------------

    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        (torch.cuda.manual_seed if self._cuda else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # -- streams and events ----------------------------------------------------------------------

    @property
    def Stream(self) -> type:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._cuda else torch.cpu.Stream

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else torch.cpu.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else torch.cpu.current_stream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else torch.cpu.current_stream()

    @property
    def Event(self) -> type:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._cuda else _HostEvent

    # -- memory (bytes) ----------------------------------------------------------------------------

    def _rss(self) -> int:
        rss = psutil.Process().memory_info().rss
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """CUDA: torch's peak; CPU: the largest resident set seen by this object's calls."""
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = 0
            self._rss()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    memory_cached = memory_reserved  # DeepSpeed's older names
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self._rss(), "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return psutil.virtual_memory().available

    # -- data types --------------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True  # torch runs fp16 on CUDA and, more slowly, on the CPU

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32, torch.float16]
        return out + [torch.bfloat16] if self.is_bf16_supported() else out

    def is_triton_supported(self) -> bool:
        if not self._cuda:
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return torch.cuda.get_device_capability()[0] >= 7

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    # ``get_accelerator().LongTensor([1, 2])``: a tensor of that dtype on this device.
    BFloat16Tensor = property(lambda self: self._tensor_type(torch.bfloat16))
    ByteTensor = property(lambda self: self._tensor_type(torch.uint8))
    DoubleTensor = property(lambda self: self._tensor_type(torch.float64))
    FloatTensor = property(lambda self: self._tensor_type(torch.float32))
    HalfTensor = property(lambda self: self._tensor_type(torch.float16))
    IntTensor = property(lambda self: self._tensor_type(torch.int32))
    LongTensor = property(lambda self: self._tensor_type(torch.int64))

    # -- host memory -------------------------------------------------------------------------------

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` in page-locked host memory (the tensor itself on a machine without CUDA,
        where pinning would buy nothing)."""
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def unpin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- profiling ranges, graphs, compile ------------------------------------------------------

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        if self._cuda:
            torch.cuda._lazy_call(callback)
        else:
            callback()

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph() if self._cuda else None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        import contextlib

        return torch.cuda.graph(graph, pool, stream) if self._cuda else contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        if self._cuda:
            graph.replay()

    def get_op_builder(self, class_name: str) -> Any:
        """DeepSpeed's builder class ``class_name`` (``"AsyncIOBuilder"``), None when there is none."""
        from terascale.integrations.deepspeed import op_builders

        return getattr(op_builders, class_name, None) if class_name in op_builders.BUILDERS else None

    def create_op_builder(self, class_name: str) -> Any:
        builder = self.get_op_builder(class_name)
        return None if builder is None else builder()

    def get_compile_backend(self) -> str:
        """The backend ``engine.compile()`` uses when given none (torch's default, inductor)."""
        return self.__dict__.get("_compile_backend", "inductor")

    def set_compile_backend(self, backend: str) -> None:
        self.__dict__["_compile_backend"] = backend


@functools.cache
def _accelerators(device_type: str) -> Accelerator:
    return Accelerator(device_type)


def get_accelerator() -> Accelerator:
    """The accelerator for the device terascale trains on (see the module docstring)."""
    return _accelerators(_device_type())


def set_accelerator(accelerator: Accelerator) -> None:
    """DeepSpeed lets a program install its own accelerator; terascale's follows the device,
    so only the accelerator of that device is accepted (installing it changes nothing)."""
    if not isinstance(accelerator, Accelerator) or accelerator._name != _device_type():
        raise ValueError(f"set_accelerator({accelerator!r}): terascale's accelerator follows TERASCALE_DEVICE "
                         f"(now {_device_type()!r}); set that variable to change it")


def CPU_Accelerator() -> Accelerator:  # noqa: N802 - DeepSpeed's class name
    """DeepSpeed's CPU accelerator class: the accelerator of device ``cpu``."""
    return _accelerators("cpu")


def CUDA_Accelerator() -> Accelerator:  # noqa: N802 - DeepSpeed's class name
    """DeepSpeed's CUDA accelerator class: the accelerator of device ``cuda``."""
    return _accelerators("cuda")


def is_current_accelerator_supported() -> bool:
    return True
