"""Observability sections: ``flops_profiler`` and ``comms_logger`` (DeepSpeed's keys) and
``profiler`` (terascale's torch.profiler trace window).

```json
"flops_profiler": {"enabled": true, "profile_step": 3, "module_depth": -1, "top_modules": 3,
                   "detailed": true, "output_file": null},
"comms_logger":   {"enabled": true, "verbose": false, "prof_all": true, "prof_ops": [], "debug": false},
"profiler":       {"enabled": true, "start_step": 5, "num_steps": 2, "output_dir": "traces"}
```

* ``flops_profiler``: at optimizer step ``profile_step``, per module: parameters, FLOPs and
  MACs (forward, and backward as measured), latency and achieved FLOP/s, printed as a tree
  to ``module_depth`` with the ``top_modules`` heaviest modules per depth
  (``terascale.profiling.flops``).
* ``comms_logger``: per collective and message size: count, bytes, latency, algorithmic and
  bus bandwidth of terascale's collectives; ``prof_all`` records every operation, else only
  those named in ``prof_ops``; ``verbose`` logs each one as it completes; ``debug`` adds the
  calling function to each record's name (``terascale.profiling.comms``).
* ``profiler``: a torch.profiler window of ``num_steps`` optimizer steps from ``start_step``
  writing one Chrome/Perfetto trace per rank into ``output_dir``, with terascale's phases as
  named ranges (``terascale.profiling.trace``).
"""

from __future__ import annotations

from pydantic import Field

from terascale.config.section import Section


class FlopsProfilerConfig(Section):
    """``flops_profiler``: per-module FLOPs/latency report at one step."""

    enabled: bool = False
    # DeepSpeed estimates activation recompute with this factor; terascale counts the
    # recompute as it runs, so the key is accepted for existing configs and changes nothing.
    recompute_fwd_factor: float = Field(0.0, ge=0.0)
    profile_step: int = 1  # DeepSpeed does not bound it (Megatron-DeepSpeed writes -1)
    module_depth: int = -1
    top_modules: int = Field(1, ge=1)
    detailed: bool = True
    output_file: str | None = None


class CommsLoggerConfig(Section):
    """``comms_logger``: statistics of every collective terascale issues."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False


class TraceConfig(Section):
    """``profiler``: a torch.profiler trace window over whole optimizer steps."""

    enabled: bool = False
    start_step: int = Field(1, ge=1)
    num_steps: int = Field(1, ge=1)
    output_dir: str = "traces"
