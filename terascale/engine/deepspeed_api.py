"""The engine's DeepSpeed-named accessors: ``engine.gradient_accumulation_steps()``,
``engine.zero_optimization_stage()``, ``engine.no_sync()``, ``engine.offload_states()``, ...

DeepSpeed programs (and the Hugging Face, accelerate, TRL and OpenRLHF integrations) read
the engine's configuration through dozens of small methods named after config keys, and
drive a few engine services by DeepSpeed's names. They are collected in
:class:`DeepSpeedEngineAPI`, a mixin of :class:`terascale.engine.Engine`, so that
``engine.py`` keeps only the training protocol: each method here answers from the config,
the batch sizes, the distributed context or a public part of the engine, and holds no
state of its own beyond what ``offload_states`` moved off the device and the compile flag.
"""

from __future__ import annotations

import contextlib
import enum
import time
import weakref
from collections.abc import Container, Iterator
from typing import TYPE_CHECKING, Any

import torch

from terascale.engine.export import buffer_dtypes, in_compute_dtype
from terascale.errors import UsageError

if TYPE_CHECKING:
    from terascale.engine.engine import Engine

# Every live engine: DeepSpeed's per-parameter functions (``safe_get_full_grad(param)``)
# receive only a parameter and find its engine here (engines hold their parameters; a
# weak set keeps no engine alive).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_engines() -> list[Engine]:
    """Every engine not yet garbage-collected, oldest first is not guaranteed."""
    return list(_LIVE)


class OffloadStateTypeEnum(str, enum.Enum):
    """What ``engine.offload_states(include=...)`` moves to host memory (DeepSpeed's names)."""

    optim_states = "optim_states"  # the optimizer's state tensors (Adam's moments)
    hp_params = "hp_params"  # the fp32 masters the optimizer steps
    lp_params = "lp_params"  # the module's parameters in the compute dtype
    lp_grads = "lp_grads"  # gradients held in ``.grad`` (none between steps)
    contiguous_grad_buffer = "contiguous_grad_buffer"  # accepted: the model state keeps its buffers


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class ThroughputTimer:
    """``engine.tput_timer``: samples per second since the engine's first optimizer step."""

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self.epoch_count = 0
        self._start: tuple[float, int] | None = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1

    def avg_samples_per_sec(self) -> float:
        engine = self._engine()
        if engine is None:
            return 0.0
        now, samples = time.perf_counter(), engine.global_samples
        if self._start is None or samples < self._start[1]:
            self._start = (now, samples)
            return 0.0
        seconds = now - self._start[0]
        return (samples - self._start[1]) / seconds if seconds > 0 else 0.0

    def start(self) -> None:
        if self._start is None:
            engine = self._engine()
            self._start = (time.perf_counter(), engine.global_samples if engine is not None else 0)

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        pass  # the engine's own print line reports throughput


class DeepSpeedEngineAPI:
    """DeepSpeed's engine accessors (a mixin of :class:`terascale.engine.Engine`)."""

    # -- batch sizes (methods, as in DeepSpeed) --------------------------------------------------

    def train_batch_size(self: Engine) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self._batch.train_batch_size

    def train_micro_batch_size_per_gpu(self: Engine) -> int:
        return self._batch.micro_batch_size

    def gradient_accumulation_steps(self: Engine) -> int:
        """Micro-steps per optimizer step (unless ``set_gradient_accumulation_boundary`` decides)."""
        return self._batch.gradient_accumulation_steps

    def get_batch_info(self: Engine) -> tuple[int, int, int]:
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    # -- where this rank is ------------------------------------------------------------------------

    @property
    def local_rank(self: Engine) -> int:
        return self.dist.local_rank

    @property
    def global_rank(self: Engine) -> int:
        return self.dist.rank

    @property
    def dp_world_size(self: Engine) -> int:
        return self.dist.dp_world_size

    @property
    def mp_world_size(self: Engine) -> int:
        return self.dist.mp_world_size

    @property
    def data_parallel_group(self: Engine) -> Any:
        return self.dist.dp_group

    def get_data_parallel_rank(self: Engine) -> int:
        return self.dist.dp_rank

    def get_model_parallel_rank(self: Engine) -> int:
        return self.dist.tp_rank

    get_tensor_parallel_rank = get_model_parallel_rank

    def get_pipeline_parallel_rank(self: Engine) -> int:
        return self.dist.pp_rank

    def is_first_stage(self: Engine) -> bool:
        """Whether this rank runs the first pipeline stage (always, without a pipeline)."""
        return self.dist.pp_rank == 0

    def is_last_stage(self: Engine) -> bool:
        return self.dist.pp_rank == self.dist.pp_world_size - 1

    def get_sequence_parallel_group(self: Engine) -> Any:
        """The ranks sharing this rank's sequences (``sequence_parallel_size``); None
        without sequence parallelism."""
        return self.dist.sp_group

    @property
    def seq_parallel_group(self: Engine) -> Any:
        """DeepSpeed's attribute for :meth:`get_sequence_parallel_group`."""
        return self.get_sequence_parallel_group()

    def get_sequence_parallel_rank(self: Engine) -> int:
        return self.dist.sp_rank

    def get_sequence_parallel_world_size(self: Engine) -> int:
        return self.dist.sp_world_size

    @property
    def seq_data_parallel_group(self: Engine) -> Any:
        """The ranks ZeRO shards over: sequence x data-parallel ([Note: sequence-parallel groups])."""
        return self.dist.zero_group

    # -- the config, read by DeepSpeed's accessor names ------------------------------------------

    def fp16_enabled(self: Engine) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self: Engine) -> bool:
        return self.config.bf16.enabled

    def amp_enabled(self: Engine) -> bool:
        return False  # Apex AMP is refused by the config

    def zero_optimization(self: Engine) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_optimization_stage(self: Engine) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization_partition_gradients(self: Engine) -> bool:
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self: Engine) -> bool:
        return self.config.zero_optimization.stage == 3

    def zero_offload_optimizer(self: Engine) -> Any:
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self: Engine) -> Any:
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self: Engine) -> bool:
        section = self.config.zero_optimization.offload_optimizer
        return section is not None and section.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self: Engine) -> bool:
        return self.config.zero_optimization.gather_16bit_weights_on_model_save

    def zero_allow_untested_optimizer(self: Engine) -> bool:
        return self.config.zero_allow_untested_optimizer

    def gradient_clipping(self: Engine) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self: Engine) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self: Engine) -> bool:
        return self.config.wall_clock_breakdown

    def dump_state(self: Engine) -> bool:
        return self.config.dump_state

    def sparse_gradients_enabled(self: Engine) -> bool:
        return self.config.sparse_gradients

    def flops_profiler_enabled(self: Engine) -> bool:
        return self.config.flops_profiler.enabled

    def elasticity_enabled(self: Engine) -> bool:
        return self.config.elasticity.enabled

    def dynamic_loss_scale(self: Engine) -> bool:
        return self.config.fp16.dynamic_loss_scale

    def initial_dynamic_scale(self: Engine) -> float:
        return self.config.fp16.initial_dynamic_scale

    def optimizer_name(self: Engine) -> str | None:
        """The config's ``optimizer.type`` (None with a client optimizer)."""
        return None if self.config.optimizer is None else self.config.optimizer.type

    def optimizer_params(self: Engine) -> dict | None:
        return None if self.config.optimizer is None else dict(self.config.optimizer.params)

    @property
    def basic_optimizer(self: Engine) -> Any:
        """The optimizer itself, under the engine's handle (DeepSpeed's name; None forward-only)."""
        return self.optimizer

    def scheduler_name(self: Engine) -> str | None:
        return None if self.config.scheduler is None else self.config.scheduler.type

    def scheduler_params(self: Engine) -> dict | None:
        return None if self.config.scheduler is None else dict(self.config.scheduler.params)

    # Features DeepSpeed has and terascale refuses in the config: never on here.
    def curriculum_learning_enabled(self: Engine) -> bool:
        return False

    data_efficiency_enabled = random_ltd_enabled = pld_enabled = eigenvalue_enabled = curriculum_learning_enabled

    def get_mom(self: Engine) -> list[Any]:
        """Per param group: ``betas`` (Adam-like) or ``momentum`` (SGD, RMSprop)."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    @property
    def tput_timer(self: Engine) -> ThroughputTimer:
        timer = self.__dict__.get("_tput_timer")
        if timer is None:
            timer = self.__dict__["_tput_timer"] = ThroughputTimer(self)
        return timer

    # -- services -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self: Engine) -> Iterator[None]:
        """Backwards inside do not reduce gradients; they accumulate on this rank until a
        backward outside (at the window's boundary) reduces them. Stages 0-1 only: from
        stage 2 gradients are partitioned as each backward runs (as in DeepSpeed)."""
        train = self.train_state
        with train.inside("no_sync"):
            if self.zero_optimization_partition_gradients():
                raise UsageError(
                    "engine.no_sync(): the no_sync context manager is incompatible with gradient partitioning "
                    f"(ZeRO stage {self.zero_optimization_stage()} partitions gradients during every backward); use engine.coalesce_grad_reduction() (one reduction at the block's exit), "
                    "stage 0 or 1, or let gradient_accumulation_steps decide the windows"
                )
            before = train.boundary
            self.set_gradient_accumulation_boundary(False)
            try:
                yield
            finally:
                self.set_gradient_accumulation_boundary(before)

    @contextlib.contextmanager
    def coalesce_grad_reduction(self: Engine) -> Iterator[None]:
        """The backwards inside are one accumulation window, reduced in one pass when the
        block exits, at every ZeRO stage (stages 2-3 keep the full gradient buffers until
        then: [Note: deferred reduction]). Call ``engine.step()`` after the block."""
        train = self.train_state
        if not train.managed:
            raise UsageError(
                "engine.coalesce_grad_reduction() with managed_gradient_accumulation false: engine.step() "
                "ends each window and reduces it already"
            )
        with train.inside("coalesce_grad_reduction"):
            if self.dist.pp_world_size > 1:
                raise UsageError(
                    "engine.coalesce_grad_reduction() with pipeline parallelism: train_batch schedules the window"
                )
            yield
        self._reduce_window()  # not after an error: the other ranks may not get here

    def managed_gradient_accumulation(self: Engine) -> bool:
        return self.config.managed_gradient_accumulation

    def empty_partition_cache(self: Engine) -> None:
        """Free the gathered (and prefetched) full parameters of ZeRO stage 3 and the host
        buffers kept for re-gathering; the next forward gathers again."""
        self.model_state.release_gathered()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def offload_states(
        self: Engine,
        include: Container[OffloadStateTypeEnum | str] | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the model states in ``include`` (default: all) to host memory, freeing
        the device memory, until :meth:`reload_states` (see :mod:`terascale.engine.state_offload`).
        No training step may run in between. On a CPU engine it does nothing."""
        from terascale.engine.state_offload import offload_engine_states

        if str(getattr(device, "value", device)) != "cpu":
            raise ValueError(f"engine.offload_states(device={device!r}): only 'cpu' is supported")
        if self.__dict__.get("_offloaded") is not None:
            raise ValueError("engine.offload_states(): the states are already offloaded; call reload_states() first")
        self.__dict__["_offloaded"] = offload_engine_states(self, include, pin_memory, non_blocking)

    def reload_states(self: Engine, non_blocking: bool = False) -> None:
        """Bring back what :meth:`offload_states` moved (no-op when nothing was)."""
        offloaded = self.__dict__.pop("_offloaded", None)
        if offloaded is not None:
            offloaded.reload(non_blocking)

    def _require_states_resident(self: Engine) -> None:
        if self.__dict__.get("_offloaded") is not None:
            raise ValueError("the engine's states are offloaded: call engine.reload_states() before training")

    def compile(
        self: Engine,
        backend: str | Any = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the wrapped module in place (``nn.Module.compile``); the
        engine's hooks (ZeRO-3 gathering, gradient reduction) stay outside the compiled
        regions. ``schedule`` and ``compiled_autograd_enabled`` belong to DeepSpeed's
        DeepCompile, which terascale refuses."""
        if schedule is not None or compiled_autograd_enabled:
            raise ValueError("engine.compile(schedule=/compiled_autograd_enabled=): DeepCompile is not built yet")
        if self.is_compiled:
            return
        self.module.compile(backend=backend, **(compile_kwargs or {}))
        self.__dict__["_compiled"] = True

    @property
    def is_compiled(self: Engine) -> bool:
        return bool(self.__dict__.get("_compiled", False))

    def _zero3_consolidated_16bit_state_dict(
        self: Engine, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The full weights in the compute dtype (buffers in theirs) on CPU on global rank 0,
        None on the others (collective: every rank calls it), as the Hugging Face and
        accelerate savers use it."""
        full = self.full_state_dict()
        buffers = buffer_dtypes(self)  # collective under pipeline parallelism
        if self.global_rank != 0:
            return None
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            full = {n: t for n, t in full.items() if n not in frozen}
        return in_compute_dtype(self, full, buffers)

    def save_fp16_model(self: Engine, save_dir: Any, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)
