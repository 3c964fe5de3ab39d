"""What the fork server of ``run_ranks`` imports once, so that every rank starts warm.

See [Note: forked ranks] in ``distributed.py``. Measured before this list existed: a
rank of a small ZeRO test spent 2.5 of its 2.7 s importing, mostly ``torch._dynamo``
(1.8 s: the first ``torch.optim.Optimizer`` imports it) and the parts of terascale the
engine uses (0.7 s); a Hugging Face test's ranks imported transformers on top (about 2 s
for its modelling core and a model family), now imported here too (see the rules below).

The server imports the modules by name (a name that does not import is passed over: an
optional library the machine lacks), so every name here is an installed module's: the
server's ``sys.path`` is not the test process's (Python 3.11's fork server ignores the
path it is handed), and a module of ``tests/`` would silently not be found there.

Two rules for what may be here, each checked by ``test_harness.py``:

- Importing it starts no thread. A process may fork safely only while it runs one thread of
  its own (a lock held by another thread at the fork stays held forever in the child). So
  pyarrow, which starts jemalloc's background thread and comes with ``datasets`` through
  the Hugging Face Trainer (and with the two terascale modules that import the Trainer or
  Lightning when imported: :data:`LEFT_TO_THE_RANKS`), is left to the ranks that use it.
- What it adds to a rank's resident set may not change a test's outcome. The tests that
  read a rank's memory take its growth from a sample at the rank's start (the offload
  budgets, the ZeRO formulas, the planner under a cap of "what it holds now + room"); the
  one that holds a prediction to a rank's absolute peak, the planner's, starts fresh
  interpreters (``run_ranks(fresh=True)``), as torchrun does. So the Hugging Face libraries
  the suite's ranks build models with (transformers' modelling core, the model families the
  tests use, accelerate, peft: about 2 s of every such rank's start, 0.2 GB shared with the
  server) are imported here, while Lightning, which no rank of a memory test uses and which
  brings the Trainer's pyarrow with it, is not.
"""

from __future__ import annotations

from pathlib import Path

import terascale

# Beyond terascale's own modules, which are imported whole (see preload_names).
THIRD_PARTY = (
    "torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
    # The Hugging Face modelling the suite's ranks use (its Trainer brings pyarrow: see above).
    "transformers", "transformers.modeling_utils", "accelerate", "peft",
    *(f"transformers.models.{family}.modeling_{family}" for family in ("llama", "gpt2", "bert", "mistral", "mixtral", "qwen2")),
)  # fmt: skip
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
