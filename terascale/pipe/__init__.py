"""Pipeline parallelism: ``PipelineModule``, stage partitioning, 1F1B and interleaved schedules.

``module`` splits a sequence of layers into stages (built only where they run), ``schedule``
orders each stage's forwards, backwards and transfers, ``simulate`` checks schedules on paper,
``p2p`` moves activations and gradients between stages, ``runner`` executes a schedule
through a small driver protocol, and ``engine`` is the ``PipelineEngine`` that ``initialize``
returns for a ``PipelineModule``: a layer over the training engine's public phases.

[Note: why not torch.distributed.pipelining]
torch's ``PipelineStage`` + ``Schedule1F1B``/``ScheduleInterleaved1F1B`` run each backward
themselves (``stage_backward`` calls ``torch.autograd.backward`` directly) and know only
DDP's and FSDP's ways of deferring gradient reduction. terascale's engine must bracket
every backward: the model state's ``prepare_backward(sync)``/``post_backward`` (ZeRO-1 and
stage 0 reduce on the last micro-batch of the window, ZeRO-2/3 reduce-scatter after every
backward the groups it touched, ZeRO-3 gathers and frees around every chunk and records
its prefetch trace), fp16 loss scaling of the last stage's loss, its accumulation counter
and a single step at the end; there is no hook for that without overriding the stages'
private methods, whose signatures changed between torch 2.4 and now. torch's stages also
pass only tensors between stages, infer shapes with an extra forward round, and its
schedules would own the loss function and the micro-batch split. So the schedules here are
small pure functions and the runner calls the engine for every compute; what torch does
provide and fits is used directly: ``dist.P2POp``/``batch_isend_irecv`` for the transfers
(gloo and NCCL alike). See ``[Note: pipeline schedules]``, ``[Note: pipeline runner]``,
``[Note: shape negotiation]`` and ``[Note: partitioned boundaries]``.
"""

from terascale.pipe.engine import PipelineEngine
from terascale.pipe.layers import LayerSpec, TiedLayerSpec
from terascale.pipe.module import PipelineModule
from terascale.pipe.partition import partition_balanced, partition_uniform
from terascale.pipe.schedule import Instr, Op, StageGrid, forward_only, interleaved_one_f_one_b, one_f_one_b

__all__ = [
    "Instr",
    "LayerSpec",
    "Op",
    "PipelineEngine",
    "PipelineModule",
    "StageGrid",
    "TiedLayerSpec",
    "forward_only",
    "interleaved_one_f_one_b",
    "one_f_one_b",
    "partition_balanced",
    "partition_uniform",
]
