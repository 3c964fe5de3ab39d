"""What the fork server of ``run_ranks`` imports once, so that every rank starts warm.

See [Note: forked ranks] in ``distributed.py``. Measured before this list existed: a
rank of a small ZeRO test spent 2.5 of its 2.7 s importing, mostly ``torch._dynamo``
(1.8 s: the first ``torch.optim.Optimizer`` imports it) and the parts of terascale the
engine uses (0.7 s); a Hugging Face test's ranks import transformers on top (3 s), which is theirs to pay
(see the rules below).

The server imports the modules by name (a name that does not import is passed over: an
optional library the machine lacks), so every name here is an installed module's: the
server's ``sys.path`` is not the test process's (Python 3.11's fork server ignores the
path it is handed), and a module of ``tests/`` would silently not be found there.

Two rules for what may be here, each checked by ``test_harness.py``:

- Importing it starts no thread. A process may fork safely only while it runs one thread of
  its own (a lock held by another thread at the fork stays held forever in the child). So
  pyarrow, which starts jemalloc's background thread and comes with ``datasets`` through
  the Hugging Face Trainer, is left to the ranks that use it.
- A rank holds no more than a plain terascale rank: what ``initialize`` imports anyway
  (torch, ``torch._dynamo``, terascale). Tests measure ranks' resident memory (the planner's
  predicted peak under a cap, the ZeRO formulas, offload budgets), and a resident set grown
  by libraries the rank never used made the planner refuse a capped config that fits a real
  rank. So transformers, accelerate, peft and Lightning (and the two terascale modules that
  import them when imported: :data:`LEFT_TO_THE_RANKS`) are imported by the ranks that use
  them, at about 3 s each.
"""

from __future__ import annotations

from pathlib import Path

import terascale

# Beyond terascale's own modules, which are imported whole (see preload_names).
THIRD_PARTY = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor")
# terascale modules a rank imports itself (see above): the Hugging Face Trainer's brings
# pyarrow's thread, Lightning's brings Lightning and transformers.
LEFT_TO_THE_RANKS = ("terascale.integrations.transformers", "terascale.integrations.lightning")


def terascale_modules() -> list[str]:
    """Every module of the terascale package, by its files (nothing is imported to list them)."""
    root = Path(terascale.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "__main__.py":  # a program, not a module to import
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def preload_names() -> list[str]:
    """The fork server's imports, in order."""
    own = [name for name in terascale_modules() if not name.startswith(LEFT_TO_THE_RANKS)]
    return [*THIRD_PARTY, *own]
