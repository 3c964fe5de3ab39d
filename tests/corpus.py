"""Train on a config of the public-config corpus (tests/configs): the harness of
test_config_corpus.py, importable by the spawned ranks.

Each config runs as it is published, with two changes a user of it would also make on
this machine: ``nvme_path`` points at a scratch directory, and the values an integration
(the Hugging Face Trainer) would give fill its ``"auto"`` entries (fill only: explicit
values are kept as written).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

CONFIGS = Path(__file__).resolve().parent / "configs"
VOCAB, SEQ, HIDDEN = 64, 8, 32


class TinyLM(nn.Module):
    """Embedding, two blocks, a head; its config says its hidden size, as HF models' do."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=HIDDEN)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
            for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def integration_values(world: int) -> dict:
    """What the Hugging Face Trainer gives for "auto" (micro-batch 2, one micro-step a
    window, lr 1e-3, clipping 1.0, fp32, 10 steps with 2 of warm-up), as fill-only values."""
    from terascale.config import Given
    from terascale.integrations.transformers import trainer_given

    args = SimpleNamespace(
        world_size=world, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_grad_norm=1.0,
        learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, fp16=False,
        fp16_full_eval=False, bf16=False, bf16_full_eval=False, get_warmup_steps=lambda n: 2,
    )  # fmt: skip
    return {k: Given(g.value, g.source, match=False) for k, g in trainer_given(args, num_training_steps=10).items()}


def with_scratch_nvme(raw: Any, nvme: str) -> Any:
    """``raw`` with every ``nvme_path`` pointing at ``nvme``."""
    if isinstance(raw, dict):
        return {k: (nvme if k == "nvme_path" and v not in (None, "none") else with_scratch_nvme(v, nvme)) for k, v in raw.items()}
    return raw


def train_corpus_rank(names: list[str], nvme: str) -> dict[str, tuple[str, Any]]:
    """On this rank, for each config: ("trained", losses of two steps) or ("refused", the error)."""
    import os

    import terascale
    from terascale.config import AutoContext, Config
    from terascale.config.source import read_source

    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, tuple[str, Any]] = {}
    for name in names:
        torch.manual_seed(0)
        model = TinyLM()
        try:
            raw, _ = read_source(CONFIGS / name)
            cfg = Config.load(with_scratch_nvme(copy.deepcopy(raw), nvme))
            cfg = cfg.resolve(AutoContext(world_size=world, model=model, given=integration_values(world)))
            # Without an optimizer section the integration brings its own (the Trainer's AdamW).
            client = None if cfg.optimizer else torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine, *_ = terascale.initialize(model=model, optimizer=client, config=cfg)
        except (ValueError, TypeError) as err:  # ConfigError is a ValueError
            out[name] = ("refused", str(err))
            continue
        g = torch.Generator().manual_seed(engine.dist.dp_rank)
        losses = []
        while engine.global_steps < 2:
            ids = torch.randint(0, VOCAB, (engine.micro_batch_size, SEQ), generator=g)
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(math.isfinite(x) for x in losses), (name, losses)
        out[name] = ("trained", (losses, engine.global_steps, engine.config.compute_dtype))
        engine.destroy()
    return out
