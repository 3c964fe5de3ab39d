"""The training engine: forward, backward and step with accumulation, precision and clipping.

The engine orchestrates; the pieces it calls do the work: the model state
(``model_state``: replicated at stage 0, ``terascale.zero`` sharded at stages 1-3, see
``[Note: model state]``) holds parameters, gradients and fp32 masters and reduces the
gradients, ``loss_scaler`` and ``clipping`` act on the reduced gradients, and the
optimizer/scheduler come from ``terascale.optim``. The train step has no per-stage code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from terascale.comm import DistributedContext, all_reduce_flag, broadcast_tensors
from terascale.config import Config
from terascale.engine.activations import EngineActivations
from terascale.engine.checkpointing import Checkpointer
from terascale.engine.clipping import clip_coefficient
from terascale.engine.loss_scaler import build_loss_scaler
from terascale.engine.model_state import ModelState, adopt_optimizer, build_model_state
from terascale.engine.monitor import StepTimers, build_monitors, check_monitor_packages
from terascale.engine.observe import Observer
from terascale.engine.parallel import ParallelLayout, join_model_parallel
from terascale.engine.pipeline import pipeline_for
from terascale.engine.precision import PrecisionPolicy
from terascale.engine.resilience import Resilience
from terascale.offload.aio import IoActivity
from terascale.offload.policy import unpinned_keys
from terascale.optim import build_optimizer, build_scheduler
from terascale.zero import WrapPolicy
from terascale.zero.tiling import tile_linears, untiled_state_dict

logger = logging.getLogger("terascale")

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None
SchedulerArg = Any  # an LR scheduler instance or a callable(optimizer) -> scheduler


class Engine(nn.Module):
    """Wraps the user's module for data-parallel mixed-precision training.

    Call it like the module for forward; call :meth:`backward` with the loss and
    :meth:`step` after every micro-batch. Gradients are averaged over the data-parallel
    group and the optimizer steps once every ``gradient_accumulation_steps`` micro-batches.
    """

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        dist_ctx: DistributedContext,
        *,
        optimizer: OptimizerArg = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: SchedulerArg = None,
        wrap_policy: WrapPolicy | None = None,
    ) -> None:
        super().__init__()
        assert not config.auto_keys, f"resolve the config's 'auto' values first: {config.auto_keys}"
        self.config = config
        self.dist = dist_ctx
        if config.log_level is not None:
            logger.setLevel(config.log_level.upper())
        if dist_ctx.rank == 0:
            _log_config_notes(config)
        check_monitor_packages(config)  # before any collective: the error must reach every rank
        batch = config.resolve_batch(dist_ctx.dp_world_size)
        self.train_batch_size = batch.train_batch_size
        self.micro_batch_size = batch.micro_batch_size
        self.gradient_accumulation_steps = batch.gradient_accumulation_steps

        self.precision = PrecisionPolicy(compute_dtype=config.compute_dtype)
        self.module = module.to(device=dist_ctx.device, dtype=self.precision.compute_dtype)
        # Every rank starts from rank 0's weights, whatever each process's seed did.
        broadcast_tensors(
            [t.data for t in module.parameters()] + list(module.buffers()), dist_ctx.dp_group
        )

        if optimizer is not None and config.optimizer is not None:
            raise ValueError(
                "an optimizer was passed to terascale.initialize and the config has an 'optimizer' "
                "section; remove one of them"
            )
        if config.zero_optimization.tile_linear_above is not None:
            if isinstance(optimizer, torch.optim.Optimizer) or model_parameters is not None:
                raise ValueError(
                    "zero_optimization.tile_linear_above replaces big nn.Linear layers (and their parameters) "
                    "inside terascale.initialize, so an optimizer or model_parameters built before it would "
                    "hold the old ones: use the config's 'optimizer' section or pass optimizer as a callable"
                )
            tile_linears(self.module, int(config.zero_optimization.tile_linear_above))
        param_groups = _user_param_groups(module, optimizer, model_parameters)
        # Blocks are found before ZeRO shards the parameters (a sharded block looks empty).
        self.activations = EngineActivations(self.module, config, dist_ctx, wrap_policy or WrapPolicy())
        self._parallel = ParallelLayout.build(self.module, dist_ctx)
        self._state: ModelState = build_model_state(
            self.module, param_groups, config, dist_ctx, self.precision, wrap_policy, self._parallel.classes
        )
        self.optimizer = self._build_optimizer(optimizer)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.loss_scaler = build_loss_scaler(config.fp16)

        self.micro_steps = 0
        # None: boundaries every gradient_accumulation_steps micro-steps; True/False: as
        # set by set_gradient_accumulation_boundary (a trainer that decides them itself).
        self._boundary: bool | None = None
        self._window_norm: torch.Tensor | None = None  # this window's unscaled gradient norm, once computed
        self._ties_summed = False  # this window's tied gradients summed over their copies
        self._has_grads = False
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._window_loss = torch.zeros((), device=dist_ctx.device)
        self._last_grad_norm: float | None = None
        # One rank reports: every tensor-parallel rank and pipeline stage sees the same loss.
        self._reports = dist_ctx.dp_rank == 0 and dist_ctx.tp_rank == 0 and dist_ctx.pp_rank == 0
        self._monitors = build_monitors(config) if self._reports else []
        self.training_dataloader = None  # set by initialize(); its sampler position is checkpointed
        self._checkpointer = Checkpointer(self)
        self._pipeline = pipeline_for(self)  # a PipelineModule's schedule runner, else None
        self._resilience = Resilience(self)  # interval/signal saves, resume, health monitors
        self._observe = Observer(self)  # timers, the print line, flops profiler, comms logger, traces

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
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step (None before one was computed)."""
        return self._last_grad_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last of its accumulation window."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the next micro-step ends its accumulation window (DeepSpeed's API).

        For training loops that decide the windows themselves (the Hugging Face Trainer
        ends one early at the end of an epoch): set it before each forward/backward; the
        last micro-step of a window must have it True. ``None`` returns to counting
        ``gradient_accumulation_steps`` micro-steps.
        """
        self._boundary = None if is_boundary is None else bool(is_boundary)

    def was_step_applied(self) -> bool:
        """False if the last boundary step was skipped because of an fp16 overflow."""
        return self._step_applied

    # -- the training protocol ---------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; tensor inputs are moved to the engine's device."""
        if self._pipeline is not None:
            self._pipeline.refuse_direct("engine.forward")
        with self._observe.phase("forward", (args, kwargs)):
            args, kwargs = _to_device((args, kwargs), self.device, self._input_cast_dtype())
            with self.activations.forward_context(), self._resilience.phase("forward"):
                out = self.module(*args, **kwargs)
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss`` scaled for accumulation (1/steps, unless ``scale_wrt_gas``
        is False: the caller already divided it) and for fp16.

        On the last micro-step of a window, gradient buckets are all-reduced while the
        rest of backward still runs.
        """
        if self._pipeline is not None:
            self._pipeline.refuse_direct("engine.backward")
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}")
        self._window_loss += loss.detach().float() * (1 if scale_wrt_gas else self.gradient_accumulation_steps)
        scale = self.loss_scaler.scale / (self.gradient_accumulation_steps if scale_wrt_gas else 1)
        self._run_backward(
            self.is_gradient_accumulation_boundary(), lambda: (loss.float() * scale).backward(retain_graph=retain_graph)
        )

    def _run_backward(self, sync: bool, run: Callable[[], None]) -> None:
        """``run`` (one backward) inside the model state's bracket: ``sync`` on the window's
        last backward, when the gradients are reduced over the data-parallel ranks."""
        with self._observe.phase("backward"):
            self._state.prepare_backward(sync=sync)
            self.activations.before_backward()
            with self._resilience.phase("backward"):
                run()
            self._state.post_backward()
        self._has_grads = True

    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary, update the parameters."""
        if self._pipeline is not None:
            self._pipeline.refuse_direct("engine.step")
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        with self._observe.phase("step"), self._resilience.phase("step", timed=False):
            kept = self._optimizer_step()
        if not kept:  # rolled back: the checkpoint's counters stand
            return
        self.global_steps += 1
        self.global_samples += self.train_batch_size
        self._observe.step_ends()
        self._report()
        self.activations.log_profile(self.global_steps)
        self.micro_steps += 1
        self._resilience.after_step()

    # -- pipeline parallelism (a terascale.pipe.PipelineModule; see terascale.engine.pipeline) --

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one global batch: ``gradient_accumulation_steps`` micro-batches from
        ``data_iter`` (``(inputs, labels)`` pairs; default: the ``training_data`` loader)
        through the pipeline schedule, then one optimizer step.

        Collective over every rank. Returns the batch's mean loss (over micro-batches and
        data-parallel replicas), the same float tensor on every pipeline stage.
        """
        return self._pipeline_or_error("train_batch").train_batch(data_iter)

    def eval_batch(self, data_iter: Iterator[Any] | None, return_logits: bool = False, compute_loss: bool = True) -> Any:
        """Forward ``gradient_accumulation_steps`` micro-batches without gradients.

        Returns the mean loss on every stage (None without ``compute_loss``), with
        ``return_logits`` as ``(loss, outputs)``: the last stage's outputs of the batch
        (concatenated along dim 0), None on other stages. Collective over every rank.
        """
        return self._pipeline_or_error("eval_batch").eval_batch(data_iter, return_logits, compute_loss)

    def pipeline_stats(self) -> dict[str, float]:
        """This stage's timing of the last train/eval batch: ``step_s`` (wall time of the
        schedule), ``busy_s`` (forward and backward compute), ``bubble`` (1 - busy/step),
        ``ideal_bubble`` ((p - 1) / (v m + p - 1) for p stages, v chunks, m micro-batches),
        ``micro_batches``, and ``sent_act_bytes`` / ``sent_grad_bytes`` (activations and
        gradients this rank sent to its neighbour stages)."""
        return self._pipeline_or_error("pipeline_stats").stats()

    def _pipeline_or_error(self, what: str) -> Any:
        if self._pipeline is None:
            raise ValueError(f"engine.{what} needs a terascale.pipe.PipelineModule as the model")
        return self._pipeline

    def backward_stage(
        self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None = None, *, sync: bool
    ) -> None:
        """One pipeline stage's backward of one micro-batch (the pipeline runner calls it).

        ``grads=None``: ``tensors`` is ``[loss]``, scaled here as :meth:`backward` scales
        (1/accumulation steps, fp16 loss scale). Otherwise ``tensors`` are a chunk's
        outputs and ``grads`` their gradients from the next stage, which already carry
        that scaling. ``sync`` marks the last backward of the window on this stage: the
        model state reduces the gradients then (and ZeRO-2/3 after every backward).
        """
        def run() -> None:
            if grads is None:
                (loss,) = tensors
                (loss.float() * (self.loss_scaler.scale / self.gradient_accumulation_steps)).backward()
            elif tensors:
                torch.autograd.backward(list(tensors), list(grads))

        self._run_backward(sync, run)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated so far in this window (``set_to_none`` is
        accepted for ``nn.Module``'s signature; gradient buffers are kept for reuse)."""
        if self._has_grads:
            self._state.zero_grad()
            self._has_grads = False
        self._window_norm = None
        self._ties_summed = False

    def window_grad_norm(self) -> torch.Tensor:
        """The global L2 norm of this window's reduced gradients, unscaled, before
        clipping (collective: every rank calls it after the window's last backward).

        Computed once per window; the optimizer step clips with the same value.
        """
        if self._window_norm is None:
            self._sum_tied_grads()
            extra = self._resilience.loss_flag()
            self._window_norm = self._parallel.grad_norm(self._state, extra) / self.loss_scaler.scale
        return self._window_norm

    def _sum_tied_grads(self) -> None:
        """Once per window, before the gradients are used ([Note: tied parameters across stages])."""
        if not self._ties_summed:
            self._parallel.sum_tied_grads(self._state)
            self._ties_summed = True

    def _optimizer_step(self) -> bool:
        """Update from this window's gradients (or skip); False when it rolled back to a
        checkpoint instead (``health.non_finite.policy`` rollback)."""
        self._checkpointer.before_update()  # an asynchronous save may still read the state
        scale = self.loss_scaler.scale
        norm = None
        clip = self.config.gradient_clipping
        checks = self._resilience.checks_non_finite
        if clip > 0 or self.config.fp16.enabled or self._window_norm is not None or checks:
            norm = self.window_grad_norm()
        overflow = False
        if self.config.fp16.enabled:
            # The norm is global (every rank holds the same one), so this agrees everywhere.
            overflow = all_reduce_flag(~torch.isfinite(norm), self.dp_group, self.device)
            self.loss_scaler.update(overflow)
        verdict = self._resilience.check_finite(norm) if checks and not overflow else "ok"
        if verdict == "rollback":
            self._state.zero_grad()
            self._has_grads, self._window_norm, self._ties_summed = False, None, False
            self._window_loss.zero_()
            self._resilience.rollback()
            return False
        if overflow or verdict == "skip":
            self.skipped_steps += 1
            self._step_applied = False
            if overflow:
                logger.info(
                    "fp16 overflow at step %d: step skipped, loss scale %g -> %g",
                    self.global_steps, scale, self.loss_scaler.scale,
                )
        else:
            self._sum_tied_grads()
            # Unscaling and clipping are one multiplication of the gradients.
            multiplier = torch.tensor(1.0 / scale, device=self.device)
            if clip > 0:
                multiplier = multiplier * clip_coefficient(clip, norm)
            self._state.step(self.optimizer, multiplier, self._parallel.sum_norms)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self._step_applied = True
        self._last_grad_norm = None if norm is None else float(norm)
        self._state.zero_grad()
        self._has_grads = False
        self._window_norm = None
        self._ties_summed = False
        return True

    def _report(self) -> None:
        every = self.config.steps_per_print
        want_print = bool(every) and self.global_steps % every == 0  # the same on every rank
        if not (want_print or self._monitors):
            self._window_loss.zero_()
            return
        loss = float(self._window_loss) / self.gradient_accumulation_steps
        self._window_loss.zero_()
        if self._monitors:
            events = [
                ("Train/Samples/train_loss", loss, self.global_samples),
                ("Train/Samples/lr", self.get_lr()[0], self.global_samples),
            ]
            if self.config.fp16.enabled:
                events.append(("Train/Samples/loss_scale", self.loss_scale, self.global_samples))
            for m in self._monitors:
                m.write(events)
        if want_print:
            self._observe.report(loss)  # collective: every rank's memory

    # -- state ---------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
    ) -> str:
        """Save everything needed to resume into ``save_dir/<tag>`` (default tag
        ``global_step<N>``) and point ``save_dir/latest`` at it; returns the tag.

        Collective: call on every rank. Each rank writes only its own state, as spans of
        named parameters, so the checkpoint loads on any number of ranks, at any ZeRO
        stage, offloaded or not. The write is atomic: a failure or crash leaves earlier
        checkpoints and ``latest`` as they were. ``client_state`` (any picklable dict)
        comes back from :meth:`load_checkpoint`. With ``checkpoint.async`` the call returns
        at once and the files are written in the background; the next optimizer step waits
        for the write (see :meth:`wait_for_checkpoint`).
        """
        self._resilience.mark("save")
        return self._checkpointer.save(save_dir, tag, client_state, save_latest)

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, Any]:
        """Restore a checkpoint written by :meth:`save_checkpoint` on any layout.

        ``load_dir`` is a save directory (with ``tag``, default the one ``latest`` names)
        or a checkpoint folder itself.

        Collective. Returns ``(path, client_state)``; ``(None, None)`` when ``load_dir``
        has no ``latest`` and no ``tag`` is given. ``load_module_only`` restores only
        parameters and buffers (optimizer, scheduler, counters, RNG and data position are
        left as they are).
        """
        self._resilience.mark("load")
        return self._checkpointer.load(
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    def save_pretrained(self, save_dir: str | Path, **kwargs: Any) -> None:
        """Write a Hugging Face folder of the current weights (fp32 masters) on rank 0 with
        the model's own ``save_pretrained``; ``from_pretrained`` loads it. Collective.

        For the wrapped module to be a ``transformers.PreTrainedModel``; ``kwargs`` go to
        its ``save_pretrained``. Gathers the full state dict in host memory; for models
        larger than that, save a checkpoint and run ``terascale consolidate --hf``, which
        streams one parameter at a time.
        """
        if not hasattr(self.module, "save_pretrained"):
            raise ValueError(
                f"save_pretrained needs a Hugging Face PreTrainedModel, this engine wraps a "
                f"{type(self.module).__name__}; use save_checkpoint and `terascale consolidate`"
            )
        state = self.full_state_dict()

        def write() -> None:
            self.module.save_pretrained(str(save_dir), state_dict=state, **kwargs)

        self.write_on_ranks(write if self.dist.rank == 0 else None, f"save_pretrained to {save_dir}")

    def write_on_ranks(self, write: Callable[[], None] | None, what: str) -> None:
        """Run ``write`` on the ranks that pass one (rank 0 alone, or one per node; the
        others pass None); every rank returns once all writers have finished, and raises a
        writer's error if one failed (``what`` names the write). Collective: the files are
        complete on return everywhere, so any rank may read them next."""
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
        return join_model_parallel(untiled_state_dict(self.module, self._state.full_state_dict()), self._parallel)

    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the model's weights in the compute dtype to ``save_dir/save_filename`` (rank 0).

        Collective. ``.safetensors`` names are written with safetensors, others with
        ``torch.save``. At ZeRO stage 3 this needs
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (as in DeepSpeed):
        without it nothing is written and False is returned.
        """
        zero = self.config.zero_optimization
        if zero.stage == 3 and not zero.gather_16bit_weights_on_model_save:
            logger.warning(
                "save_16bit_model: nothing saved; at stage 3 set "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save to true"
            )
            return False
        dtype = self.precision.compute_dtype
        state = {
            k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.full_state_dict().items()
        }
        path = Path(save_dir) / save_filename

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            if path.suffix == ".safetensors":
                from safetensors.torch import save_file

                save_file(state, str(tmp))  # full_state_dict copies every name: nothing shared
            else:
                torch.save(state, tmp)
            tmp.replace(path)  # atomic: a failed write leaves the previous file intact

        self.write_on_ranks(write if self.dist.rank == 0 else None, f"save_16bit_model to {path}")
        return True

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of model state this rank holds now, by kind.

        ``params`` (the model's low-precision parameters: full at stages 0-2, this rank's
        shards at stage 3), ``gathered_params`` (stage 3: full groups gathered right now),
        ``grads`` (accumulation buffers and gradient shards), ``grad_buffers`` (stages
        2-3: full gradient buffers kept between reductions for reuse, a working set
        bounded by the reduce bucket), ``offload_buffers`` and ``nvme`` (optimizer offload to
        NVMe: host swap buffers, and bytes in this rank's swap files), ``master_params`` (fp32
        masters not shared with ``params``), ``optimizer_state`` (moments etc.),
        ``buffers`` (module buffers), and ``model_states``, the sum of params, grads,
        masters and optimizer state - the quantity of the ZeRO memory formulas. Activation
        memory: ``activations`` (bytes autograd kept for backward after the last forward,
        measured with ``memory_breakdown`` or ``activation_checkpointing.profile``, else 0),
        ``checkpoint_inputs`` (checkpointed blocks' inputs held on the device at the
        peak) and ``activation_host_buffers`` (host buffers of offloaded checkpoints);
        :meth:`activation_report` has them by block.
        """
        out = {
            "params": 0,
            "gathered_params": 0,
            "grads": 0,
            "grad_buffers": 0,
            "master_params": 0,
            "offload_buffers": 0,
            "nvme": 0,
        }
        out.update(self._state.memory())
        out.update(self.activations.memory())
        out["optimizer_state"] = sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        out["buffers"] = sum(b.numel() * b.element_size() for b in self.module.buffers())
        out["model_states"] = out["params"] + out["grads"] + out["master_params"] + out["optimizer_state"]
        return out

    def activation_report(self) -> list[dict[str, Any]]:
        """Per block of the last forward/backward: bytes saved for backward (when
        measured), checkpoint inputs, and with ``profile`` forward, recompute, offload and
        fetch-wait times and the recompute's output bytes."""
        return self.activations.report()

    def offload_io(self) -> dict[str, float]:
        """This rank's NVMe swap traffic so far: bytes ``read`` and ``written``, and the
        seconds its I/O engine had reads, writes or either in flight (``read_busy_s``,
        ``write_busy_s``, ``busy_s``); zeros without an NVMe tier. What a step costs is
        the difference across it."""
        return self._state.offload_io()

    def offload_activity(self) -> IoActivity | None:
        """The activity record of this rank's NVMe swap engine (None without an NVMe tier):
        set its ``recording`` to keep the spans with reads or writes in flight and the
        spans the training thread waited for them (``bench/offload.py`` draws them)."""
        return self._state.offload_activity()

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Write ``{name: value}`` (a held-out loss: ``{"Eval/loss": ...}``) to the
        monitors at the current sample count, beside the engine's own metrics (which
        ``terascale report`` plots). Any rank may call it; the reporting rank writes."""
        self._observe.write(metrics)

    def comms_summary(self) -> str:
        """The comms logger's table so far: per collective and message size, count,
        latency, algorithmic and bus bandwidth (needs ``comms_logger.enabled``)."""
        return self._observe.comms_summary()

    @property
    def timers(self) -> StepTimers:
        """The forward/backward/step wall-clock timers (active with ``wall_clock_breakdown``)."""
        return self._observe.timers

    def destroy(self) -> None:
        """Finish a checkpoint save in flight, remove hooks and close monitors (the engine
        is unusable afterwards)."""
        self._checkpointer.close()
        self._resilience.close()
        self._observe.close()
        self._state.remove_hooks()
        self.activations.close()
        for m in self._monitors:
            m.close()
        self._monitors = []

    # -- construction helpers ------------------------------------------------------------------

    def _input_cast_dtype(self) -> torch.dtype | None:
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            return torch.float16
        return None

    def _build_optimizer(self, optimizer: OptimizerArg) -> torch.optim.Optimizer:
        section = self.config.optimizer
        groups = self._state.optimizer_param_groups()
        if isinstance(optimizer, torch.optim.Optimizer):
            adopt_optimizer(optimizer, groups)
            built = optimizer
        elif callable(optimizer):
            built = optimizer(groups)
        elif section is None:
            raise ValueError(
                "no optimizer: add an 'optimizer' section to the config (e.g. "
                '{"type": "AdamW", "params": {"lr": 1e-3}}) or pass optimizer= to terascale.initialize'
            )
        else:
            built = build_optimizer(section.type, dict(section.params), groups)
        self._state.check_optimizer(built)
        self._parallel.check_optimizer(built)
        return built

    def _build_scheduler(self, lr_scheduler: SchedulerArg) -> Any:
        section = self.config.scheduler
        if section is not None:
            if lr_scheduler is not None:
                raise ValueError(
                    "an lr_scheduler was passed to terascale.initialize and the config has a "
                    "'scheduler' section; remove one of them"
                )
            return build_scheduler(section.type, dict(section.params), self.optimizer)
        if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
            return lr_scheduler(self.optimizer)
        return lr_scheduler


def _user_param_groups(
    module: nn.Module, optimizer: OptimizerArg, model_parameters: Iterable[Any] | None
) -> list[dict]:
    """The optimizer groups the user asked for, as dicts over the module's parameters.

    From a client optimizer's groups, else ``model_parameters`` (tensors or dicts of
    options), else every parameter with ``requires_grad``. Each parameter appears once.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError(
                "the optimizer passed to terascale.initialize already has state; construct it "
                "fresh over model.parameters() (terascale gives it fp32 master weights)"
            )
        raw: list[Any] = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        raw = list(model_parameters)
    else:
        raw = [p for p in module.parameters() if p.requires_grad]
    if raw and not isinstance(raw[0], dict):
        raw = [{"params": raw}]
    in_module = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    groups = []
    for group in raw:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        kept = []
        for p in params:
            if id(p) not in in_module:
                raise ValueError("model_parameters contains a tensor that is not a parameter of the model")
            if not p.requires_grad:
                raise ValueError("model_parameters contains a parameter with requires_grad=False")
            if id(p) not in seen:
                seen.add(id(p))
                kept.append(p)
        groups.append({**group, "params": kept})
    return groups


def _to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    if isinstance(obj, torch.Tensor):
        if float_dtype is not None and obj.is_floating_point():
            return obj.to(device=device, dtype=float_dtype, non_blocking=True)
        return obj.to(device, non_blocking=True) if obj.device != device else obj
    if isinstance(obj, (list, tuple)):
        converted = [_to_device(o, device, float_dtype) for o in obj]
        return type(obj)(converted) if not hasattr(obj, "_fields") else type(obj)(*converted)
    if isinstance(obj, dict):
        return {k: _to_device(v, device, float_dtype) for k, v in obj.items()}
    return obj


def _log_config_notes(config: Config) -> None:
    """Say once, at start-up, what loading and resolving the config decided for the user."""
    for note in config.notes:
        logger.warning("config: %s", note)
    if config.resolved:
        logger.info('config: resolved "auto": %s', "; ".join(str(r) for r in config.resolved))
    unpinned = unpinned_keys(config)
    if unpinned:
        logger.warning(
            "config: %s: no accelerator on this machine, so host buffers are not pinned "
            "(pinning only speeds up copies to a GPU)", ", ".join(unpinned),
        )
