"""The Hugging Face ``Trainer`` on a terascale engine: change one import, keep the config.

```python
from terascale.integrations.transformers import Trainer, TrainingArguments

trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds, config="ds_config.json")
trainer.train()
```

[Note: two ways to run the Trainer]
The first way needs nothing from terascale in the script: with terascale standing in for
DeepSpeed (``terascale run --as-deepspeed``, or ``TERASCALE_AS_DEEPSPEED=1``), transformers'
own ``Trainer`` with ``TrainingArguments(deepspeed=...)`` drives terascale through its
DeepSpeed integration and accelerate's, and trains as this module's Trainer does
(tests/test_hf_native.py holds both to the plain Trainer). This module is the other way,
for where the switch cannot be on (a real DeepSpeed installed in the same environment, or a
script that must not depend on how it is launched) and for what transformers' DeepSpeed
code does not reach on terascale: AutoTP (it calls ``deepspeed.tp_model_init``, which
terascale refuses: the config's ``autotp_size`` slices the model at initialize), sequence
parallelism from ``TrainingArguments.parallelism_config`` (there accelerate runs DeepSpeed's
Ulysses data adapter, which needs ``position_ids`` in every batch; here the engine splits
the batch itself, [Note: sequence parallelism under the Trainer]).

[Note: the Trainer on an engine]
The Trainer keeps its own loop (data, logging, callbacks, evaluation, checkpoint folders);
terascale takes what touches parameters, gradients and optimizer state:

- the config's ``"auto"`` values come from the ``TrainingArguments`` with the meaning the
  Trainer's DeepSpeed integration gives them (:func:`trainer_given`; explicit values that
  disagree with the arguments are an error, as there);
- the engine is built when training starts (the number of steps is then known), over
  the Trainer's optimizer when the config has no ``optimizer`` section; it becomes
  ``model_wrapped``, and ``self.optimizer`` / ``self.lr_scheduler`` become views of its
  optimizer and schedule (:class:`EngineOptimizer`, :class:`EngineSchedule`);
- the Trainer's ``accelerator`` is wrapped (:class:`_EngineAccelerator`) so that its
  ``backward`` is the engine's (the Trainer decides the accumulation windows and scales
  the loss; the engine reduces and steps), ``clip_grad_norm_`` reports the engine's norm
  (the engine clips by the config's ``gradient_clipping``, as DeepSpeed does), and a step
  skipped for an fp16 overflow leaves the Trainer's schedule where it was;
- ``sequence_parallel_size`` (in the config, or ``TrainingArguments(parallelism_config=
  ParallelismConfig(sp_size=N))``) is the engine's: see [Note: sequence parallelism
  under the Trainer];
- models are saved from the engine's full fp32 weights in the dtype the model came in,
  and checkpoints are terascale checkpoints inside the Trainer's ``checkpoint-N`` folders,
  so ``resume_from_checkpoint`` resumes exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from terascale.config import AutoContext, Config, Given
from terascale.config.auto import PLANNED_KEYS
from terascale.engine import Engine
from terascale.engine.optimizer_handle import optimizer_handle
from terascale.entry import initialize
from terascale.integrations.optimizer import EngineOptimizer

_SCHEDULER_FILE = "scheduler.pt"

# [Note: sequence parallelism under the Trainer]
# The Trainer's own DeepSpeed-Ulysses path hands each rank of a sequence group different
# samples through DeepSpeed's data loader adapter, which gathers and re-splits them, and
# computes the loss itself. On terascale the ranks of a sequence group read the same
# samples (the data loader is sharded over the data replicas, as for tensor parallelism)
# and the engine's model cuts each batch and returns the whole batch's loss
# (terascale.parallel.sequence.model). So the Trainer sees sequence parallelism only as
# processes sharing a replica (``get_tp_size``: it divides its process count by them to
# count batches and tokens, and scales the loss by the replicas), and none of its
# sequence-parallel code runs.


def trainer_given(
    args: Any, num_training_steps: int | None = None, data_parallel_size: int | None = None
) -> dict[str, Given]:
    """What ``TrainingArguments`` say for the config keys the Trainer's DeepSpeed
    integration fills in (``"auto"``) or checks (explicit values must agree).
    ``data_parallel_size``: the replicas the batch is spread over (default: every process;
    with tensor parallelism fewer, see [Note: data-parallel size] in terascale.config.parallel)."""
    dp = data_parallel_size if data_parallel_size is not None else int(getattr(args, "world_size", 1))
    arg = "TrainingArguments."
    given = {
        "train_micro_batch_size_per_gpu": Given(args.per_device_train_batch_size, arg + "per_device_train_batch_size"),
        "gradient_accumulation_steps": Given(args.gradient_accumulation_steps, arg + "gradient_accumulation_steps"),
        "train_batch_size": Given(
            dp * args.per_device_train_batch_size * args.gradient_accumulation_steps,
            f"per_device_train_batch_size × gradient_accumulation_steps × data-parallel size {dp}",
        ),
        "gradient_clipping": Given(args.max_grad_norm, arg + "max_grad_norm"),
        "optimizer.params.lr": Given(args.learning_rate, arg + "learning_rate"),
        "optimizer.params.betas": Given([args.adam_beta1, args.adam_beta2], arg + "adam_beta1/adam_beta2"),
        "optimizer.params.eps": Given(args.adam_epsilon, arg + "adam_epsilon"),
        "optimizer.params.weight_decay": Given(args.weight_decay, arg + "weight_decay"),
        "scheduler.params.warmup_min_lr": Given(0, "the Trainer (always 0)", match=False),
        "scheduler.params.warmup_max_lr": Given(args.learning_rate, arg + "learning_rate"),
        "fp16.enabled": Given(bool(args.fp16 or args.fp16_full_eval), arg + "fp16"),
        "bf16.enabled": Given(bool(args.bf16 or args.bf16_full_eval), arg + "bf16"),
    }
    if num_training_steps:
        given["scheduler.params.total_num_steps"] = Given(num_training_steps, "the Trainer's number of training steps")
        given["scheduler.params.warmup_num_steps"] = Given(
            max(1, args.get_warmup_steps(num_training_steps)), arg + "warmup_steps / warmup_ratio"
        )
    return given


class EngineSchedule:
    """The Trainer's view of the schedule the config's ``scheduler`` section built: the
    engine steps it with each applied update, so the Trainer's ``step()`` does nothing;
    ``get_last_lr()`` is the lr the last update used, as the Trainer logs it."""

    def __init__(self, optimizer: EngineOptimizer) -> None:
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return self.optimizer.lrs_of_last_step or self.optimizer.engine.get_lr()

    def state_dict(self) -> dict:
        return self.optimizer.engine.lr_scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.engine.lr_scheduler.load_state_dict(state)


class _EngineAccelerator:
    """The Trainer's ``accelerator``, with what touches gradients routed to the engine
    once it exists; everything else is the accelerator's own."""

    def __init__(self, accelerator: Any, trainer: TerascaleTrainerMixin) -> None:
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_trainer", trainer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._accelerator, name, value)

    @property
    def _engine(self) -> Engine | None:
        return self._trainer.engine

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        engine = self._engine
        if engine is None:
            return self._accelerator.backward(loss, **kwargs)
        # The Trainer decides the windows (one ends early at an epoch's end) and has
        # divided the loss for them; accelerate's own divisor is 1 in current Trainers.
        engine.set_gradient_accumulation_boundary(self._accelerator.sync_gradients)
        engine.backward(loss / self._accelerator.gradient_accumulation_steps, scale_wrt_gas=False)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        engine = self._engine
        if engine is None:
            return self._accelerator.clip_grad_norm_(parameters, max_norm, norm_type)
        return engine.window_grad_norm()  # the engine's step clips by gradient_clipping

    def no_sync(self, model: Any) -> Any:
        if self._engine is not None and model is self._engine:
            return contextlib.nullcontext()  # the engine reduces only at window ends anyway
        return self._accelerator.no_sync(model)

    def autocast(self, *args: Any, **kwargs: Any) -> Any:
        # The engine computes in the config's precision; autocast on top would change it.
        return contextlib.nullcontext() if self._engine is not None else self._accelerator.autocast(*args, **kwargs)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        engine = self._engine
        if engine is None:
            return self._accelerator.optimizer_step_was_skipped
        return not engine.was_step_applied()

    def prepare(self, *objects: Any, **kwargs: Any) -> Any:
        ours = (Engine, EngineOptimizer, EngineSchedule)
        out = []
        for o in objects:
            if isinstance(o, ours):
                out.append(o)
            elif isinstance(o, DataLoader) and self._trainer._data_replicas()[0] < self.num_processes:
                out.append(self._replica_loader(o))
            else:
                out.append(self._accelerator.prepare(o, **kwargs))
        return out[0] if len(out) == 1 else tuple(out)

    def _replica_loader(self, loader: DataLoader) -> Any:
        """``loader`` sharded over the data-parallel replicas, not the processes: the ranks
        of a tensor-parallel group must see the same samples (what accelerate's DeepSpeed
        mode does with DeepSpeed's autoTP mesh)."""
        replicas, replica = self._trainer._data_replicas()
        acc = self._accelerator
        prepared = prepare_data_loader(
            loader, acc.device, num_processes=replicas, process_index=replica, split_batches=acc.split_batches,
            put_on_device=acc.device_placement, rng_types=list(acc.rng_types), dispatch_batches=acc.dispatch_batches,
            even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader,
        )  # fmt: skip
        acc._dataloaders.append(prepared)  # as accelerate's prepare registers it (save_state)
        return prepared

    def unwrap_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(model, Engine):
            return model.module
        return self._accelerator.unwrap_model(model, *args, **kwargs)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict:
        engine = self._engine
        if engine is not None and model in (engine, engine.module):
            return self._trainer._full_model_state()
        return self._accelerator.get_state_dict(model, unwrap=unwrap)


class TerascaleTrainerMixin:
    """Runs a ``transformers.Trainer`` (or subclass) on a terascale engine; see
    ``[Note: the Trainer on an engine]``. ``config`` is a DeepSpeed/terascale config (path,
    dict or JSON); without it, the ``deepspeed`` argument of terascale's
    :class:`TrainingArguments` is taken."""

    def __init__(self, *args: Any, config: Any = None, **kwargs: Any) -> None:
        self.engine: Engine | None = None
        super().__init__(*args, **kwargs)
        source = config if config is not None else getattr(self.args, "terascale_config", None)
        if source is None:
            raise ValueError(
                f"{type(self).__name__} needs a config: pass config='ds_config.json' (or a dict), or "
                "TrainingArguments(deepspeed=...) from terascale.integrations.transformers"
            )
        if getattr(self, "is_deepspeed_enabled", False):
            raise ValueError(
                "these TrainingArguments set up DeepSpeed itself (transformers.TrainingArguments(deepspeed=...)); "
                "use terascale.integrations.transformers.TrainingArguments, or pass the config as config= only "
                "(or, with terascale standing in for DeepSpeed, train with transformers.Trainer itself)"
            )
        self.terascale_config = _with_trainer_sequence_parallel(Config.load(source), self.args)
        self._model_dtypes = {n: p.dtype for n, p in self.model.state_dict().items()}

    # -- the accelerator, the engine, the optimizer and the schedule ------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        # Sequence parallelism is the engine's ([Note: sequence parallelism under the
        # Trainer]): accelerate and the Trainer's DeepSpeed-Ulysses paths (a data loader
        # adapter, their own loss) see the parallelism config without it.
        pc = getattr(self.args, "parallelism_config", None)
        if pc is not None and getattr(pc, "sp_size", 1) > 1:
            self.args.parallelism_config = None if pc.total_size == pc.sp_size else dataclasses.replace(pc, sp_size=1)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            self.args.parallelism_config = pc
        self.accelerator = _EngineAccelerator(self.accelerator, self)

    def autocast_smart_context_manager(self, *args: Any, **kwargs: Any) -> Any:
        return contextlib.nullcontext()  # the engine owns precision (config fp16 / bf16)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is not None:
            return self.optimizer
        if self.terascale_config.optimizer is not None:
            return self.optimizer  # built by the engine from the config's section
        return super().create_optimizer(*args, **kwargs)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        self._ensure_engine(num_training_steps)
        if self.engine.lr_scheduler is not None:
            self.lr_scheduler = EngineSchedule(self.optimizer)
            return self.lr_scheduler
        # The Trainer's own schedule, over the engine's optimizer groups.
        return super().create_scheduler(num_training_steps, optimizer=self.optimizer)

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if self.engine is None and training:
            self._ensure_engine(self.state.max_steps)
        # Before training the model is whole (nothing is sharded yet): evaluate it as is.
        return self.engine if self.engine is not None else model

    def _data_replicas(self) -> tuple[int, int]:
        """(data-parallel replicas, this process's replica): with tensor parallelism each
        tensor-parallel group is one replica (see [Note: data-parallel size] in
        terascale.config.parallel); its ranks are consecutive ([Note: topology])."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.terascale_config.data_parallel_replica(world, rank)

    def get_tp_size(self) -> int:
        # The Trainer divides its process count by this to count batches and tokens (what it
        # reads from the DeepSpeed config's autotp_size under DeepSpeed): the processes of one
        # data replica, a sequence-parallel group's included.
        return self.terascale_config.tensor_parallel.size * self.terascale_config.sp_size

    def _ensure_engine(self, num_training_steps: int | None) -> None:
        if self.engine is not None:
            return
        replicas = self._data_replicas()[0]
        given = trainer_given(self.args, num_training_steps, replicas)
        # The planner's keys stay "auto" for initialize ([Note: the planner at initialize]).
        config = self.terascale_config.resolve(
            AutoContext(world_size=replicas, model=self.model, given=given, defer=frozenset(PLANNED_KEYS))
        )
        client = self.optimizer if isinstance(self.optimizer, torch.optim.Optimizer) else None
        if client is not None:
            # As the Trainer's DeepSpeed integration does: the optimizer the Trainer built
            # (TrainingArguments.optim) may step ZeRO's shards unless it needs whole tensors.
            config = config.with_values(zero_allow_untested_optimizer=True)
        engine, _, _, _ = initialize(model=self.model, optimizer=client, config=config)
        self.engine = engine
        self.optimizer = optimizer_handle(engine, EngineOptimizer)
        self.model_wrapped = engine

    # -- saving and loading -------------------------------------------------------------------------

    def _full_model_state(self) -> dict[str, torch.Tensor]:
        """Every weight by name, full size, in the dtype the model came in (collective)."""
        state = self.engine.full_state_dict()
        return {n: t.to(self._model_dtypes.get(n, t.dtype)) for n, t in state.items()}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self._full_model_state()  # on every rank: it is collective

        def write() -> None:
            self._save(output_dir, state_dict=state)

        # Every rank returns once the folder is written: a rank may load it next.
        self.engine.write_on_ranks(write if self.args.should_save else None, f"save_model to {output_dir}")
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir)
        if not isinstance(self.lr_scheduler, EngineSchedule) and self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.engine.load_checkpoint(checkpoint)
        schedule = os.path.join(checkpoint, _SCHEDULER_FILE)
        if not isinstance(self.lr_scheduler, EngineSchedule) and os.path.isfile(schedule):
            self.lr_scheduler.load_state_dict(torch.load(schedule, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
            return  # a terascale checkpoint: the engine restores the fp32 weights exactly
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        self.engine.load_checkpoint(self.state.best_model_checkpoint, load_module_only=True)


def _with_trainer_sequence_parallel(config: Config, args: Any) -> Config:
    """``config`` with the sequence-parallel size ``TrainingArguments.parallelism_config``
    asks for ([Note: sequence parallelism under the Trainer]); raises ``ValueError`` when
    the config says another."""
    sp = int(getattr(getattr(args, "parallelism_config", None), "sp_size", None) or 1)
    return config if sp <= 1 else config.with_sp_size(sp, "TrainingArguments.parallelism_config.sp_size")


def _training_arguments(base: type) -> type:
    """``base`` (a ``TrainingArguments`` class) whose ``deepspeed`` argument is kept as
    terascale's config instead of setting up DeepSpeed."""

    class Arguments(base):  # type: ignore[misc, valid-type]
        def __post_init__(self) -> None:
            self.terascale_config = self.deepspeed
            self.deepspeed = None
            super().__post_init__()
            self.deepspeed = self.terascale_config

    Arguments.__name__ = Arguments.__qualname__ = base.__name__
    Arguments.__doc__ = f"{base.__doc__ or ''}\n\nterascale: ``deepspeed`` names terascale's config."
    return Arguments


def terascale_trainer(base: type) -> type:
    """A subclass of the Trainer class ``base`` (``transformers.Trainer`` or one of its
    subclasses, e.g. TRL's ``SFTTrainer``) that trains on a terascale engine and takes a
    ``config=`` keyword."""
    cls = type(base.__name__, (TerascaleTrainerMixin, base), {"__module__": __name__})
    cls.__doc__ = f"``{base.__module__}.{base.__name__}`` on a terascale engine: pass ``config=``."
    return cls


TrainingArguments = _training_arguments(transformers.TrainingArguments)
Seq2SeqTrainingArguments = _training_arguments(transformers.Seq2SeqTrainingArguments)
Trainer = terascale_trainer(transformers.Trainer)
Seq2SeqTrainer = terascale_trainer(transformers.Seq2SeqTrainer)

__all__ = [
    "EngineOptimizer",
    "EngineSchedule",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "Trainer",
    "TrainingArguments",
    "terascale_trainer",
    "trainer_given",
]
