"""Lightning on a terascale engine: ``Trainer(strategy=TerascaleStrategy(config="ds.json"))``.

[Note: Lightning on an engine]
Lightning keeps its loops, data, logging, callbacks and checkpoint bookkeeping; terascale
takes the parameters, gradients and optimizer state, as Lightning's ``DeepSpeedStrategy``
gives them to DeepSpeed:

- the config is a DeepSpeed/terascale config (path, dict, JSON; or the ``TERASCALE_CONFIG``
  / ``PL_DEEPSPEED_CONFIG_PATH`` environment variable). What Lightning's DeepSpeed
  strategy writes into a config, this one gives as values for ``"auto"`` and absent keys:
  the micro-batch from the train DataLoader, ``gradient_accumulation_steps`` from
  ``accumulate_grad_batches`` (an explicit other value is an error), clipping from
  ``gradient_clip_val`` and fp16/bf16 from ``precision``;
- the engine is built at ``setup`` over the LightningModule, stepping the optimizer of
  ``configure_optimizers`` (or the config's ``optimizer`` section); it becomes
  ``strategy.model``, so ZeRO-3 gathers parameters around ``training_step`` and
  ``validation_step``. Lightning's scheduler stays Lightning's; a config ``scheduler`` is
  stepped by the engine (so an fp16 overflow does not step it);
- Lightning decides the accumulation windows (it normalises the loss and steps on an
  epoch's last batch, as with DDP): the strategy tells the engine whether a backward ends
  a window, and the precision plugin (:class:`TerascalePrecision`) routes backward and the
  optimizer step to the engine, which also clips;
- ``trainer.save_checkpoint(path)`` writes a terascale checkpoint folder at ``path`` with
  Lightning's own state (loops, callbacks, epoch) as its client state, and
  ``fit(ckpt_path=path)`` resumes exactly. Full weights: ``strategy.full_state_dict()``, or
  ``terascale.checkpoint.consolidated_state_dict(path)`` from a checkpoint.

Why a strategy of its own when terascale can stand in for ``deepspeed``: Lightning's
``DeepSpeedStrategy`` (``strategy="deepspeed_stage_2"`` and the like) refuses the CPU by its
own check, whatever ``deepspeed`` is: its ``setup_environment`` (in ``lightning.pytorch`` and
``lightning.fabric`` alike, Lightning 2.6) raises ``RuntimeError: The DeepSpeed strategy is only
supported on CUDA GPUs`` unless the accelerator is Lightning's ``CUDAAccelerator``, at the start
of ``fit``, before any DeepSpeed call. (Its constructor passes with the stand-in on: its
``deepspeed>=0.16.0`` requirement reads the stand-in's version.) On CPU this strategy is the
way. (On GPUs Lightning's own passes that check and calls whatever ``deepspeed`` is; the
suite, on CPU, does not exercise that.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

from terascale.config import AutoContext, Config, Given
from terascale.config.auto import PLANNED_KEYS
from terascale.engine import Engine
from terascale.engine.optimizer_handle import optimizer_handle
from terascale.entry import initialize
from terascale.integrations.optimizer import EngineOptimizer

_TAG = "checkpoint"
_HALF = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


def _dtype_of(precision: str) -> str | None:
    return _HALF.get(str(precision))


class TerascalePrecision(Precision):
    """Lightning's precision plugin for an engine: the engine computes in the config's
    precision (no autocast, no GradScaler), backpropagates, clips and steps."""

    def __init__(self, precision: str, strategy: TerascaleStrategy) -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self._strategy = strategy

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # the engine casts the model to the config's dtype

    def convert_input(self, data: Any) -> Any:
        engine = self._strategy.engine
        if engine is None:
            return data
        dtype = engine.config.compute_dtype
        return _cast_floats(data, dtype)

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        engine = self._strategy.engine
        assert engine is not None, "backward before the engine exists"
        # Lightning has divided the loss by accumulate_grad_batches and decides the windows.
        engine.set_gradient_accumulation_boundary(not self._strategy.accumulating)
        engine.backward(tensor, scale_wrt_gas=False)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        optimizer.step()  # the EngineOptimizer: the engine's update
        return result

    def clip_gradients(
        self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM
    ) -> None:
        pass  # the engine clips by the config's gradient_clipping (gradient_clip_val)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        yield


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, Mapping):
        return type(data)({k: _cast_floats(v, dtype) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        cast = [_cast_floats(v, dtype) for v in data]
        return type(data)(*cast) if hasattr(data, "_fields") else type(data)(cast)
    return data


class TerascaleStrategy(DDPStrategy):
    """Lightning strategy that trains on a terascale engine; see ``[Note: Lightning on an
    engine]``. ``config`` is a DeepSpeed/terascale config; the other arguments are
    ``DDPStrategy``'s (``accelerator``, ``parallel_devices``, ``cluster_environment``,
    ``process_group_backend``, ``timeout``, ...)."""

    strategy_name = "terascale"

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        source = config or os.environ.get("TERASCALE_CONFIG") or os.environ.get("PL_DEEPSPEED_CONFIG_PATH")
        if source is None:
            raise ValueError(
                "TerascaleStrategy needs a config: pass config='ds_config.json' (or a dict), or set TERASCALE_CONFIG"
            )
        self.config = Config.load(source)
        self.engine: Engine | None = None
        self.accumulating = False  # inside a window Lightning accumulates over (no update after it)

    # -- precision: whatever Lightning picks for `precision=`, the engine computes it ----------------

    @property
    def precision_plugin(self) -> Precision:  # type: ignore[override]
        return self._precision_plugin if self._precision_plugin is not None else TerascalePrecision("32-true", self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, TerascalePrecision):
            plugin = TerascalePrecision(getattr(plugin, "precision", "32-true"), self)
        self._precision_plugin = plugin

    # -- set-up ---------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.engine is not None:
            self.model = self.engine  # a later fit/validate/test: the state is the engine's
        elif trainer.state.fn == TrainerFn.FITTING:
            self._build_engine(trainer)
        else:
            self.model_to_device()  # evaluation before any fit: nothing is sharded yet
        self.setup_precision_plugin()

    def _build_engine(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE and trainer.gradient_clip_val:
            raise ValueError("TerascaleStrategy clips by norm (gradient_clipping), not by value; drop gradient_clip_algorithm")
        optimizer, schedulers = None, []
        if self.config.optimizer is None:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError("TerascaleStrategy supports one optimizer and at most one LR scheduler")
            optimizer = optimizers[0]
        # Batch sizes count data-parallel replicas ([Note: data-parallel size]).
        replicas = self.config.data_parallel_size(self.world_size)
        # The planner's keys stay "auto" for initialize ([Note: the planner at initialize]).
        config = self.config.resolve(
            AutoContext(world_size=replicas, model=module, given=self._given(trainer), defer=frozenset(PLANNED_KEYS))
        )
        if optimizer is not None:
            config = config.with_values(zero_allow_untested_optimizer=True)  # as Lightning's does
        self.engine, _, _, _ = initialize(model=module, optimizer=optimizer, config=config)
        self.model = self.engine
        self.optimizers = [optimizer_handle(self.engine, EngineOptimizer)]
        self.lr_scheduler_configs = schedulers

    def _given(self, trainer: pl.Trainer) -> dict[str, Given]:
        """What Lightning's DeepSpeed strategy writes into a config, as values for absent
        and "auto" keys (accumulation must agree when given)."""
        given = {
            "train_micro_batch_size_per_gpu": Given(self._loader_batch_size(trainer), "the train DataLoader's batch_size",
                                                    match=False, absent=True),
            "gradient_accumulation_steps": Given(trainer.accumulate_grad_batches, "Trainer(accumulate_grad_batches)",
                                                 absent=True),
            "gradient_clipping": Given(float(trainer.gradient_clip_val or 0.0), "Trainer(gradient_clip_val)",
                                       match=False, absent=True),
        }  # fmt: skip
        half = _dtype_of(self.precision_plugin.precision)
        for name in ("fp16", "bf16"):
            given[f"{name}.enabled"] = Given(half == name, "Trainer(precision)", match=False, absent=half == name)
        return given

    @staticmethod
    def _loader_batch_size(trainer: pl.Trainer) -> int:
        source = trainer.fit_loop._data_source
        if source.is_defined():
            loader = source.dataloader()
            size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
            if isinstance(size, int):
                return size
        return 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # The ranks of one tensor-parallel group (consecutive ranks, [Note: topology]) are
        # one data-parallel replica: they must see the same samples.
        replicas, replica = self.config.data_parallel_replica(self.world_size, self.global_rank)
        return {"num_replicas": replicas, "rank": replica}

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        pass  # made with the engine in setup

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning's loop decides the windows; see block_backward_sync

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning runs the micro-batches of a window that end in no update inside this."""
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads into the sharded state it built

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # in the engine's checkpoint

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The weights are in the engine's checkpoint files; gathering them on every save
        # would hold the whole model on every rank (see full_state_dict).
        return {} if self.engine is not None else super().lightning_module_state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the LightningModule by name, full size, fp32 (collective)."""
        assert self.engine is not None, "no engine: call fit first"
        return self.engine.full_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A terascale checkpoint folder at ``filepath`` (collective), Lightning's state as
        its client state."""
        if self.engine is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise ValueError("TerascaleStrategy writes terascale checkpoints; storage_options is not used")
        filepath = self.broadcast(str(filepath))
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=_TAG, client_state=client)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.engine is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        # Lightning's weights_only=False is the caller's word that the checkpoint is trusted,
        # which is what loading a pickled client state (older checkpoints) needs.
        path, client = self.engine.load_checkpoint(
            str(checkpoint_path), tag=_TAG, load_optimizer_states=fitting, load_module_only=not fitting,
            allow_pickled_client_state=True if weights_only is False else None,
        )
        if path is None:
            raise ValueError(f"no terascale checkpoint at '{checkpoint_path}'")
        return client

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.engine is None:
            super().load_model_state_dict(checkpoint, strict)  # the engine's load restored the weights

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # restored with the engine's checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            import shutil

            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        if self.engine is None:
            return super().teardown()
        # The engine stays: after fit the module's parameters live in it (sharded at stage
        # 3, as views of its buffers), and validate/test/predict or full_state_dict() run
        # through it. So the module is not moved to the CPU as Lightning does on teardown.
        self.precision_plugin.teardown()
        assert self.accelerator is not None and self.cluster_environment is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.cluster_environment.teardown()


if "terascale" not in StrategyRegistry:
    StrategyRegistry.register("terascale", TerascaleStrategy, description="ZeRO stages 0-3 and offload on terascale")
