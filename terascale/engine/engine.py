"""The training engine: forward, backward and step with accumulation, precision and clipping.

The engine orchestrates; the pieces it is built from do the work (``[Note: the engine's
parts]`` in ``terascale/engine/__init__.py``). The train step has no per-stage and no
per-parallelism code. Every phase (forward, backward, step) runs inside one bracket,
:meth:`Engine._phase`, that the observer and the resilience monitors share.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from terascale.comm import DistributedContext, all_reduce_flag
from terascale.config import Config
from terascale.engine.checkpointing import Checkpointer
from terascale.engine.clipping import clip_coefficient
from terascale.engine.data import DataPosition, to_device
from terascale.engine.direct_backward import DirectBackward
from terascale.engine.deepspeed_api import _LIVE, DeepSpeedEngineAPI
from terascale.engine import export
from terascale.engine.autocast import autocast_dtype, forward_autocast, scales_loss
from terascale.engine.loss_scaler import build_loss_scaler
from terascale.engine.memory import memory_breakdown
from terascale.engine.model_state import ModelState
from terascale.engine.monitor import Reporter, StepTimers
from terascale.engine.observe import Observer
from terascale.engine.optimizer import (
    FORWARD_ONLY,
    OptimizerArg,
    SchedulerArg,
    engine_optimizer,
    engine_scheduler,
    step_in_backward,
)
from terascale.engine.parallel import ParallelLayout, join_model_parallel
from terascale.engine.prepare import PreparedModel
from terascale.engine.live import LiveElastic, live_elastic
from terascale.engine.resize import readopt_optimizer, rebuild_model_state
from terascale.engine.resilience import Resilience
from terascale.engine.train_state import TrainCounter, TrainState, WindowState
from terascale.errors import UsageError
from terascale.offload.aio import IoActivity
from terascale.zero.tiling import untiled_state_dict

logger = logging.getLogger("terascale")


class Engine(DeepSpeedEngineAPI, nn.Module):
    """Trains a prepared module: data-parallel, mixed precision, ZeRO stage 0-3.

    Call it like the module for forward; call :meth:`backward` with the loss and
    :meth:`step` after every micro-batch. Gradients are averaged over the data-parallel
    group and the optimizer steps once every ``gradient_accumulation_steps`` micro-batches.
    Built by :func:`terascale.initialize`. DeepSpeed's accessors (``gradient_accumulation_steps()``,
    ``zero_optimization_stage()``, ``no_sync()``, ...) come from :class:`DeepSpeedEngineAPI`.
    """

    def __init__(
        self,
        prepared: PreparedModel,
        config: Config,
        dist_ctx: DistributedContext,
        *,
        optimizer: OptimizerArg = None,
        lr_scheduler: SchedulerArg = None,
        training_dataloader: DataLoader | None = None,
    ) -> None:
        super().__init__()
        assert not config.auto_keys, f"resolve the config's 'auto' values first: {config.auto_keys}"
        self.config = config
        self.module = prepared.module
        self.precision = prepared.precision
        self.activations = prepared.activations
        self._param_groups = prepared.param_groups  # the user's groups and ZeRO's wrap policy,
        self._wrap = prepared.wrap  # for a resize's new model state
        self._layout = prepared.layout
        self._state = prepared.state
        self.optimizer = engine_optimizer(optimizer, config, self._state, self._layout)  # None: forward only
        self.lr_scheduler = engine_scheduler(lr_scheduler, config, self.optimizer)
        self._autocast = autocast_dtype(config, dist_ctx.device)  # None: no torch_autocast
        self._scales_loss = scales_loss(config, dist_ctx.device)
        self.loss_scaler = build_loss_scaler(config.fp16, int(config.zero_optimization.stage), self._scales_loss)
        batch = config.resolve_batch(dist_ctx.dp_world_size)
        self._train = TrainState(
            batch.gradient_accumulation_steps, dist_ctx.device, managed=config.managed_gradient_accumulation
        )  # fmt: skip
        self._data = DataPosition(training_dataloader)
        self._live = live_elastic(config, dist_ctx)  # None unless a live elastic agent started this rank
        self._assemble(dist_ctx)
        if self._live is None or not self._live.adopt_state(self):
            self._resilience.auto_resume()  # save_dir's lease; with checkpoint.auto_resume, the newest checkpoint
        _LIVE.add(self)  # for DeepSpeed's per-parameter functions (safe_get_full_grad(param))

    def _assemble(self, dist_ctx: DistributedContext) -> None:
        """Build the parts that depend on the world: the batch split, the checkpointer,
        the monitors and the backward bracket. Called at construction and by a live
        resize ([Note: membership epochs]), after the model state was rebuilt."""
        self.dist = dist_ctx
        # Read through DeepSpeed's methods: train_batch_size(), gradient_accumulation_steps().
        self._batch = batch = self.config.resolve_batch(dist_ctx.dp_world_size)
        self.micro_batch_size = batch.micro_batch_size
        train, config = self._train, self.config
        train.gradient_accumulation_steps = batch.gradient_accumulation_steps
        self._reporter = Reporter(config, dist_ctx, lambda: train.global_samples)
        self._checkpointer = Checkpointer(
            self.module, self._state, self._layout, self.optimizer, config, train,
            loss_scaler=self.loss_scaler, lr_scheduler=self.lr_scheduler, data=self._data,
        )  # fmt: skip
        self._resilience = Resilience(config, dist_ctx, self._state, train, self._checkpointer, self._reporter)
        # [Note: the optimizer step under backward]: with NVMe optimizer state, where allowed.
        self.steps_in_backward = step_in_backward(
            config, self._state, self.optimizer, self._layout,
            checks_non_finite=self._resilience.checks_non_finite, begin=self._begin_update_in_backward,
        )  # fmt: skip
        self._observe = Observer(
            config, dist_ctx, self.module, self._state, train, self._reporter,
            compute_dtype=self.precision.compute_dtype, train_batch_size=batch.train_batch_size,
            recompute=bool(self.activations.blocks.blocks),
        )  # fmt: skip
        # loss.backward() on the engine's output runs in the bracket engine.backward opens.
        self._direct = DirectBackward(
            lambda: self._backward_bracket(self.is_gradient_accumulation_boundary()),
            lambda: self.loss_scaler.scale, batch.gradient_accumulation_steps,
            [p for p in self.module.parameters() if p.requires_grad],
        )  # fmt: skip

    def rebuild(self, dist_ctx: DistributedContext) -> None:
        """Build the model state, layout and world-dependent parts again over ``dist_ctx``'s
        groups (a live resize, [Note: membership epochs]; the old groups are gone). The
        optimizer and scheduler objects stay; the state's values are the caller's to load."""
        self._layout, self._state = rebuild_model_state(self.module, self._state, self._param_groups, self.config,
                                                        dist_ctx, self.precision, self._wrap)  # fmt: skip
        if self.optimizer is not None:
            readopt_optimizer(self.optimizer, self._state)
        old = self._checkpointer
        for part in (self._resilience, self._observe, self._reporter):
            part.close()
        self._assemble(dist_ctx)
        old.hand_over(self._checkpointer, keeps_writing=dist_ctx.rank == 0)

    # -- properties a training script reads ------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        """The data-parallel world size (gradients are averaged over it)."""
        return self.dist.dp_world_size

    @property
    def dp_group(self):
        return self.dist.dp_group

    @property
    def model_state(self) -> ModelState:
        """Where the parameters, gradients and fp32 masters live (``[Note: model state]``)."""
        return self._state

    @property
    def live_elastic(self) -> LiveElastic | None:
        """The live elasticity of a rank the live elastic agent started (its ``resizes``
        record each one), else None."""
        return self._live

    @property
    def parallel_layout(self) -> ParallelLayout:
        """Who counts which gradient under model parallelism, and the expert groups."""
        return self._layout

    def training_record(self) -> dict[str, Any]:
        """What a checkpoint keeps besides tensors: counters, loss scale, scheduler,
        optimizer options, the data position (a live resize carries it in memory)."""
        return self._checkpointer.training_record()

    def restore_training_record(self, record: dict[str, Any]) -> None:
        """Restore a :meth:`training_record` whole (a live resize)."""
        self._checkpointer.restore_record(record, optimizer=True, scheduler=True, data_position=True)

    @property
    def train_state(self) -> TrainState:
        """The counters and the accumulation window (read them; the engine moves them)."""
        return self._train

    # DeepSpeed's counters: views of the train state (settable, as DeepSpeed's attributes are).
    global_steps = TrainCounter()  # optimizer steps taken, skipped fp16-overflow steps included
    micro_steps = TrainCounter()
    global_samples = TrainCounter()
    skipped_steps = TrainCounter()

    @property
    def training_dataloader(self) -> DataLoader | None:
        """The loader ``initialize`` built from ``training_data``; checkpoints carry its position."""
        return self._data.loader

    @training_dataloader.setter
    def training_dataloader(self, loader: DataLoader | None) -> None:
        self._data.loader = loader

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step (None before one was computed)."""
        return self._train.last_grad_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last of its accumulation window."""
        return self._train.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the next micro-step ends its accumulation window (DeepSpeed's API).

        For training loops that decide the windows themselves (the Hugging Face Trainer
        ends one early at the end of an epoch): set it before each forward/backward; the
        last micro-step of a window must have it True. ``None`` returns to counting
        ``gradient_accumulation_steps`` micro-steps.
        """
        self._train.set_boundary(is_boundary)

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters: False inside an accumulation
        window and when an fp16 overflow (or the non-finite policy) skipped the update."""
        return self._train.step_applied

    # -- the training protocol ---------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; tensor inputs are moved to the engine's device. A loss
        computed from the output may go to :meth:`backward` or have ``.backward()`` called
        on it directly (``[Note: direct backward]``)."""
        with self._phase("forward", (args, kwargs)):
            args, kwargs = to_device((args, kwargs), self.device, self._input_cast_dtype())
            with self.activations.forward_context(), forward_autocast(self._autocast, self.device):
                return self._direct.wrap(self.module(*args, **kwargs))

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss`` scaled for accumulation (1/steps, unless ``scale_wrt_gas``
        is False: the caller already divided it) and for fp16.

        On the last micro-step of a window, gradient buckets are all-reduced while the
        rest of backward still runs.
        """
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}")
        gas = self.gradient_accumulation_steps()
        self._train.add_loss(loss, 1 if scale_wrt_gas else gas)
        scale = self.loss_scaler.scale / (gas if scale_wrt_gas else 1)
        sync = self.is_gradient_accumulation_boundary()
        self._backward(sync, lambda: (loss.float() * scale).backward(retain_graph=retain_graph))

    def run_backward(
        self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None = None, *, sync: bool
    ) -> None:
        """One backward of a schedule that drives the window itself (a pipeline stage's):
        of ``[loss]`` (``grads=None``; scaled as :meth:`backward` scales), or of outputs
        ``tensors`` with their gradients ``grads`` from the next stage (already scaled).
        ``sync`` marks this rank's last backward of the window, when the model state
        reduces the gradients. The window's loss is given at :meth:`end_window`."""
        def run() -> None:
            if grads is None:
                (loss,) = tensors
                (loss.float() * (self.loss_scaler.scale / self.gradient_accumulation_steps())).backward()
            elif tensors:
                torch.autograd.backward(list(tensors), list(grads))

        self._backward(sync, run)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, for a script that runs backward itself:
        ``engine.scale(loss).backward()`` (DeepSpeed's API; see ``[Note: direct backward]``)."""
        if loss.dim() != 0:
            raise ValueError(f"engine.scale expects a scalar loss, got shape {tuple(loss.shape)}")
        return self._direct.scale(loss)

    def _backward(self, sync: bool, run: Callable[[], None]) -> None:
        """``run`` (one backward) inside the backward bracket."""
        with self._backward_bracket(sync), self._direct.engine_backward():
            run()

    @contextmanager
    def _backward_bracket(self, sync: bool) -> Iterator[None]:
        """Around one backward: the model state's bracket (``sync`` on the window's last
        backward, when the gradients are reduced over the data-parallel ranks)."""
        if self.optimizer is None:
            raise UsageError(f"backward: {FORWARD_ONLY}")
        defer = self._train.deferring  # coalesce_grad_reduction: the block's exit reduces
        sync = sync and not defer
        self._train.backward_ran(sync)
        with self._phase("backward"):
            self._state.prepare_backward(sync=sync, defer=defer)
            self.activations.before_backward()
            yield
            self._state.post_backward()

    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary, update the parameters."""
        self._step(scheduler=True)

    def step_without_scheduler(self) -> None:
        """:meth:`step`, leaving the LR scheduler to the program: the ``step()`` of the
        optimizer ``initialize`` returns ([Note: the optimizer initialize returns])."""
        self._step(scheduler=False)

    def _step(self, *, scheduler: bool) -> None:
        if self.optimizer is None:
            raise UsageError(f"engine.step(): {FORWARD_ONLY}")
        if self._train.block is not None:  # DeepSpeed's words for no_sync, which programs match
            raise UsageError(
                f"It is illegal to call Engine.step() inside no_sync context manager: engine.{self._train.block}() "
                "is one accumulation window, reduced by the backward after it (no_sync) or when it exits "
                "(coalesce_grad_reduction); call engine.step() after the with-block"
            )
        with self._train.stepping():  # the boundary, where the caller owns the windows
            if not self.is_gradient_accumulation_boundary():
                self._train.count_micro_step()
                return
            samples = self._window_samples()
            live, outcome = self._live, None
            with self._phase("step", timed=False):
                if live is None or not live.interrupted():
                    self._reduce_window()
                    outcome = self._update(scheduler)
        if live is not None and live.interrupted():
            # [Note: collectives after a fault]: nothing of this step stands.
            live.recover(self)
            return
        if outcome is None:  # rolled back: the checkpoint's counters stand
            return
        applied, norm = outcome
        self._train.step_done(applied=applied, grad_norm=norm, samples=samples)
        loss_scale = self.loss_scale if self._scales_loss else None
        self._observe.step_ends(self.get_lr()[0], loss_scale)  # reads the window's loss where it reports
        self._train.reset_window_loss()
        self.activations.log_profile(self._train.global_steps)
        if live is None:
            self._resilience.after_step()
            return
        with live.gated():
            agreed = self._resilience.agree_after_step()
        if not live.interrupted():
            live.saving(lambda: self._resilience.act_after_step(agreed))
        if live.interrupted():  # a peer was lost after the update: this step does not stand either
            live.recover(self)
            return
        live.after_step(self)

    def _window_samples(self) -> int:
        """Samples the window ending now trained on: the global batch, or where the caller
        owns the windows, the micro-batches of its backwards on every data-parallel rank."""
        if self._train.managed:
            return self.train_batch_size()
        return self.micro_batch_size * self.dist.dp_world_size * self._train.window_backwards

    def _reduce_window(self) -> None:
        """Reduce a window that no backward of it reduced (its backwards deferred, or the
        caller's step ends it): [Note: deferred reduction]."""
        if self._train.needs_reduction:
            self._state.finish_window()
            self._train.reduced()

    def end_window(self, mean_loss: torch.Tensor) -> None:
        """End a window that a schedule ran in one go (the forwards and :meth:`run_backward`
        of all its micro-steps, as a pipeline's ``train_batch`` does): ``mean_loss`` is its
        loss per micro-step; its micro-steps are counted and the optimizer steps."""
        self._train.window_ran(mean_loss)
        assert self.is_gradient_accumulation_boundary()
        self.step()

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Pipeline engines only (``terascale.pipe.PipelineEngine``): this one raises."""
        raise ValueError(
            "engine.train_batch runs a pipeline schedule and needs a terascale.pipe.PipelineModule as the model; "
            "train this engine with engine(batch), engine.backward(loss) and engine.step()"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated so far in this window (``set_to_none`` is
        accepted for ``nn.Module``'s signature; gradient buffers are kept for reuse)."""
        try:
            if self._train.window is not WindowState.EMPTY:
                self._state.zero_grad()
        finally:  # also when the model state refuses ([Note: the optimizer step under backward])
            self._train.clear_window()

    def window_grad_norm(self) -> torch.Tensor:
        """The global L2 norm of this window's reduced gradients, unscaled, before
        clipping (collective: every rank calls it after the window's last backward).

        Computed once per window; the optimizer step clips with the same value.
        """
        if self._train.window_norm is None:
            self._complete_grads()
            extra = self._resilience.loss_flag()
            self._train.finalize(self._layout.grad_norm(self._state, extra) / self.loss_scaler.scale)
        assert self._train.window_norm is not None
        return self._train.window_norm

    def _complete_grads(self) -> None:
        """Once per window, before the gradients are used: sum tied layers' copies
        ([Note: tied parameters across stages])."""
        if self._train.window is not WindowState.FINAL:
            if not self._train.managed:  # the norm before engine.step(), which ends the window
                self._reduce_window()
            self._layout.sum_tied_grads(self._state)
            self._train.finalize()

    def _update(self, scheduler: bool = True) -> tuple[bool, float | None] | None:
        """Update from this window's gradients, or skip it (fp16 overflow, a non-finite
        gradient under ``health.non_finite.policy`` skip): ``(applied, gradient norm)``.
        None when it rolled back to a checkpoint instead (policy rollback)."""
        self._checkpointer.before_update()  # an asynchronous save may still read the state
        if self._live is not None:
            self._live.before_update()  # so may the mirror's refresh ([Note: in-memory redundancy])
        scale = self.loss_scaler.scale
        norm = None
        clip = self.config.gradient_clipping
        checks = self._resilience.checks_non_finite
        bf16 = self.config.bf16
        overflow_checked = self._scales_loss or (bf16.enabled and bf16.check_grad_overflow)
        if clip > 0 or overflow_checked or self._train.window_norm is not None or checks:
            norm = self.window_grad_norm()
        overflow = False
        if overflow_checked:
            # Non-finite on one rank is non-finite on every rank (a global norm; in a 1-bit
            # optimizer's local window the model state makes it so), so this agrees everywhere.
            overflow = all_reduce_flag(~torch.isfinite(norm), self.dist.zero_group, self.device)
            self.loss_scaler.update(overflow)  # bf16's scaler is a static 1.0
        verdict = self._resilience.check_finite(norm) if checks and not overflow else "ok"
        if verdict == "rollback":
            self._state.zero_grad()
            self._train.rolled_back()
            self._resilience.rollback()
            return None
        applied = not (overflow or verdict == "skip")
        if overflow:
            logger.info(
                "gradient overflow at step %d: step skipped, loss scale %g -> %g",
                self._train.global_steps, scale, self.loss_scaler.scale,
            )
        if applied:
            self._complete_grads()
            # Unscaling and clipping are one multiplication of the gradients.
            multiplier = torch.tensor(1.0 / scale, device=self.device)
            if clip > 0:
                multiplier = multiplier * clip_coefficient(clip, norm)
            self._state.step(self.optimizer, multiplier, self._layout.sum_norms, self._layout.orthogonalize)
            if scheduler and self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._state.zero_grad()
        return applied, None if norm is None else float(norm)

    def _begin_update_in_backward(self) -> torch.Tensor:
        """What :meth:`_update` does before an update, for one that starts under the
        window's last backward: let a background checkpoint write finish reading the state;
        the gradient multiplier (as :meth:`_update` makes it: no clipping, no fp16 there)."""
        self._checkpointer.before_update()
        if self._live is not None:
            self._live.before_update()
        return torch.tensor(1.0 / self.loss_scaler.scale, device=self.device)

    @contextmanager
    def _phase(self, name: str, inputs: Any = None, *, timed: bool = True) -> Iterator[None]:
        """The bracket of every phase: the observer's timer, trace range and token count
        (``inputs``), and the resilience monitors' progress mark, straggler timing
        (``timed``) and failure notice."""
        self._require_states_resident()
        with self._observe.phase(name, inputs), self._resilience.phase(name, timed=timed):
            if self._live is None:
                yield
            else:
                with self._live.gated():
                    yield

    def _input_cast_dtype(self) -> torch.dtype | None:
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            return torch.float16
        return None

    # -- state ---------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Save everything needed to resume into ``save_dir/<tag>`` (default tag
        ``global_step<N>``) and point ``save_dir/latest`` at it; returns the tag. Collective
        and atomic; loads on any layout; with ``checkpoint.async`` written in the
        background (see :meth:`Checkpointer.save`, :meth:`wait_for_checkpoint`).
        ``client_state``: a dict of data (numbers, strings, containers, tensors, numpy
        arrays, ...: ``[Note: client state as data]``), returned by :meth:`load_checkpoint`.
        ``exclude_frozen_parameters`` is DeepSpeed's (the Hugging Face Trainer passes True for
        PEFT models): the frozen parameters are written all the same, so the checkpoint loads
        strictly on any layout (leaving them out, as DeepSpeed does, is not built yet)."""
        if self.optimizer is None:
            raise ValueError(f"save_checkpoint: {FORWARD_ONLY}; its weights: save_16bit_model() or full_state_dict()")
        self._resilience.mark("save")
        return self._checkpointer.save(save_dir, tag, client_state, save_latest)

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        *,
        load_module_strict: bool = True,
        allow_pickled_client_state: bool | None = None,
    ) -> tuple[str | None, Any]:
        """Restore a checkpoint written by :meth:`save_checkpoint` on any layout; returns
        ``(path, client_state)``, ``(None, None)`` when there is none (collective; see
        :meth:`Checkpointer.load`). ``allow_pickled_client_state`` (default
        ``checkpoint.allow_pickled_client_state``): load an older checkpoint's pickled client
        state, which can run arbitrary code: only for a checkpoint you trust.
        ``load_module_strict`` is DeepSpeed's (the Hugging Face Trainer passes False for PEFT
        models): a terascale checkpoint holds every parameter and buffer of its model, frozen
        ones too, so it loads whole either way, and one of another model is refused either way."""
        if self.optimizer is None and not load_module_only:
            raise ValueError(f"load_checkpoint: {FORWARD_ONLY}; it loads weights only: pass load_module_only=True")
        self._resilience.mark("load")
        return self._checkpointer.load(load_dir, tag, load_optimizer_states=load_optimizer_states,
                                       load_lr_scheduler_states=load_lr_scheduler_states,
                                       load_module_only=load_module_only, read_client_state=True,
                                       allow_pickled_client_state=allow_pickled_client_state)  # fmt: skip

    def save_pretrained(self, save_dir: str | Path, **kwargs: Any) -> None:
        """Write a Hugging Face folder of the weights on rank 0 (collective; see
        :func:`terascale.engine.export.save_pretrained`)."""
        export.save_pretrained(self, save_dir, **kwargs)

    def write_on_ranks(self, write: Callable[[], None] | None, what: str) -> None:
        """Run ``write`` on the ranks that pass one; return everywhere once all are done
        (collective; see :meth:`Checkpointer.write_on_ranks`)."""
        self._checkpointer.write_on_ranks(write, what)

    @property
    def last_checkpoint_stall_s(self) -> float:
        """Seconds the last :meth:`save_checkpoint` held training up: the call itself, plus
        for an asynchronous save the next optimizer step's wait for the write."""
        return self._checkpointer.last_stall_s

    def wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save in flight; raise its error if it failed."""
        self._checkpointer.wait()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer by name, full size, fp32, on CPU, on every rank.

        Trainable parameters come from the fp32 masters; tied parameters appear under each
        of their names, as in ``module.state_dict()``; tensor-parallel slices are joined
        and every pipeline stage's entries included. Collective at ZeRO stages 1-3 and
        under model parallelism: call it on every rank.
        """
        return join_model_parallel(untiled_state_dict(self.module, self._state.full_state_dict()), self._layout)

    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the weights in the compute dtype to ``save_dir/save_filename`` on rank 0;
        False at stage 3 without ``stage3_gather_16bit_weights_on_model_save`` (collective;
        see :func:`terascale.engine.export.save_16bit_model`)."""
        return export.save_16bit_model(self, save_dir, save_filename)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: model states (the ZeRO formulas' quantity),
        offload buffers, activations (see :func:`terascale.engine.memory.memory_breakdown`),
        and ``elastic_mirror``: a live elastic job's host copies of this rank's state and of
        a peer's ([Note: in-memory redundancy]; 0 otherwise)."""
        out = memory_breakdown(self.module, self._state, self.optimizer, self.activations)
        # [Note: in-memory redundancy]: host copies of this rank's state and a peer's.
        out["elastic_mirror"] = 0 if self._live is None else self._live.host_bytes()
        return out

    def activation_report(self) -> list[dict[str, Any]]:
        """Per checkpointed block: bytes and times (see :meth:`EngineActivations.report`)."""
        return self.activations.report()

    def offload_io(self) -> dict[str, float]:
        """This rank's NVMe swap traffic so far (see ``ModelState.offload_io``)."""
        return self._state.offload_io()

    def offload_activity(self) -> IoActivity | None:
        """The activity record of this rank's NVMe swap engine (see ``ModelState.offload_activity``)."""
        return self._state.offload_activity()

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Write ``{name: value}`` (a held-out loss: ``{"Eval/loss": ...}``) to the
        monitors at the current sample count, beside the engine's own metrics (which
        ``terascale report`` plots). Any rank may call it; the reporting rank writes."""
        self._reporter.write(metrics)

    def comms_summary(self) -> str:
        """The comms logger's table so far (needs ``comms_logger.enabled``)."""
        return self._observe.comms_summary()

    @property
    def comms_logger(self) -> Any:
        """The :class:`terascale.profiling.comms.CommsLogger` counting this engine's
        collectives (``records()``, ``totals()``, ``reset()``), or None when
        ``comms_logger.enabled`` is off."""
        return self._observe.comms

    @property
    def flops_profiler(self) -> Any:
        """The :class:`~terascale.profiling.flops.FlopsProfiler` of step
        ``flops_profiler.profile_step`` once that step ran (None before, or when off)."""
        return self._observe.last_profile

    @property
    def straggler_report(self) -> Any:
        """The straggler detector's last :class:`~terascale.health.straggler.StragglerReport`
        (None before its first check, or with ``health.straggler`` off)."""
        return self._resilience.straggler_report

    @property
    def resumed_in_s(self) -> float:
        """Seconds ``checkpoint.auto_resume``'s load took at start-up (0: nothing resumed)."""
        return self._resilience.resumed_in_s

    @property
    def timers(self) -> StepTimers:
        """The forward/backward/step wall-clock timers (active with ``wall_clock_breakdown``)."""
        return self._observe.timers

    def destroy(self) -> None:
        """Finish a checkpoint save in flight, remove hooks and close monitors; a rank of a
        live elastic job leaves it (the engine is unusable afterwards)."""
        self._checkpointer.close()
        self._resilience.close()
        self._observe.close()
        self._state.remove_hooks()
        self.activations.close()
        self._reporter.close()
        if self._live is not None:
            self._live.close()
