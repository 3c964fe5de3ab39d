"""The memory planner: fit a model to the machine before step 1.

``"auto"`` for the ZeRO stage, the offload tiers, the micro-batch and the checkpointing
policy is chosen at ``terascale.initialize`` from the model (``profile``: parameters,
groups, measured activations), the machine (``machine``: memory per rank on each tier,
the disk and its speed) and the global batch: every plan (``candidates``) gets a
predicted peak memory per rank by category and tier (``memory``) and a step-time shape
(``timing``); ``choose`` takes the fastest that fits with a margin, preferring less
offload, and refuses what cannot fit; ``table`` prints them (``terascale plan``);
``apply`` is the entry point for ``initialize`` and for a plan made anywhere;
``models`` builds the models ``terascale plan --model`` names.
"""

from terascale.plan.apply import PlanResult, plan, plan_for_initialize
from terascale.plan.candidates import PLANNED, Candidate
from terascale.plan.machine import Machine, measure_machine
from terascale.plan.memory import Part
from terascale.plan.profile import ModelProfile, profile_model

__all__ = [
    "PLANNED",
    "Candidate",
    "Machine",
    "ModelProfile",
    "Part",
    "PlanResult",
    "measure_machine",
    "plan",
    "plan_for_initialize",
    "profile_model",
]
