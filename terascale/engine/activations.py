"""The engine's activation memory: checkpointed blocks, the input store, measurement.

Built once from ``activation_checkpointing``: the blocks the policy names are
checkpointed ([Note: checkpointed blocks]), the module-level ``terascale.checkpointing``
API is pointed at the same checkpointing object unless the user configured it, and with
``memory_breakdown`` or ``profile`` each forward is measured ([Note: activation memory
measured]).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from torch import nn

from terascale import checkpointing as checkpointing_api
from terascale.activation import CheckpointedBlocks, build_checkpointing, select_blocks
from terascale.activation.measure import SavedBytes
from terascale.comm import DistributedContext
from terascale.config import Config
from terascale.zero.tiling import tiles_of
from terascale.zero.wrap import WrapPolicy, wrapped_modules

logger = logging.getLogger("terascale")


class EngineActivations:
    """Activation checkpointing and its reports for one engine's ``module``."""

    def __init__(self, module: nn.Module, config: Config, dist_ctx: DistributedContext, wrap: WrapPolicy) -> None:
        section = config.activation_checkpointing
        self.rank = dist_ctx.rank
        self.checkpointing = build_checkpointing(
            section, dist_ctx.device, checkpointing_api.get_rng_tracker(), aio=config.aio,
            partition_group=dist_ctx.mp_group, rank=dist_ctx.rank,
        )  # fmt: skip
        # Tiles of a TiledLinear are groups, not blocks: checkpointing one would keep its input anyway.
        tiles = {id(t) for t in tiles_of(module)}
        blocks = {name: m for name, m in wrapped_modules(module, wrap).items() if name and id(m) not in tiles}
        chosen = select_blocks(blocks, section.policy, section.every_n)
        if section.policy != "none" and not chosen:
            raise ValueError(
                f"activation_checkpointing.policy '{section.policy}' found no blocks in the model: no module class "
                "repeats in a ModuleList/Sequential; pass wrap_policy=WrapPolicy(module_classes=(YourBlock,)) "
                "to terascale.initialize"
            )
        self.blocks = CheckpointedBlocks(chosen, self.checkpointing, selective=section.policy == "selective")
        self.measure = config.memory_breakdown or section.profile
        self.meter = SavedBytes(module, blocks) if self.measure else None
        self.profile = section.profile
        checkpointing_api.adopt(self.checkpointing)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Around the engine's forward: measures what it saves when asked to."""
        if self.meter is None:
            return contextlib.nullcontext()
        self.checkpointing.reset_stats()
        return self.meter.measuring()

    def before_backward(self) -> None:
        self.checkpointing.before_backward()

    def memory(self) -> dict[str, int]:
        """``activations``: bytes kept for backward after the last measured forward, checkpoint
        inputs on the device included (0 when not measured); ``checkpoint_inputs``: those
        inputs (offloaded: the most held on the device at once while fetched back) and the
        outputs selective checkpointing keeps; ``activation_host_buffers``: host buffers reused for offloaded
        checkpoints."""
        store = self.checkpointing.store
        host = store.nbytes_in_memory()
        # Inputs kept on the device are all of the forward's; offloaded ones, those fetched back at once.
        inputs = store.resident_peak if store.offloads else sum(s.bytes for s in store.stats.values())
        inputs += sum(s.selective_bytes for s in store.stats.values())
        kept = 0 if self.meter is None else self.meter.total + inputs
        return {
            "activations": kept,
            "checkpoint_inputs": inputs,
            "activation_host_buffers": host["host_pool"] + host["arena"],
        }

    def report(self) -> list[dict[str, Any]]:
        """Per block of the last forward/backward: bytes saved for backward (when
        measured), checkpoint inputs, and with ``profile`` forward, recompute, offload and
        fetch-wait times and the recompute's output bytes."""
        rows = {r["block"]: r for r in self.checkpointing.report()}
        if self.meter is not None:
            for name, nbytes in self.meter.by_block.items():
                rows.setdefault(name or "<outside blocks>", {"block": name or "<outside blocks>"})["saved_bytes"] = nbytes
        return list(rows.values())

    def log_profile(self, step: int) -> None:
        if not self.profile or self.rank != 0:
            return
        lines = [f"activation checkpointing, step {step}:"]
        for row in self.report():
            lines.append(
                "  {block}: saved {saved} B, inputs {inputs} B, forward {f:.2f} ms, recompute {r:.2f} ms, "
                "offload {o:.2f} ms, fetch wait {w:.2f} ms, recompute output {rb} B".format(
                    block=row["block"], saved=row.get("saved_bytes", 0), inputs=row.get("input_bytes", 0),
                    f=row.get("forward_ms", 0.0), r=row.get("recompute_ms", 0.0), o=row.get("offload_ms", 0.0),
                    w=row.get("fetch_wait_ms", 0.0), rb=row.get("recompute_bytes", 0),
                )  # fmt: skip
            )
        logger.info("\n".join(lines))

    def close(self) -> None:
        self.blocks.remove()
        if self.meter is not None:
            self.meter.remove()
        checkpointing_api.release(self.checkpointing)
        self.checkpointing.close()
