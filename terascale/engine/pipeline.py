"""The engine's side of pipeline parallelism: it drives a ``PipelineModule``'s schedule.

An engine whose module is a :class:`terascale.pipe.PipelineModule` gets an
:class:`EnginePipeline`. ``engine.train_batch`` runs one global batch
(``gradient_accumulation_steps`` micro-batches) through the stage's 1F1B or interleaved
schedule (:class:`terascale.pipe.runner.PipelineRunner`) and steps once; this class is the
runner's :class:`~terascale.pipe.runner.StageDriver`: forwards go through the engine's
device placement and activation hooks, backwards through
:meth:`~terascale.engine.Engine.backward_stage` (loss scaling, the model state's reduce
and gather hooks), and the window ends with the engine's own ``step`` (clipping, fp16
overflow, tied gradients summed, see ``[Note: tied parameters across stages]``).
With more than one stage, calling ``forward``/``backward``/``step`` directly is an error.
With tensor parallelism the config's ``pipeline.pipe_partitioned``/``grad_partitioned``
split the activations/gradients between stages over the engine's tensor-parallel group
(``[Note: partitioned boundaries]`` in :mod:`terascale.pipe.p2p`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from terascale.pipe import PipelineModule
from terascale.pipe.p2p import Partitioning
from terascale.pipe.runner import PipelineRunner
from terascale.pipe.schedule import StageGrid

if TYPE_CHECKING:
    from terascale.engine.engine import Engine


def pipeline_for(engine: Engine) -> EnginePipeline | None:
    """The pipeline driver of ``engine`` if its module is a PipelineModule, else None."""
    return EnginePipeline(engine) if isinstance(engine.module, PipelineModule) else None


def _partitioning(engine: Engine) -> Partitioning:
    """The config's ``pipeline.pipe_partitioned``/``grad_partitioned`` over the engine's
    tensor-parallel group (none without tensor parallelism); see [Note: partitioned
    boundaries] in :mod:`terascale.pipe.p2p`."""
    ctx, cfg = engine.dist, engine.config.pipeline
    if ctx.mp_group is None or ctx.mp_world_size == 1:
        return Partitioning()
    return Partitioning(ctx.mp_group, cfg.pipe_partitioned, cfg.grad_partitioned)


def _forever(loader: Iterable[Any]) -> Iterator[Any]:
    """``loader``'s batches, epoch after epoch (DeepSpeed's RepeatingLoader)."""
    while True:
        yield from loader


class EnginePipeline:
    """Runs ``engine``'s pipeline schedules; see the module docstring."""

    def __init__(self, engine: Engine) -> None:
        module = engine.module
        assert isinstance(module, PipelineModule)
        self.engine = engine
        self.stages = module.num_stages
        pp_group = engine.dist.pp_group if engine.dist.pp_group is not None else module.topology.group("pp")
        self.runner = PipelineRunner(
            module.loss_fn,
            StageGrid(module.num_stages, module.virtual_stages),
            module.stage_id,
            pp_group,
            engine.dist.dp_group,
            engine.device,
            _partitioning(engine),
        )
        self._running = False
        self._train_data: Iterator[Any] | None = None

    def refuse_direct(self, what: str) -> None:
        """Raise unless one stage holds the whole model or a batch is running."""
        if self.stages > 1 and not self._running:
            raise ValueError(
                f"{what} is not available on a pipeline-parallel engine ({self.stages} stages): run whole "
                "batches with engine.train_batch(data_iter) (and engine.eval_batch(data_iter) to evaluate); "
                "the pipeline schedule runs the forwards, backwards and the step"
            )

    # -- batches --------------------------------------------------------------------------------

    def train_batch(self, data_iter: Iterator[Any] | None) -> torch.Tensor:
        engine = self.engine
        if not torch.is_grad_enabled():
            raise ValueError("train_batch needs gradients enabled; use eval_batch under torch.no_grad()")
        gas = engine.gradient_accumulation_steps
        if engine._boundary is not None or engine.micro_steps % gas:
            raise ValueError(
                "train_batch runs a whole accumulation window, but the engine is inside one (micro-steps taken "
                "with engine.backward/step, or set_gradient_accumulation_boundary set): finish that window first "
                "and reset set_gradient_accumulation_boundary(None)"
            )
        if data_iter is None and self.runner.reads_data:
            data_iter = self._training_data()
        engine.module.train()
        self._running = True
        try:
            return self.runner.train(self, data_iter, gas)
        finally:
            self._running = False

    def eval_batch(self, data_iter: Iterator[Any] | None, return_logits: bool, compute_loss: bool) -> Any:
        engine = self.engine
        engine.module.eval()
        self._running = True
        try:
            micro_batches = engine.gradient_accumulation_steps
            loss, logits = self.runner.evaluate(self, data_iter, micro_batches, compute_loss, return_logits)
        finally:
            self._running = False
        return (loss, logits) if return_logits else loss

    def stats(self) -> dict[str, float]:
        return self.runner.stats.as_dict()

    def _training_data(self) -> Iterator[Any]:
        loader = self.engine.training_dataloader
        if loader is None:
            raise ValueError("train_batch needs data_iter, or training_data given to terascale.initialize")
        if self._train_data is None:
            self._train_data = _forever(loader)
        return self._train_data

    # -- StageDriver ----------------------------------------------------------------------------

    def forward_chunk(self, chunk: int, inputs: Any) -> Any:
        from terascale.engine.engine import _to_device  # engine.py imports this module first

        engine = self.engine
        with engine._observe.phase("forward", inputs):
            inputs = _to_device(inputs, engine.device, engine._input_cast_dtype())
            with engine.activations.forward_context(), engine._resilience.phase("forward"):
                out = engine.module(inputs, chunk=chunk)
        return out

    def backward_chunk(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, sync: bool) -> None:
        self.engine.backward_stage(tensors, grads, sync=sync)

    def finish_window(self, loss: torch.Tensor) -> None:
        engine = self.engine
        gas = engine.gradient_accumulation_steps
        # The window's micro-steps before the last; step() counts the last one and updates.
        engine._window_loss.copy_(loss.detach() * gas)
        engine.micro_steps += gas - 1
        assert engine.is_gradient_accumulation_boundary()
        engine.step()
