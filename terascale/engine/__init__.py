"""The engine layer: ``prepare_model`` and the training ``Engine``.

[Note: the engine's parts]
``terascale.initialize`` (``terascale/entry.py``) prepares the module with
:func:`prepare_model` (tensor-parallel slicing, cast and broadcast, tiling, activation
checkpointing, parallel layout, ZeRO, in that order: ``[Note: the order of model
preparation]``) and hands the :class:`Engine` a :class:`PreparedModel`. The engine then
builds each of its parts from the objects that part uses, never from the engine itself:

- ``model_state`` (prepared, ``model_state.py``): parameters, gradients, fp32 masters and
  their reduction (``[Note: model state]``); ``layout`` (``parallel.py``): who counts which
  gradient under model parallelism;
- the optimizer and LR scheduler (``optimizer.py``) and the loss scaler (``loss_scaler.py``);
- :class:`TrainState` (``train_state.py``): the counters and the accumulation window's
  state machine (``[Note: the accumulation window]``); only its methods change them;
- ``Reporter`` (``monitor.py``): the one writer of metrics, the reporting rank's monitors;
- ``Checkpointer`` (``checkpointing.py``): saves and loads all of the above;
- ``Resilience`` (``resilience.py``): resume, interval and signal saves, the health
  monitors (through the checkpointer); ``Observer`` (``observe.py``): timers, the print
  line, the profilers, traces;
- ``LiveElastic`` (``live.py``, only under the live elastic agent): resizes at step
  boundaries in the running process. The parts above that depend on the world are built
  by ``Engine._assemble``, which a resize calls again after ``resize.py`` rebuilt the model
  state over the new groups ([Note: membership epochs]).

Schedules that drive the phases themselves (``terascale.pipe.PipelineEngine``) are layers
over the engine's public :meth:`Engine.forward`, :meth:`Engine.run_backward` and
:meth:`Engine.end_window`.
"""

from terascale.engine.engine import Engine
from terascale.engine.prepare import PreparedModel, prepare_model
from terascale.engine.train_state import TrainState, WindowState

__all__ = ["Engine", "PreparedModel", "TrainState", "WindowState", "prepare_model"]
