"""ZeRO-3 gathers a parameter wherever the model reads it, not only inside its owner's forward.

Each case trains a model whose code reads parameters outside the forward of the module
that owns their group: ``nn.MultiheadAttention`` reading ``out_proj.weight``, a block
called as ``block.forward(x)``, blocks in a ``ModuleList`` inside a ``ModuleList``, a
block reading another module's weight (with and without activation checkpointing), a
weight held by a plain reference and registered with ``register_external_parameter``,
and a mixture of experts marked with ``set_z3_leaf_modules`` whose ranks route to
different experts. The oracle is parity: 2 gloo ranks at ZeRO-3 (every parameter
sharded) against plain PyTorch on the full batch, losses and parameters within fp32
rounding ([Note: fp32 rounding budget] in parity.py).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks

IN, H, C, T = 8, 16, 5, 4  # input features, hidden, classes, tokens
MICRO, WORLD, STEPS = 2, 2, 3
LR, WD = 1e-2, 0.01
EXPERTS = 4


# -- models ----------------------------------------------------------------------------------------


class MHANet(nn.Module):
    """A bare ``nn.MultiheadAttention``; ``nn.Linear`` repeats in the MLP, so the default
    wrap policy picks the class (and, before the fix, ``attn.out_proj`` with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, H)
        self.attn = nn.MultiheadAttention(H, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
        self.head = nn.Linear(H, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h.mean(1)), y)


class EncoderNet(nn.Module):
    """``nn.TransformerEncoder``; the head repeats ``nn.Linear`` in a ``Sequential``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, H)
        layer = nn.TransformerEncoderLayer(H, 2, dim_feedforward=2 * H, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, C))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.encoder(self.inp(x)).mean(1)), y)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.out = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(H), nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ViTNet(nn.Module):
    """The common ViT layout (vit-pytorch's): ``ModuleList([ModuleList([attn, ff])])``,
    whose inner lists repeat but never run a forward of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(IN, H)
        self.layers = nn.ModuleList(nn.ModuleList([Attention(), FeedForward()]) for _ in range(2))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        for attn, ff in self.layers:
            h = attn(h) + h
            h = ff(h) + h
        return F.cross_entropy(self.head(self.norm(h).mean(1)), y)


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(H, H, 1)
        self.norm = nn.LayerNorm(H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + F.gelu(self.conv(x.transpose(1, 2)).transpose(1, 2)))


class ForwardCallNet(nn.Module):
    """Calls its blocks as ``block.forward(h)``, as SqueezeBERT's encoder does: no module
    hook runs for them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, H)
        self.blocks = nn.ModuleList(ConvBlock() for _ in range(3))
        self.head = nn.Linear(H, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block.forward(h)
        return F.cross_entropy(self.head(h.mean(1)), y)


class Query(nn.Module):
    """Returns (a view of) its own parameter: the caller uses it after this forward."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(T, H))

    def forward(self, batch: int) -> torch.Tensor:
        return self.query.expand(batch, -1, -1)


class ReturnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, H)
        self.queries = nn.ModuleList(Query() for _ in range(2))
        self.head = nn.Linear(H, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for query in self.queries:
            h = h + torch.tanh(h * query(x.shape[0]))
        return F.cross_entropy(self.head(h.mean(1)), y)


class Table(nn.Module):
    """A weight other modules read (its own forward is never called here)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H, H) / H**0.5)
        self.bias = nn.Parameter(torch.zeros(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Borrower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, table: Table) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) + F.linear(x, table.weight, table.bias))


class BorrowNet(nn.Module):
    """Blocks that read another wrapped module's parameters, each table shared by two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, H)
        self.blocks = nn.ModuleList(Borrower() for _ in range(4))
        self.tables = nn.ModuleList(Table() for _ in range(2))
        self.head = nn.Linear(H, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = block(h, self.tables[i % 2])
        return F.cross_entropy(self.head(h.mean(1)), y)


class Reader(nn.Module):
    """Holds a plain reference to another module's weight: the read goes around the
    module's parameters, so only ``register_external_parameter`` can tell ZeRO-3."""

    def __init__(self, table: Table) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.borrowed = (table.weight,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) + x @ self.borrowed[0])


class ExplicitNet(nn.Module):
    def __init__(self, register: bool = True) -> None:
        super().__init__()
        from terascale.zero import register_external_parameter

        self.inp = nn.Linear(IN, H)
        self.tables = nn.ModuleList(Table() for _ in range(2))
        self.readers = nn.ModuleList(Reader(t) for t in self.tables)
        self.head = nn.Linear(H, C)
        if register:  # the second one after initialize (see _train_rank)
            register_external_parameter(self.readers[0], self.tables[0].weight)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for reader in self.readers:
            h = reader(h)
        return F.cross_entropy(self.head(h.mean(1)), y)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-1 routing by a given expert index per sample (hash routing), weighted by the
    gate's probability: which experts run depends on the data, so on the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * probs[rows, e : e + 1])
        return out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, H)
        self.moe = nn.ModuleList(MoE() for _ in range(2))
        self.head = nn.Linear(H, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.mean(1))
        for moe in self.moe:
            h = h + moe(h, route)
        return F.cross_entropy(self.head(h), y)


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "moe":
        from terascale.zero import set_z3_leaf_modules

        model = MoENet()
        set_z3_leaf_modules(model, [MoE])
        return model
    if name == "frozen_forward_call":
        model = ForwardCallNet()
        model.blocks[1].requires_grad_(False)
        return model
    models = {"mha": MHANet, "encoder": EncoderNet, "vit": ViTNet, "forward_call": ForwardCallNet,
              "borrow": BorrowNet, "explicit": ExplicitNet, "returned": ReturnNet}  # fmt: skip
    return models[name]()


def data(name: str) -> list[torch.Tensor]:
    """Every step's global batch: inputs, labels (and for the MoE, each sample's expert).
    MoE routing: rank 0's samples go to expert 0, rank 1's to experts 1 and 2; expert 3 is
    never used."""
    g = torch.Generator().manual_seed(1)
    batch = MICRO * WORLD
    x = torch.randn(STEPS, batch, T, IN, generator=g)
    y = torch.randint(0, C, (STEPS, batch), generator=g)
    if name != "moe":
        return [x, y]
    route = torch.tensor([[0, 0, 1, 2], [0, 0, 2, 2], [0, 0, 1, 1]])
    return [x, y, route]


# -- training --------------------------------------------------------------------------------------


def _config(checkpointing: bool, zero: dict | None = None) -> dict:
    cfg = {
        "train_batch_size": MICRO * WORLD,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **(zero or {})},
    }
    if checkpointing:
        cfg["activation_checkpointing"] = {"policy": "blocks"}
    return cfg


def _train_rank(name: str, checkpointing: bool = False, zero: dict | None = None) -> dict:
    import terascale

    rank = int(os.environ["RANK"])
    # Different seeds per rank: the engine broadcasts rank 0's initial weights.
    model = build(name, seed=0 if rank == 0 else 11)
    engine, *_ = terascale.initialize(model=model, config=_config(checkpointing, zero))
    in_blocks: list[int] = []  # bytes gathered as each block starts (after the engine's own hook)
    for block in getattr(model, "blocks", []):
        block.register_forward_pre_hook(lambda *a: in_blocks.append(engine.memory_breakdown()["gathered_params"]))
    if name == "explicit":  # registered on a live engine: takes effect from the next forward
        from terascale.zero import register_external_parameter

        register_external_parameter(model.readers[1], model.tables[1].weight)
    schedule = engine.model_state.schedule
    losses, gathered = [], []
    for s in range(STEPS):
        batch = [t[s, rank * MICRO : (rank + 1) * MICRO] for t in data(name)]
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        gathered.append(engine.memory_breakdown()["gathered_params"])
    groups = engine.model_state.groups
    out = {
        "losses": losses,
        "state": engine.full_state_dict(),
        "trace": list(schedule.trace),
        "gathered_between_steps": gathered,
        "sharded_between_steps": all(fg.persistent or p.numel() == 0 for fg in groups for p in fg.params),
        "plans": [plan.module_name for plan in engine.model_state.plans],
        # A copy of the live model holds plain parameter dicts, not the engine's read hooks.
        "copy_plain": all(type(m._parameters) is dict for m in copy.deepcopy(model).modules()),
        "in_blocks": max(in_blocks, default=0),
        "sizes": {plan.module_name: fg.full_nbytes for plan, fg in zip(engine.model_state.plans, groups)},
        # DeepSpeed's param.is_external_param: read by a module other than its owner
        "external": sorted(n for n, p in model.named_parameters() if p.is_external_param),
    }
    engine.destroy()
    out["restored"] = all(type(m._parameters) is dict for m in model.modules())
    return out


def _reference(name: str, dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on one process with the global batch; a parameter without a gradient
    gets a zero one (ZeRO's semantics for a parameter no rank used)."""
    model = build(name).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for s in range(STEPS):
        batch = [t[s].to(dtype) if t.is_floating_point() else t[s] for t in data(name)]
        loss = model(*batch)
        loss.backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float() for k, v in model.state_dict().items()}


def check(name: str, checkpointing: bool = False, zero: dict | None = None) -> list[dict]:
    """Train ``name`` on 2 ranks at ZeRO-3 (more ``zero_optimization`` keys in ``zero``)
    and compare with :func:`_reference`."""
    results = run_ranks(_train_rank, WORLD, name, checkpointing, zero)
    ref_losses, ref_state = _reference(name, torch.float32)
    _, exact = _reference(name, torch.float64)
    losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["state"].keys() == ref_state.keys()
        for k, want in ref_state.items():
            atol = max(1e-6, 2 * (want.double() - exact[k]).abs().max().item())
            torch.testing.assert_close(r["state"][k], want, rtol=1e-5, atol=atol, msg=lambda m: f"{name} {k}: {m}")
        # Between steps every group is freed again: nothing read outside its owner stays gathered.
        assert r["gathered_between_steps"] == [0] * STEPS and r["sharded_between_steps"], r["gathered_between_steps"]
        assert r["copy_plain"] and r["restored"]
    # Every rank gathered the same groups in the same order (the all-gathers are collectives).
    assert results[0]["trace"] == results[1]["trace"]
    return results


# -- the cases -------------------------------------------------------------------------------------


def test_multihead_attention_reads_out_proj_without_calling_it():
    check("mha")


def test_transformer_encoder_trains_with_linear_repeated_in_the_model():
    check("encoder")


def test_modulelist_inside_modulelist_groups_the_inner_blocks():
    results = check("vit")
    # The inner lists never run a forward: their elements are the blocks.
    assert "layers.0" not in results[0]["plans"] and "layers.0.0" in results[0]["plans"]


@pytest.mark.parametrize("frozen", [False, True])
def test_block_called_through_forward_is_gathered(frozen):
    check("frozen_forward_call" if frozen else "forward_call")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_parameters_read_in_another_modules_forward(checkpointing):
    # Nothing kept or prefetched: each group is gathered exactly while something uses it.
    results = check("borrow", checkpointing, zero={"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0})
    if not checkpointing:  # (a recompute runs the blocks again in backward, which holds more)
        sizes = results[0]["sizes"]
        # A block runs with the root, itself and the one table it reads: the tables are the
        # blocks' externals, gathered and freed with them, not held for the whole forward.
        assert results[0]["in_blocks"] == sizes[""] + sizes["blocks.0"] + sizes["tables.0"], results[0]


def test_module_returning_its_parameter_hands_it_to_the_caller():
    check("returned")


def test_register_external_parameter_before_and_after_initialize():
    results = check("explicit")
    # by group: a table's bias is gathered with its weight, outside its owner too
    assert results[0]["external"] == ["tables.0.bias", "tables.0.weight", "tables.1.bias", "tables.1.weight"]


def test_leaf_module_gathers_all_experts_when_ranks_route_differently():
    results = check("moe")
    plans = results[0]["plans"]
    # One unit per MoE block: nothing inside a leaf module is a group of its own.
    assert "moe.0" in plans and "moe.1" in plans and not any(".experts" in p for p in plans), plans


# -- the APIs without ranks ------------------------------------------------------------------------


def test_external_parameter_api_validates():
    from terascale.zero import register_external_parameter, unregister_external_parameter

    net = BorrowNet()
    register_external_parameter(net.blocks[0], net.tables[0].weight)
    unregister_external_parameter(net.blocks[0], net.tables[0].weight)
    with pytest.raises(ValueError, match="not a registered external parameter"):
        unregister_external_parameter(net.blocks[0], net.tables[0].weight)
    with pytest.raises(RuntimeError):  # DeepSpeed raises RuntimeError: both catch it
        unregister_external_parameter(net.blocks[0], net.tables[0].weight)
    with pytest.raises(ValueError, match="nn.Parameter"):
        register_external_parameter(net.blocks[0], torch.zeros(3))


def test_leaf_module_api():
    from terascale.zero import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
    from terascale.zero.wrap import WrapPolicy, wrapped_modules

    net = MoENet()
    assert set_z3_leaf_modules(net, [MoE]) == list(net.moe)
    assert get_z3_leaf_modules(net) == list(net.moe) and z3_leaf_module(net.moe[0])
    assert set(wrapped_modules(net, WrapPolicy())) == {"", "moe.0", "moe.1"}
    assert set_z3_leaf_modules(net, ["Expert"]) == [e for m in net.moe for e in m.experts]  # by class name
    unset_z3_leaf_modules(net, [MoE, "Expert"])
    assert get_z3_leaf_modules(net) == []
    assert "moe.0.experts.1" in wrapped_modules(net, WrapPolicy())
    with pytest.raises(ValueError, match="No modules"):
        set_z3_leaf_modules(net, [nn.Conv1d])
    assert set_z3_leaf_modules(net, [nn.Conv1d], raise_if_not_found=False) == []


def test_hugging_face_moe_blocks_are_leaves_by_default_as_in_deepspeed():
    from terascale.zero import set_z3_leaf_module
    from terascale.zero.wrap import WrapPolicy, wrapped_modules

    # Stands for transformers' Mixtral block (DeepSpeed's default leaf_module.classes).
    block = type("MixtralSparseMoeBlock", (MoE,), {"__module__": "transformers.models.mixtral.modeling_mixtral"})
    net = MoENet()
    net.moe = nn.ModuleList(block() for _ in range(2))
    assert set(wrapped_modules(net, WrapPolicy())) == {"", "moe.0", "moe.1"}
    assert "moe.0.experts.0" in wrapped_modules(net, WrapPolicy(leaf_classes=()))
    set_z3_leaf_module(net.moe[1], False)  # marked otherwise: no leaf
    assert "moe.1.experts.0" in wrapped_modules(net, WrapPolicy())


def test_funnel_layout_blocks_are_the_inner_lists_elements():
    from terascale.zero.wrap import WrapPolicy, wrapped_modules

    class FunnelLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(H, H)
            self.norm = nn.LayerNorm(H)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.fc(x))

    class Funnel(nn.Module):  # block_sizes=[1, 1]: one layer per inner list
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.ModuleList([FunnelLayer()]) for _ in range(2))

    assert set(wrapped_modules(Funnel(), WrapPolicy())) == {"", "blocks.0.0", "blocks.1.0"}
    # nn.MultiheadAttention reads its out_proj without calling it: never a unit of its own.
    assert "attn.out_proj" not in wrapped_modules(MHANet(), WrapPolicy())


def test_leaf_module_config_section_marks_the_modules():
    # DeepSpeed's zero_optimization.leaf_module: classes, names and name suffixes.
    from terascale.engine.prepare import mark_leaf_modules
    from terascale.zero import get_z3_leaf_modules, unset_z3_leaf_modules

    net = MoENet()
    mark_leaf_modules(net, {"classes": "MoE"})
    assert get_z3_leaf_modules(net) == list(net.moe)
    unset_z3_leaf_modules(net, [MoE])
    mark_leaf_modules(net, {"names": ["moe.1"], "name_suffixes": ["0.experts.2"], "classes": ["NotInThisModel"]})
    assert get_z3_leaf_modules(net) == [net.moe[0].experts[2], net.moe[1]]
    with pytest.raises(ValueError, match="unknown keys \\['class'\\]"):
        mark_leaf_modules(net, {"class": ["MoE"]})
