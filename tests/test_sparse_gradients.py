"""``sparse_gradients: true``: sparse embeddings reduced as rows train exactly like dense ones.

Two ranks (gloo) train a model with two sparse embeddings (``nn.Embedding`` and a
mean-mode ``nn.EmbeddingBag``) around dense layers at ZeRO stages 0-3, accumulating two
micro-steps, and must match, in losses and final parameters, both the same run with
dense embeddings and plain single-process PyTorch on the global batch. The tables have
37 rows of 6, and rows 30-36 are never looked up; where a table is a group of its own
(the ``wrap`` cases) each rank's shard ends in the middle of row 18.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from terascale.comm.sparse import CommStats, add_rows_to_range, sparse_gradient_params

ROWS, DIM, BAG, CLASSES = 37, 6, 3, 5
STEPS, MICRO, GAS, WORLD = 3, 4, 2, 2
LR = 1e-2


class SparseModel(nn.Module):
    """Embedding (sparse or not) -> Linear -> + bag of other rows -> head."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=sparse)
        self.proj = nn.Linear(DIM, DIM)  # a dense slot between the two sparse ones
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="mean", sparse=sparse)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor, bags: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.emb(ids))) + self.bag(bags)
        return F.cross_entropy(self.head(h), y)


def make_model(sparse: bool, seed: int = 0, dtype: torch.dtype = torch.float32) -> SparseModel:
    torch.manual_seed(seed)
    return SparseModel(sparse).to(dtype)


def make_data(global_batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # Ids from the first 30 rows only, with repeats: rows 30-36 are never looked up.
    ids = torch.randint(0, 30, (STEPS, global_batch), generator=g)
    bags = torch.randint(0, 30, (STEPS, global_batch, BAG), generator=g)
    y = torch.randint(0, CLASSES, (STEPS, global_batch), generator=g)
    return ids, bags, y


def optimizer_config(name: str) -> dict:
    if name == "sgd":
        return {"type": "SGD", "params": {"lr": LR * 10, "momentum": 0.9}}
    return {"type": "Adam", "params": {"lr": LR}}


def reference_train(opt_name: str, dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, one process, the global batch per step, dense embeddings.

    Stages 1-3 give every trainable parameter a gradient (zero if unused, ZeRO's rule);
    here every parameter is used on every step, so the rule does not matter."""
    model = make_model(sparse=False, dtype=dtype)
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    ids, bags, y = make_data(MICRO * GAS * WORLD)
    losses = []
    for s in range(STEPS):
        loss = model(ids[s], bags[s], y[s])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


CASES = [
    # (stage, sparse embeddings, optimizer, extra config, wrap the embeddings in their own groups)
    *((stage, sparse, "adam", {}, False) for stage in (0, 1, 2, 3) for sparse in (True, False)),
    (0, True, "sgd", {}, False),
    (2, True, "sgd", {}, False),
    # Averaging done before/after the exchange, and a group holding only a sparse table.
    (0, True, "adam", {"gradient_predivide_factor": 2.0}, False),
    (2, True, "adam", {"prescale_gradients": True}, False),
    (3, True, "adam", {"gradient_predivide_factor": 2.0}, True),
    (1, True, "adam", {"zero_optimization": {"reduce_scatter": False}}, True),
]


def train_rank(cases: list[tuple]) -> list:
    import os

    import terascale
    from terascale.zero import WrapPolicy

    rank = int(os.environ["RANK"])
    out = []
    for stage, sparse, opt_name, extra, wrap in cases:
        model = make_model(sparse, seed=0 if rank == 0 else 7)  # rank 0's weights are broadcast
        zero = {"stage": stage, "reduce_bucket_size": 50, "stage3_param_persistence_threshold": 0}
        zero.update(extra.get("zero_optimization", {}))
        config = {
            "train_batch_size": MICRO * GAS * WORLD,
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS,
            "steps_per_print": 1000,
            "optimizer": optimizer_config(opt_name),
            "sparse_gradients": True,
            **{k: v for k, v in extra.items() if k != "zero_optimization"},
            "zero_optimization": zero,
        }
        policy = WrapPolicy(module_classes=(nn.Embedding, nn.EmbeddingBag)) if wrap else None
        engine, _, _, _ = terascale.initialize(model=model, config=config, wrap_policy=policy)
        ids, bags, y = make_data(MICRO * GAS * WORLD)
        losses = []
        for s in range(STEPS):
            for m in range(GAS):
                lo = (m * WORLD + rank) * MICRO
                loss = engine(ids[s, lo : lo + MICRO], bags[s, lo : lo + MICRO], y[s, lo : lo + MICRO])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        state = engine.model_state
        stats: CommStats = state.comm_stats if stage == 0 else state.grads.comm
        out.append((losses, engine.full_state_dict(), stats.sparse_bytes, stats.dense_bytes))
        engine.destroy()
    return out


def test_sparse_gradients_match_dense_and_plain_pytorch():
    results = run_ranks(train_rank, WORLD, CASES, timeout=300)
    refs = {
        name: (reference_train(name, torch.float32), reference_train(name, torch.float64)) for name in ("adam", "sgd")
    }
    sent = {}  # (stage, sparse) -> bytes rank 0 sent reducing gradients, Adam, default knobs
    for k, (stage, sparse, opt_name, extra, wrap) in enumerate(CASES):
        name = f"stage={stage} sparse={sparse} {opt_name} {extra} wrap={wrap}"
        (ref_losses, ref_state), (_, exact) = refs[opt_name]
        per_rank = [torch.tensor(r[k][0]).view(STEPS, GAS) for r in results]
        losses = torch.stack(per_rank).mean(dim=(0, 2))
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=name)
        for r in results:
            state = r[k][1]
            assert state.keys() == ref_state.keys()
            for key, ref in ref_state.items():
                # Adam turns rounding noise of near-cancelling gradients into visible
                # differences; allow twice the reference's own fp32 error (see parity.py).
                atol = max(1e-6, 2 * (ref.double() - exact[key]).abs().max().item())
                torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=atol, msg=f"{name}: {key}")
        sparse_bytes, dense_bytes = results[0][k][2], results[0][k][3]
        assert (sparse_bytes > 0) == sparse, name  # sparse tables went as rows, dense ones not
        if opt_name == "adam" and not extra and not wrap:
            sent[(stage, sparse)] = sparse_bytes + dense_bytes
    # The same model with dense embeddings: the same parameters, within fp32 rounding.
    for stage in (0, 1, 2, 3):
        sparse_state = results[0][CASES.index((stage, True, "adam", {}, False))][1]
        dense_state = results[0][CASES.index((stage, False, "adam", {}, False))][1]
        for key, v in dense_state.items():
            torch.testing.assert_close(sparse_state[key], v, rtol=1e-5, atol=2e-6, msg=f"stage {stage}: {key}")
        # At most 30 of 37 rows per table are looked up: fewer bytes than the whole tables.
        assert sent[(stage, True)] < sent[(stage, False)], (stage, sent)


# ---- single-process pieces ---------------------------------------------------------------


@pytest.mark.parametrize("start,length", [(0, 37 * 6), (13, 100), (12, 6), (5, 3), (0, 1), (200, 22), (7, 0)])
def test_add_rows_to_range_matches_dense_window(start, length):
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, ROWS, (50,), generator=g)
    values = torch.randn(50, DIM, generator=g, dtype=torch.float64)
    dense = torch.zeros(ROWS, DIM, dtype=torch.float64).index_add_(0, indices, values).reshape(-1)
    out = torch.full((length,), 0.5, dtype=torch.float64)
    add_rows_to_range(out, start, indices, values)
    torch.testing.assert_close(out, dense[start : start + length] + 0.5)


def test_sparse_gradient_params_picks_untied_sparse_tables():
    model = make_model(sparse=True)
    assert sparse_gradient_params(model) == {"emb.weight", "bag.weight"}
    assert sparse_gradient_params(make_model(sparse=False)) == frozenset()
    model.emb.weight.requires_grad_(False)  # frozen: no gradient to reduce
    assert sparse_gradient_params(model) == {"bag.weight"}
    tied = make_model(sparse=True)
    tied.out = nn.Linear(DIM, ROWS, bias=False)
    tied.out.weight = tied.bag.weight  # tied to a dense use: its gradient is dense
    assert sparse_gradient_params(tied) == {"emb.weight"}


def _sparse_without_switch(stage: int) -> str:
    import terascale

    model = make_model(sparse=True)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = terascale.initialize(model=model, config=config)
    ids, bags, y = make_data(MICRO)
    try:
        loss = engine(ids[0], bags[0], y[0])
        engine.backward(loss)
        engine.step()
    except ValueError as e:
        return str(e)
    finally:
        engine.destroy()
    return "trained"


def test_sparse_gradient_without_the_switch():
    # Stage 0 adds the rows into the dense gradient; stages 1-3 name the config key.
    assert run_ranks(_sparse_without_switch, 1, 0) == ["trained"]
    (message,) = run_ranks(_sparse_without_switch, 1, 2)
    assert "sparse_gradients" in message and "produced a sparse gradient" in message
