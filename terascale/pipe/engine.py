"""``PipelineEngine``: the engine of a ``PipelineModule``, a layer over the engine's public phases.

``terascale.initialize`` returns one when the model is a :class:`PipelineModule` (as
DeepSpeed's returns its ``PipelineEngine``). ``train_batch`` runs one global batch
(``gradient_accumulation_steps`` micro-batches) through this stage's 1F1B or interleaved
schedule (:class:`~terascale.pipe.runner.PipelineRunner`) and steps once. The engine is the
runner's :class:`~terascale.pipe.runner.StageDriver` through the public phases of
:class:`~terascale.engine.Engine`: a chunk's forward is the engine's forward (device
placement, activation hooks, the phase bracket), a backward is ``run_backward`` (loss
scaling, the model state's reduce and gather hooks), and the window ends with
``end_window`` (the engine's step: clipping, fp16 overflow, tied gradients summed, see
``[Note: tied parameters across stages]``). With more than one stage, calling
``forward``/``backward``/``step`` directly is an error: the schedule runs them. With tensor
parallelism the config's ``pipeline.pipe_partitioned``/``grad_partitioned`` split the
activations/gradients between stages over the tensor-parallel group (``[Note: partitioned
boundaries]`` in :mod:`terascale.pipe.p2p`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from terascale.checkpointing import non_reentrant_checkpoint, reentrant_checkpoint
from terascale.comm import DistributedContext
from terascale.config import Config
from terascale.engine import Engine, PreparedModel
from terascale.errors import UsageError
from terascale.pipe.module import PipelineModule
from terascale.pipe.p2p import Partitioning, Payload
from terascale.pipe.runner import PipelineRunner
from terascale.pipe.schedule import StageGrid


class PipelineEngine(Engine):
    """An :class:`Engine` whose module is a :class:`PipelineModule`; trains whole batches
    with :meth:`train_batch` (see the module docstring)."""

    def __init__(self, prepared: PreparedModel, config: Config, dist_ctx: DistributedContext, **kwargs: Any) -> None:
        if not config.managed_gradient_accumulation:
            raise UsageError(
                "managed_gradient_accumulation false is not supported with pipeline parallelism: a "
                "PipelineModule's train_batch runs gradient_accumulation_steps micro-batches as one window; "
                "remove the key"
            )
        super().__init__(prepared, config, dist_ctx, **kwargs)
        module = self.module
        assert isinstance(module, PipelineModule)
        self.stages = module.num_stages
        pp_group = dist_ctx.pp_group if dist_ctx.pp_group is not None else module.topology.group("pp")
        self._runner = PipelineRunner(
            module.loss_fn,
            StageGrid(module.num_stages, module.virtual_stages),
            module.stage_id,
            pp_group,
            dist_ctx.dp_group,
            dist_ctx.device,
            _partitioning(dist_ctx, config),
        )
        self._running = False
        self._train_data: Iterator[Any] | None = None
        # pipeline.use_reentrant picks the checkpoint form, whatever the interval now: the
        # module's set_checkpoint_interval can turn checkpointing on later. False replaces
        # the module's function, as DeepSpeed does; True keeps one the module was given.
        if not config.pipeline.use_reentrant:
            module.activation_checkpoint_func = non_reentrant_checkpoint
        elif module.activation_checkpoint_func is None:
            module.activation_checkpoint_func = reentrant_checkpoint

    # -- batches --------------------------------------------------------------------------------

    def reset_activation_shape(self) -> None:
        """DeepSpeed's call for batches whose activation shapes change: nothing to reset here,
        since stages renegotiate shapes whenever they change ([Note: shape negotiation])."""

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one global batch: ``gradient_accumulation_steps`` micro-batches from
        ``data_iter`` (``(inputs, labels)`` pairs; default: the ``training_data`` loader)
        through the pipeline schedule, then one optimizer step.

        Collective over every rank. Returns the batch's mean loss (over micro-batches and
        data-parallel replicas), the same float tensor on every pipeline stage.
        """
        if not torch.is_grad_enabled():
            raise ValueError("train_batch needs gradients enabled; use eval_batch under torch.no_grad()")
        if not self.train_state.at_window_start:
            raise ValueError(
                "train_batch runs a whole accumulation window, but the engine is inside one (micro-steps taken "
                "with engine.backward/step, or set_gradient_accumulation_boundary set): finish that window first "
                "and reset set_gradient_accumulation_boundary(None)"
            )
        if data_iter is None and self._runner.reads_data:
            data_iter = self._training_data()
        self.module.train()
        with self._scheduled():
            return self._runner.train(self, data_iter, self.gradient_accumulation_steps())

    def eval_batch(self, data_iter: Iterator[Any] | None, return_logits: bool = False, compute_loss: bool = True) -> Any:
        """Forward ``gradient_accumulation_steps`` micro-batches without gradients.

        Returns the mean loss on every stage (None without ``compute_loss``), with
        ``return_logits`` as ``(loss, outputs)``: the last stage's outputs of the batch
        (concatenated along dim 0), None on other stages. Collective over every rank.
        """
        self.module.eval()
        with self._scheduled():
            micro_batches = self.gradient_accumulation_steps()
            loss, logits = self._runner.evaluate(self, data_iter, micro_batches, compute_loss, return_logits)
        return (loss, logits) if return_logits else loss

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the module checkpoints with a reentrant function (DeepSpeed's private
        name, which scripts and DeepSpeed's tests read); see
        :meth:`PipelineModule.checkpoints_reentrantly`."""
        return self.module.checkpoints_reentrantly()

    def pipeline_stats(self) -> dict[str, float]:
        """This stage's timing of the last train/eval batch: ``step_s`` (wall time of the
        schedule), ``busy_s`` (forward and backward compute), ``bubble`` (1 - busy/step),
        ``ideal_bubble`` ((p - 1) / (v m + p - 1) for p stages, v chunks, m micro-batches),
        ``micro_batches``, and ``sent_act_bytes`` / ``sent_grad_bytes`` (activations and
        gradients this rank sent to its neighbour stages)."""
        return self._runner.stats.as_dict()

    # -- the phases a script may not call with several stages -------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_direct("engine.forward")
        return super().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        self._refuse_direct("engine.backward")
        super().backward(loss, retain_graph, scale_wrt_gas)

    def step(self) -> None:
        self._refuse_direct("engine.step")
        super().step()

    def _refuse_direct(self, what: str) -> None:
        """Raise unless one stage holds the whole model or a batch is running."""
        if self.stages > 1 and not self._running:
            raise ValueError(
                f"{what} is not available on a pipeline-parallel engine ({self.stages} stages): run whole "
                "batches with engine.train_batch(data_iter) (and engine.eval_batch(data_iter) to evaluate); "
                "the pipeline schedule runs the forwards, backwards and the step"
            )

    @contextmanager
    def _scheduled(self) -> Iterator[None]:
        self._running = True
        try:
            yield
        finally:
            self._running = False

    def _training_data(self) -> Iterator[Any]:
        loader = self.training_dataloader
        if loader is None:
            raise ValueError("train_batch needs data_iter, or training_data given to terascale.initialize")
        if self._train_data is None:
            self._train_data = _forever(loader)
        return self._train_data

    # -- the runner's StageDriver, over the engine's public phases --------------------------------

    def forward_chunk(self, chunk: int, inputs: Payload) -> Payload:
        return self(inputs, chunk=chunk)

    def backward_chunk(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, sync: bool) -> None:
        self.run_backward(tensors, grads, sync=sync)

    def finish_window(self, loss: torch.Tensor) -> None:
        self.end_window(loss)


def _partitioning(dist_ctx: DistributedContext, config: Config) -> Partitioning:
    """The config's ``pipeline.pipe_partitioned``/``grad_partitioned`` over the tensor-parallel
    group (none without tensor parallelism); see [Note: partitioned boundaries] in
    :mod:`terascale.pipe.p2p`."""
    if dist_ctx.mp_group is None or dist_ctx.mp_world_size == 1:
        return Partitioning()
    return Partitioning(dist_ctx.mp_group, config.pipeline.pipe_partitioned, config.pipeline.grad_partitioned)


def _forever(loader: Iterable[Any]) -> Iterator[Any]:
    """``loader``'s batches, epoch after epoch (DeepSpeed's RepeatingLoader)."""
    while True:
        yield from loader
