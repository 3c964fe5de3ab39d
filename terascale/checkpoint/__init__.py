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
