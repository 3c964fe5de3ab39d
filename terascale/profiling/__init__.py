"""Profiling: per-module FLOPs, MACs, parameters and latency (``flops``), statistics of
terascale's collectives (``comms``), torch.profiler trace windows (``trace``), throughput
and utilisation (``throughput``) and the HTML run report (``report``, imported on use: it
needs matplotlib).

See ``terascale.config.profiling`` for the config sections that turn these on in the
engine, and ``terascale.engine.observe`` for how the engine uses them.
"""

from terascale.profiling.comms import CommsLogger
from terascale.profiling.flops import FlopsProfiler, ModuleProfile, get_model_profile
from terascale.profiling.trace import TraceWindow

__all__ = [
    "CommsLogger",
    "FlopsProfiler",
    "ModuleProfile",
    "TraceWindow",
    "get_model_profile",
]
