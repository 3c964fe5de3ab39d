"""Checkpoints: logical, sharded, atomic; loadable on any layout (see [Note: logical checkpoints]).

The engine saves and loads through ``engine.save_checkpoint`` / ``engine.load_checkpoint``
(``terascale.engine.checkpointing``); this package holds the format: spans, the
manifest, streamed safetensors shard files, the reader, the folder protocol and
consolidation into one ordinary state dict.
"""

from terascale.checkpoint.consolidate import consolidated_state_dict, write_consolidated, write_pretrained
from terascale.checkpoint.directory import CheckpointDirectory
from terascale.checkpoint.manifest import CheckpointError, Manifest
from terascale.checkpoint.reader import CheckpointReader

__all__ = [
    "CheckpointDirectory",
    "CheckpointError",
    "CheckpointReader",
    "Manifest",
    "consolidated_state_dict",
    "write_consolidated",
    "write_pretrained",
]


def __getattr__(name: str):  # noqa: ANN202
    # DeepSpeed's deepspeed.checkpoint names (checkpoint key constants), from the stand-in's map
    # ([Note: DeepSpeed's module paths] in terascale/integrations/deepspeed/names.py).
    if name.startswith("__"):
        raise AttributeError(f"module 'terascale.checkpoint' has no attribute {name!r}")
    from terascale.integrations.deepspeed.names import attribute

    return attribute("checkpoint", name)
