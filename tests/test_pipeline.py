"""Pipeline parallelism: schedules and partitions on paper, then real ranks against plain PyTorch.

The parity oracle is a single process running the same layers in order (built under the
same per-layer seeds, dropout drawn under the same per-layer seeds as ``seed_layers``
gives), on every micro-batch of every data-parallel replica, with ``torch.optim.AdamW``
and ``clip_grad_norm_``. Each step's loss and every parameter must match.
"""

from __future__ import annotations

import copy

import dataclasses
import functools
import logging
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from terascale.pipe import LayerSpec, TiedLayerSpec
from terascale.pipe.layers import count_parameters
from terascale.pipe.partition import partition_balanced, partition_layers, partition_uniform
from terascale.pipe.schedule import Instr, Op, StageGrid, forward_only, interleaved_one_f_one_b, one_f_one_b
from terascale.pipe.simulate import check_transfers, simulate

# -- schedules ------------------------------------------------------------------------------------

SHAPES = [(p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8) for v in (1, 2, 3) if v == 1 or (p > 1 and m % p == 0)]


def _all(p: int, m: int, v: int, train: bool = True) -> list[list[Instr]]:
    if train:
        return [interleaved_one_f_one_b(p, s, m, v) for s in range(p)]
    return [forward_only(p, s, m, v) for s in range(p)]


@pytest.mark.parametrize("p,m,v", SHAPES)
def test_schedule_runs_every_micro_batch_once_forward_before_backward(p: int, m: int, v: int) -> None:
    grid = StageGrid(p, v)
    schedules = _all(p, m, v)
    for s, schedule in enumerate(schedules):
        computes = [i for i in schedule if i.is_compute]
        forwards = [(i.mb, i.chunk) for i in computes if i.op is Op.FORWARD]
        backwards = [(i.mb, i.chunk) for i in computes if i.op is Op.BACKWARD]
        units = sorted((k, c) for k in range(m) for c in range(v))
        assert sorted(forwards) == units and sorted(backwards) == units
        for k, c in units:
            f = computes.index(Instr(Op.FORWARD, k, c))
            b = computes.index(Instr(Op.BACKWARD, k, c))
            assert f < b, f"stage {s}: backward of {k}.{c} before its forward"
            # Each transfer sits before the compute that needs it / after the one that made it.
            if not grid.is_first(s, c):
                assert schedule.index(Instr(Op.RECV_ACT, k, c)) < schedule.index(Instr(Op.FORWARD, k, c))
                assert schedule.index(Instr(Op.SEND_GRAD, k, c)) > schedule.index(Instr(Op.BACKWARD, k, c))
            if not grid.is_last(s, c):
                assert schedule.index(Instr(Op.SEND_ACT, k, c)) > schedule.index(Instr(Op.FORWARD, k, c))
                assert schedule.index(Instr(Op.RECV_GRAD, k, c)) < schedule.index(Instr(Op.BACKWARD, k, c))
        for c in range(v):  # a chunk sees its micro-batches in order (seed_layers' draws rely on it)
            assert [k for k, cc in forwards if cc == c] == list(range(m))
    check_transfers(grid, schedules)  # sends match receives, pair by pair, in order
    simulate(grid, schedules)  # and nothing deadlocks under rendezvous semantics
    inference = _all(p, m, v, train=False)
    assert all(i.op is not Op.BACKWARD for s in inference for i in s)
    simulate(grid, inference)


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4) for m in (1, 2, 4, 7)])
def test_one_f_one_b_warms_up_and_bounds_live_micro_batches(p: int, m: int) -> None:
    for s in range(p):
        computes = [i for i in one_f_one_b(p, s, m) if i.is_compute]
        first_backward = next(n for n, i in enumerate(computes) if i.op is Op.BACKWARD)
        # warm-up forwards, then the first steady forward, then the first backward
        # min(p - s - 1, m) warm-up forwards, then (if any is left) one steady-state forward
        assert first_backward == min(p - s, m)
        live = peak = 0
        for i in computes:
            live += 1 if i.op is Op.FORWARD else -1
            peak = max(peak, live)
        assert peak == min(p - s, m)


@pytest.mark.parametrize("p,m,v", [s for s in SHAPES if s[0] > 1])
def test_bubbles_match_the_1f1b_and_interleaved_formulas(p: int, m: int, v: int) -> None:
    grid = StageGrid(p, v)
    ideal = (p - 1) / (v * m + p - 1)
    for tf, tb in ((1.0, 1.0), (1.0, 2.0)):  # per whole stage; a chunk takes 1/v of it
        timeline = simulate(grid, _all(p, m, v), tf / v, tb / v)
        assert timeline.makespan == pytest.approx((m + (p - 1) / v) * (tf + tb))
        for s in range(p):
            assert timeline.bubble(s) == pytest.approx(ideal)


def test_schedule_errors_and_what_the_checks_catch() -> None:
    with pytest.raises(ValueError, match="must be a multiple of 2"):
        interleaved_one_f_one_b(2, 0, 3, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        one_f_one_b(2, 0, 0)
    grid = StageGrid(2)
    simulate(grid, [one_f_one_b(2, 0, 1), one_f_one_b(2, 1, 1)])
    # Stage 0 waits for a gradient before sending the activation it comes from.
    deadlock = [
        [Instr(Op.RECV_GRAD, 0), Instr(Op.FORWARD, 0), Instr(Op.SEND_ACT, 0), Instr(Op.BACKWARD, 0)],
        [Instr(Op.RECV_ACT, 0), Instr(Op.FORWARD, 0), Instr(Op.BACKWARD, 0), Instr(Op.SEND_GRAD, 0)],
    ]
    check_transfers(grid, deadlock)  # the messages match ...
    with pytest.raises(RuntimeError, match="deadlock: stage 0 at \\[recv_grad0.0\\]"):
        simulate(grid, deadlock)  # ... but never move
    swapped = [one_f_one_b(2, 0, 2), one_f_one_b(2, 1, 2)]
    a, b = swapped[1].index(Instr(Op.RECV_ACT, 0)), swapped[1].index(Instr(Op.RECV_ACT, 1))
    swapped[1][a], swapped[1][b] = swapped[1][b], swapped[1][a]
    with pytest.raises(ValueError, match="sends"):
        check_transfers(grid, swapped)


# -- partitioning ---------------------------------------------------------------------------------

BUILT: list[str] = []  # constructions on a real device (meta-device counting excluded)


class Counted(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        if self.fc.weight.device.type != "meta":
            BUILT.append(f"{n_in}x{n_out}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Block(nn.Module):
    """A residual block with dropout (``p`` 0: none)."""

    def __init__(self, h: int, p: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(h, h)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


def test_partition_methods() -> None:
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]
    assert partition_balanced([1, 1, 1, 1, 4], 2) == [0, 4, 5]
    assert partition_balanced([5, 0, 5, 0], 2) == [0, 2, 4]  # equal splits: earlier parts take the light layer
    assert partition_balanced([3, 1, 1, 1, 3, 1], 3) == [0, 2, 4, 6]  # largest part 4, then two layers each
    layers = [LayerSpec(Counted, 2, 2), LayerSpec(nn.ReLU), LayerSpec(Counted, 2, 30), LayerSpec(Counted, 30, 2), nn.Tanh()]
    BUILT.clear()
    # 6, 0, 90, 62, 0 parameters: balanced without building anything for real.
    assert [count_parameters(layer) for layer in layers] == [6, 0, 90, 62, 0]
    assert partition_layers(layers, 2, "parameters") == [0, 3, 5]
    assert BUILT == []
    assert partition_layers(layers, 2, "uniform") == [0, 3, 5]
    assert partition_layers(layers, 3, "type:counted") == [0, 2, 3, 5]  # case-insensitive search
    assert partition_layers(layers, 2, "type:ReLU|Tanh") == [0, 3, 5]  # one match each, layer counts balanced
    with pytest.raises(ValueError, match="matches no layer; the layer classes are"):
        partition_layers(layers, 2, "type:Transformer")
    with pytest.raises(ValueError, match="unknown partition_method 'best'"):
        partition_layers(layers, 2, "best")


# -- models for the multi-rank tests ----------------------------------------------------------------

IN, H, C, V, T, MICRO, LR, WD, SEED = 6, 8, 5, 11, 3, 2, 1e-2, 0.01, 1234


class MaskIn(nn.Module):
    """(x, mask) -> (hidden, int mask, a constant): tuples with integer tensors and non-tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, H)

    def forward(self, inputs: tuple) -> tuple:
        x, mask = inputs
        return self.fc(x) * mask[:, None].to(x.dtype), mask, 2


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, inputs: tuple) -> tuple:
        h, mask, k = inputs
        return h + torch.tanh(self.fc(h)) * mask[:, None].to(h.dtype) * (k / 2), mask, k


class MaskOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, C)

    def forward(self, inputs: tuple) -> torch.Tensor:
        return self.fc(inputs[0])


class ReluLinear(nn.Sequential):
    """An in-place ReLU inside a Sequential, then a linear layer."""

    def __init__(self) -> None:
        super().__init__(nn.ReLU(inplace=True), nn.Linear(H, H))


class AddBias(nn.Module):
    """Adds its bias to its input in place: an in-place first op of a layer with parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.bias)


def head(embedding: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def make_layers(kind: str) -> list:
    if kind in ("mlp", "dropout"):
        p = 0.3 if kind == "dropout" else 0.0
        return [LayerSpec(nn.Linear, IN, H), LayerSpec(nn.GELU), *(LayerSpec(Block, H, p) for _ in range(3)),
                LayerSpec(nn.LayerNorm, H), LayerSpec(nn.Linear, H, C)]  # fmt: skip
    if kind == "gated":  # whether a Gate takes part depends on the data
        return [LayerSpec(nn.Linear, IN, H), LayerSpec(Gate), LayerSpec(Block, H), LayerSpec(Gate),
                LayerSpec(nn.LayerNorm, H), LayerSpec(nn.Linear, H, C)]  # fmt: skip
    if kind == "tied":  # the embedding is the output head too
        return [TiedLayerSpec("embed", nn.Embedding, V, H), LayerSpec(Block, H), LayerSpec(Block, H),
                LayerSpec(nn.LayerNorm, H), TiedLayerSpec("embed", nn.Embedding, V, H, forward_fn=head)]  # fmt: skip
    if kind == "inplace":  # uniform: stage 1 starts with ReLU(inplace=True) (AlexNet's stage 1 in
        # DeepSpeed's pipeline example); with 2 virtual stages every later chunk starts in place
        return [LayerSpec(nn.Linear, IN, H), LayerSpec(Block, H), LayerSpec(ReluLinear), LayerSpec(Block, H),
                LayerSpec(nn.ReLU, inplace=True), LayerSpec(Block, H), LayerSpec(AddBias), LayerSpec(nn.Linear, H, C)]  # fmt: skip
    assert kind == "tuple"
    return [LayerSpec(MaskIn), LayerSpec(MaskedBlock), LayerSpec(MaskedBlock), LayerSpec(MaskOut)]


def loss_of(kind: str):
    return token_loss if kind == "tied" else F.cross_entropy


def make_batch(kind: str, rows: int, g: torch.Generator) -> tuple:
    """(inputs, labels) of ``rows`` samples."""
    if kind == "tied":
        return torch.randint(0, V, (rows, T), generator=g), torch.randint(0, V, (rows, T), generator=g)
    x, y = torch.randn(rows, IN, generator=g), torch.randint(0, C, (rows,), generator=g)
    if kind == "tuple":
        return (x, (torch.arange(rows) % 3 != 0).long()), y
    return x, y


def rows(batch: tuple, lo: int, hi: int) -> tuple:
    inputs, labels = batch
    inputs = tuple(t[lo:hi] for t in inputs) if isinstance(inputs, tuple) else inputs[lo:hi]
    return inputs, labels[lo:hi]


@dataclass(frozen=True)
class Case:
    kind: str = "mlp"
    stage: int = 0
    gas: int = 4
    clip: float = 0.0
    virtual: int = 1
    ckpt: int = 0
    partition: str = "uniform"
    steps: int = 3
    eval_rows: int = 3  # eval micro-batches differ in shape from training's: shapes renegotiated

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def data(case: Case, dp: int) -> tuple[list[list[list[tuple]]], list[list[tuple]]]:
    """Per step, per micro-batch, per replica: (inputs, labels); and the eval batch (per micro, per replica)."""
    g = torch.Generator().manual_seed(7)
    train = []
    for _ in range(case.steps):
        batch = make_batch(case.kind, case.gas * dp * MICRO, g)
        train.append([[rows(batch, (k * dp + r) * MICRO, (k * dp + r + 1) * MICRO) for r in range(dp)]
                      for k in range(case.gas)])  # fmt: skip
    batch = make_batch(case.kind, case.gas * dp * case.eval_rows, g)
    n = case.eval_rows
    evaluation = [[rows(batch, (k * dp + r) * n, (k * dp + r + 1) * n) for r in range(dp)] for k in range(case.gas)]
    return train, evaluation


def config(case: Case, dp: int) -> dict:
    return {
        "train_batch_size": MICRO * case.gas * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": case.clip,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": case.stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
    }


EVAL_AFTER = 1  # evaluation runs after this many steps, training continues after it


def train_rank(pp: int, cases: list[Case]) -> list[dict]:
    """Train every case as a pipeline of ``pp`` stages over the world; return what to compare."""
    import terascale
    from terascale.parallel import Topology
    from terascale.pipe import PipelineModule
    from terascale.zero import WrapPolicy

    out = []
    for case in cases:
        topo = Topology(pp=pp)
        dp, dp_rank, stage = topo.size("dp"), topo.rank("dp"), topo.rank("pp")
        # Different global seeds per rank: initial values come from seed_layers and the tie broadcast.
        torch.manual_seed(100 + torch.distributed.get_rank())
        model = PipelineModule(make_layers(case.kind), topology=topo, loss_fn=loss_of(case.kind), seed_layers=True,
                               base_seed=SEED, partition_method=case.partition,
                               activation_checkpoint_interval=case.ckpt, virtual_stages=case.virtual)  # fmt: skip
        engine, *_ = terascale.initialize(model=model, config=config(case, dp), wrap_policy=WrapPolicy(module_classes=(Block,)))
        train, evaluation = data(case, dp)
        losses, eval_loss, logits = [], None, None
        for s in range(case.steps):
            if s == EVAL_AFTER:
                eval_loss, logits = engine.eval_batch(iter([mb[dp_rank] for mb in evaluation]), return_logits=True)
            losses.append(float(engine.train_batch(iter([mb[dp_rank] for mb in train[s]]))))
        stats = engine.pipeline_stats()
        assert 0 < stats["busy_s"] <= stats["step_s"] and 0 <= stats["bubble"] < 1, stats
        out.append({
            "losses": losses, "eval_loss": float(eval_loss), "logits": logits, "state": engine.full_state_dict(),
            "local": sorted(n for n, _ in engine.module.named_parameters()), "stage": stage, "dp_rank": dp_rank,
            "ties": [(t.key, t.names, t.owner, torch.distributed.get_process_group_ranks(t.group)) for t in model.ties()],
            "steps": engine.global_steps, "micro_steps": engine.micro_steps,
        })  # fmt: skip
        engine.destroy()
    return out


def reference(case: Case, dp: int) -> dict:
    """The same layers in one plain process: losses, eval loss and logits, final parameters."""
    specs = make_layers(case.kind)
    root = nn.Module()
    root.tied_modules = nn.ModuleDict()
    calls = []
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in root.tied_modules:
                torch.manual_seed(SEED + i)
                root.tied_modules[spec.key] = spec.typename(*spec.module_args, **spec.module_kwargs)
            module = root.tied_modules[spec.key]
            calls.append(module if spec.forward_fn is None else functools.partial(spec.forward_fn, module))
        else:
            torch.manual_seed(SEED + i)
            module = spec.typename(*spec.module_args, **spec.module_kwargs)
            root.add_module(str(i), module)
            calls.append(module)
    loss_fn = loss_of(case.kind)
    forwards = 0

    def forward(x):
        for i, call in enumerate(calls):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED * (forwards + 1) + i)  # seed_layers' rule for the n-th forward
                x = call(x)
        return x

    opt = torch.optim.AdamW(root.parameters(), lr=LR, weight_decay=WD)
    train, evaluation = data(case, dp)
    losses, eval_loss, logits = [], None, None
    for s in range(case.steps):
        if s == EVAL_AFTER:
            root.eval()
            with torch.no_grad():
                total, logits = 0.0, []
                for mb in evaluation:
                    forwards += 1
                    for r, (x, y) in enumerate(mb):
                        out = forward(x)
                        total += float(loss_fn(out, y))
                        logits.append(out)
            eval_loss = total / (case.gas * dp)
            root.train()
        total = 0.0
        for mb in train[s]:
            forwards += 1
            for x, y in mb:
                loss = loss_fn(forward(x), y) / (case.gas * dp)
                loss.backward()
                total += float(loss.detach())
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_(root.parameters(), case.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "eval_loss": eval_loss, "logits": logits,
            "state": {k: v.detach().clone() for k, v in root.state_dict().items()}}  # fmt: skip


def compare(pp: int, dp: int, cases: list[Case], results: list[list[dict]]) -> None:
    """Every rank's results of every case against :func:`reference`."""
    for i, case in enumerate(cases):
        name = f"pp={pp} dp={dp} {case.describe()}"
        ref = reference(case, dp)
        seen: set[str] = set()
        for rank_results in results:
            got = rank_results[i]
            losses = torch.tensor(got["losses"])
            torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=0, msg=name)
            assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5), name
            assert got["steps"] == case.steps and got["micro_steps"] == case.steps * case.gas, name
            for k, v in got["state"].items():
                torch.testing.assert_close(v, ref["state"][k], rtol=0, atol=1e-4, msg=f"{name}: {k}")
            seen |= set(got["local"])
            if got["stage"] == pp - 1:  # the last stage's outputs, for its replica's rows
                mine = torch.cat(ref["logits"][got["dp_rank"] :: dp])
                torch.testing.assert_close(got["logits"], mine, rtol=1e-5, atol=1e-5, msg=name)
            else:
                assert got["logits"] is None, name
            assert bool(got["ties"]) == (case.kind == "tied"), name
            for key, names, owner, ranks in got["ties"]:
                assert owner == (got["stage"] == 0) and len(ranks) == 2, name
        # Names are the global layer indices: the stages' parameters together are the model's.
        assert seen == set(ref["state"]), name


def _module_checks() -> None:
    """PipelineModule on 2 ranks: building, names, virtual stages, ties, errors, direct calls."""
    import terascale
    from terascale.parallel import Topology
    from terascale.comm import init_distributed
    from terascale.pipe import PipelineModule

    rank = init_distributed().rank
    BUILT.clear()
    layers = [LayerSpec(Counted, 2, 2), LayerSpec(Counted, 2, 40), LayerSpec(Counted, 40, 2), LayerSpec(Counted, 2, 3)]
    model = PipelineModule(layers, num_stages=2)  # by parameters: 6 | 120, 82, 9 -> [0, 2, 4]
    assert model.parts == [0, 2, 4]
    assert BUILT == (["2x2", "2x40"] if rank == 0 else ["40x2", "2x3"]), BUILT  # only this stage's layers
    assert sorted(model.state_dict()) == (["0.fc.bias", "0.fc.weight", "1.fc.bias", "1.fc.weight"] if rank == 0
                                          else ["2.fc.bias", "2.fc.weight", "3.fc.bias", "3.fc.weight"])  # fmt: skip
    interleaved = PipelineModule(layers, num_stages=2, partition_method="uniform", virtual_stages=2)
    assert [list(interleaved.chunk_range(c)) for c in range(2)] == [[rank], [2 + rank]]
    assert interleaved.stage_owner(3) == (1, 1)
    with pytest.raises(ValueError, match="PipelineModule: 1 layers cannot fill 2 pipeline stages"):
        PipelineModule(layers[:1], num_stages=2)
    with pytest.raises(ValueError, match="3 layers cannot fill 2 pipeline stages x 2 virtual stages"):
        PipelineModule(layers[:3], num_stages=2, virtual_stages=2)
    with pytest.raises(ValueError, match="num_stages=3 does not divide the world size 2"):
        PipelineModule(layers, num_stages=3)
    with pytest.raises(ValueError, match="unknown partition_method"):
        PipelineModule(layers, num_stages=2, partition_method="profile")
    with pytest.raises(ValueError, match="matches no layer"):
        PipelineModule(layers, num_stages=2, partition_method="type:Attention")
    with pytest.raises(ValueError, match="needs num_stages or topology"):
        PipelineModule(layers)
    # Tied layers: without seed_layers every rank builds different values; the owner's win.
    torch.manual_seed(rank)
    tied = PipelineModule(make_layers("tied"), num_stages=2, partition_method="uniform", loss_fn=token_loss)
    (tie,) = tied.ties()
    assert (tie.key, tie.names, tie.owner) == ("embed", ("tied_modules.embed.weight",), rank == 0)
    assert torch.distributed.get_process_group_ranks(tie.group) == [0, 1]
    weight = tie.params[0].detach().clone()
    torch.distributed.all_reduce(weight, op=torch.distributed.ReduceOp.MAX)
    assert torch.equal(weight, tie.params[0].detach())
    # One stage: the same model as the pipeline's stages together; ties are local.
    single = PipelineModule(make_layers("tied"), topology=Topology(pp=1), loss_fn=token_loss)
    assert single.ties() == [] and sorted(single.state_dict()) == sorted(
        ["tied_modules.embed.weight", *(f"{i}.{n}" for i in (1, 2) for n in ("fc.weight", "fc.bias")), "3.weight", "3.bias"]
    )
    # forward/backward/step on a pipeline engine point to train_batch.
    engine, *_ = terascale.initialize(model=tied, config=config(Case(), 1))
    x = torch.zeros(MICRO, T, dtype=torch.long)
    with pytest.raises(ValueError, match="engine.train_batch"):
        engine(x)
    with pytest.raises(ValueError, match="engine.train_batch"):
        engine.backward(torch.zeros((), requires_grad=True))
    with pytest.raises(ValueError, match="engine.train_batch"):
        engine.step()
    engine.destroy()


def _resume_on_one_stage(path: str) -> None:
    """A checkpoint of 2 stages loads into 1 stage (2 replicas): the same names, so the
    same model; the next step of both gives the same loss and weights."""
    import terascale
    from terascale.parallel import Topology
    from terascale.pipe import PipelineModule

    case = Case(kind="tied", stage=1, gas=4, steps=3)
    engines = {}
    for pp in (2, 1):
        topo = Topology(pp=pp)
        model = PipelineModule(make_layers(case.kind), topology=topo, loss_fn=token_loss, seed_layers=True,
                               base_seed=SEED + pp, partition_method="uniform")  # fmt: skip
        dp = topo.size("dp")  # the same global batch: half the micro-batches per replica at dp=2
        cfg = {**config(dataclasses.replace(case, gas=case.gas // dp), dp), "steps_per_print": case.steps}
        engine, *_ = terascale.initialize(model=model, config=cfg)
        engines[pp] = engine, topo.rank("dp")
    (two, _), (one, dp_rank) = engines[2], engines[1]
    train, _ = data(case, 1)  # the global batch, as 4 micro-batches of one replica
    for s in range(case.steps - 1):
        two.train_batch(iter([mb[0] for mb in train[s]]))
    two.save_checkpoint(path, tag="pp2")
    one.load_checkpoint(path, tag="pp2")
    before = two.full_state_dict()
    assert sorted(one.full_state_dict()) == sorted(before)
    for k, v in one.full_state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    last = train[case.steps - 1]
    # The engine's loss report (at step 3, steps_per_print) shows the batch's loss, once per job:
    # from the first stage, which has it too.
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("terascale")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    loss_two = two.train_batch(iter([mb[0] for mb in last]))
    logger.removeHandler(handler)
    logger.setLevel(level)
    reports = [r for r in records if "loss=" in r]
    if two.dist.rank == 0:
        assert any(f"loss={float(loss_two):.5f}" in r for r in reports), records
    else:
        assert not reports, reports
    loss_one = one.train_batch(iter([last[k * 2 + dp_rank][0] for k in range(case.gas // 2)]))
    torch.testing.assert_close(loss_one, loss_two, rtol=1e-5, atol=0)
    after = two.full_state_dict()
    for k, v in one.full_state_dict().items():
        torch.testing.assert_close(v, after[k], rtol=0, atol=1e-5, msg=k)
    one.destroy()
    two.destroy()


def _refusals() -> None:
    """A PipelineModule gets a PipelineEngine, which refuses a batch inside an open window
    (direct forward/backward/step: ``_module_checks``) and counts the window it ran."""
    import terascale
    from terascale.parallel import Topology
    from terascale.pipe import PipelineEngine, PipelineModule

    case = Case(gas=2, steps=1)
    model = PipelineModule(make_layers("mlp"), topology=Topology(pp=2), loss_fn=F.cross_entropy, partition_method="uniform")
    engine, *_ = terascale.initialize(model=model, config=config(case, 1))
    assert isinstance(engine, PipelineEngine)
    (batch,), _ = data(case, 1)
    engine.set_gradient_accumulation_boundary(True)
    with pytest.raises(ValueError, match="finish that window first"):
        engine.train_batch(iter([mb[0] for mb in batch]))
    engine.set_gradient_accumulation_boundary(None)
    engine.train_batch(iter([mb[0] for mb in batch]))
    assert (engine.global_steps, engine.micro_steps) == (1, 2)
    engine.destroy()
    # Without a loss_fn, eval_batch averages the model's outputs over the micro-batches and
    # every stage gets them (as DeepSpeed's).
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
    reference = torch.nn.Sequential(*[copy.deepcopy(layer) for layer in layers])
    model = PipelineModule(layers, topology=Topology(pp=2), partition_method="uniform")
    engine, *_ = terascale.initialize(model=model, config={**config(case, 1), "gradient_accumulation_steps": 2})
    inputs = [torch.randn(1, 8) for _ in range(2)]
    outputs = engine.eval_batch(iter([(x, torch.zeros(1)) for x in inputs]))
    expected = (reference(inputs[0]) + reference(inputs[1])) / 2
    assert outputs.shape == (1, 3) and torch.allclose(outputs, expected, atol=1e-6), (outputs, expected)
    engine.destroy()


def _two_stages(cases: list[Case], path: str) -> list[dict]:
    _module_checks()
    _refusals()
    _resume_on_one_stage(path)
    return train_rank(2, cases)


def test_pipeline_two_stages_match_single_process(tmp_path) -> None:
    cases = [
        Case(kind="mlp", partition="parameters"),
        Case(kind="tied", clip=0.05),  # the tied embedding/head on both stages, gradient summed; clipped
        Case(kind="tuple", stage=1, gas=2, partition="type:Mask"),  # (hidden, int mask, constant) between stages
        Case(kind="dropout", stage=2, virtual=2, ckpt=1),  # interleaved, checkpointed, dropout replayed
        Case(kind="tied", stage=3, virtual=2, ckpt=2),
    ]
    compare(2, 1, cases, run_ranks(_two_stages, 2, cases, str(tmp_path), timeout=240))


def test_pipeline_stages_may_start_with_in_place_layers() -> None:
    """A received activation is the first layer's to modify in place (DeepSpeed's AlexNet
    pipeline example: stage 1 starts with ReLU(inplace=True)); gradients still reach the
    previous stage and the losses and weights are plain PyTorch's."""
    cases = [
        Case(kind="inplace", partition="uniform"),
        Case(kind="inplace", stage=2, virtual=2, partition="uniform"),
        # Stage 1's checkpointed segments: [ReLU(inplace), Block, AddBias], [Linear]. A segment
        # whose first op modifies its input in place is recomputed from the modified input
        # (torch's checkpoint refuses it): right for ReLU, which is idempotent, as in DeepSpeed.
        Case(kind="inplace", stage=1, ckpt=3, partition="uniform"),
    ]
    compare(2, 1, cases, run_ranks(train_rank, 2, 2, cases))


def test_pipeline_two_stages_two_replicas_zero_stages() -> None:
    cases = [
        Case(kind="mlp", stage=0),
        Case(kind="tied", stage=1, clip=0.05),
        Case(kind="mlp", stage=2, clip=0.05, virtual=2),
        Case(kind="dropout", stage=3, clip=0.05, ckpt=2, partition="parameters"),
    ]
    compare(2, 2, cases, run_ranks(train_rank, 4, 2, cases, timeout=240))


# -- tensor-parallel stage boundaries and ZeRO reductions per chunk (one 4-rank run) ----------------


def test_boundary_parts_pad_and_join() -> None:
    from terascale.pipe.p2p import _own_part

    t = torch.arange(5.0).view(5, 1)
    parts = [_own_part(t, 2, r) for r in range(2)]
    assert [p.tolist() for p in parts] == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]  # padded to 2 x 3
    assert torch.equal(torch.cat(parts)[:5].view(5, 1), t)
    assert [_own_part(torch.ones(1), 4, r).tolist() for r in range(4)] == [[1.0], [0.0], [0.0], [0.0]]


class Gate(nn.Module):
    """Uses its weights only on micro-batches whose first value is positive: a group that
    gets gradients on some ranks and backwards and not on others."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) if float(x[0, 0].detach()) > 0 else x


TP_ROWS, TP_MICRO, TP_STEPS, TP_CLIP = 8, 2, 2, 0.05


def _tp_boundaries(ids: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    """pp=2 x tp=2 with pipe/grad_partitioned on and off: losses, weights, bytes sent."""
    import terascale
    from terascale.parallel import Topology
    from terascale.pipe import PipelineModule
    from tp_model import TokenLoss, layer_specs

    out = []
    for split in (True, False):
        topo = Topology(pp=2, tp=2)
        group = topo.group("tp")
        model = PipelineModule(layer_specs(group), topology=topo, loss_fn=TokenLoss(group), partition_method="uniform",
                               seed_layers=True, base_seed=SEED)  # fmt: skip
        cfg = {
            "train_batch_size": TP_ROWS, "train_micro_batch_size_per_gpu": TP_MICRO, "gradient_clipping": TP_CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "steps_per_print": 1000,
            "pipeline": {"pipe_partitioned": split, "grad_partitioned": split},
        }  # fmt: skip
        engine, *_ = terascale.initialize(model=model, config=cfg)
        micro = [[(ids[s, k : k + TP_MICRO], labels[s, k : k + TP_MICRO]) for k in range(0, TP_ROWS, TP_MICRO)]
                 for s in range(TP_STEPS)]  # fmt: skip
        losses = [float(engine.train_batch(iter(micro[s]))) for s in range(TP_STEPS)]
        stats = engine.pipeline_stats()
        eval_loss = float(engine.eval_batch(iter(micro[0])))
        out.append({"split": split, "losses": losses, "eval": eval_loss, "state": engine.full_state_dict(),
                    "stage": topo.rank("pp"), "sent": (stats["sent_act_bytes"], stats["sent_grad_bytes"])})  # fmt: skip
        engine.destroy()
    return out


def _zero_scopes(swap_dir: str) -> list[dict]:
    """pp=2 x dp=2, ZeRO-2, two virtual stages, every layer its own ZeRO group: which
    groups each backward touched and reduced, and the reduce-scatter bytes per step
    (``swap_dir``: the NVMe folder of the case that swaps gradient shards)."""
    import terascale
    from terascale.parallel import Topology
    from terascale.pipe import PipelineModule
    from terascale.zero import WrapPolicy

    out = []
    for case, nvme in ZERO_CASES:
        topo = Topology(pp=2)
        dp, dp_rank = topo.size("dp"), topo.rank("dp")
        model = PipelineModule(make_layers(case.kind), topology=topo, loss_fn=loss_of(case.kind),
                               seed_layers=True, base_seed=SEED, partition_method=case.partition,
                               virtual_stages=case.virtual)  # fmt: skip
        policy = WrapPolicy(module_classes=(Block, nn.Linear, nn.LayerNorm))
        cfg = config(case, dp)
        if nvme:  # gradient shards on disk: their norms are taken at each group's last reduction
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
        engine, *_ = terascale.initialize(model=model, config=cfg, wrap_policy=policy)
        grads = engine.model_state.grads
        log: list[dict] = []  # per backward: the groups it touched and those it reduced
        prepare, launch, post = grads.prepare_backward, grads._launch, grads.post_backward

        def prepare_(sync: bool, defer: bool = False, prepare=prepare) -> None:
            log.append({"launched": [], "touched": None})
            prepare(sync, defer)

        def launch_(g: int, launch=launch) -> None:
            log[-1]["launched"].append(g)
            launch(g)

        def post_(post=post, grads=grads) -> None:
            log[-1]["touched"] = [g for g, n in enumerate(grads._count) if n > 0]
            post()

        grads.prepare_backward, grads._launch, grads.post_backward = prepare_, launch_, post_
        train, _ = data(case, dp)
        losses, windows, sent = [], [], []
        for s in range(case.steps):
            before, start = grads.comm.dense_bytes, len(log)
            losses.append(float(engine.train_batch(iter([mb[dp_rank] for mb in train[s]]))))
            windows.append(log[start:])
            sent.append(grads.comm.dense_bytes - before)
        group_bytes = [fg.layout.padded_numel * 4 * (dp - 1) // dp for fg in grads.groups]
        out.append({"losses": losses, "state": engine.full_state_dict(), "windows": windows, "sent": sent,
                    "group_bytes": group_bytes, "reduced": sorted(grads._order)})  # fmt: skip
        engine.destroy()
    return out


def _four_ranks(swap_dir: str) -> dict:
    """Both 4-rank layouts one after the other (one spawn); rank 0 adds the plain
    single-process run of the tensor-parallel model."""
    from tp_model import TokenLoss, make_batches, reference_layers

    ids, labels = make_batches(TP_STEPS, TP_ROWS)
    tp = _tp_boundaries(ids, labels)
    zero = _zero_scopes(swap_dir)
    if torch.distributed.get_rank() != 0:
        return {"tp": tp, "zero": zero}
    model = reference_layers(base_seed=SEED)  # the tensor-parallel model as plain layers
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ref_losses = []
    for s in range(TP_STEPS):
        opt.zero_grad()
        loss = TokenLoss()(model(ids[s]), labels[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TP_CLIP)
        opt.step()
        ref_losses.append(loss.item())
    ref = {"losses": ref_losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    return {"tp": tp, "zero": zero, "tp_ref": ref}


ZERO_CASES = [  # (case, gradient shards on NVMe)
    (Case(kind="mlp", stage=2, virtual=2), False),
    (Case(kind="gated", stage=2, virtual=2, clip=0.05), False),
    (Case(kind="gated", stage=2, virtual=2, clip=0.05), True),
]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_four_ranks, 4, str(tmp_path_factory.mktemp("swap")), timeout=240)


def test_tensor_parallel_boundaries_send_a_tp_th_and_match_plain_pytorch(four_ranks: list[dict]) -> None:
    from tp_model import HIDDEN, SEQ

    ref = four_ranks[0]["tp_ref"]
    numel = TP_MICRO * SEQ * HIDDEN  # the hidden state at the boundary
    whole = TP_ROWS // TP_MICRO * numel * 4  # bytes per run over the one boundary, unpartitioned
    for rank, result in enumerate(four_ranks):
        for r in result["tp"]:
            name = f"rank {rank} partitioned={r['split']}"
            losses = torch.tensor(r["losses"])
            torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=0, msg=name)
            assert set(r["state"]) == set(ref["state"]), name
            for k, v in r["state"].items():
                torch.testing.assert_close(v, ref["state"][k], rtol=1e-4, atol=1e-5, msg=f"{name}: {k}")
            expected = whole // 2 if r["split"] else whole
            first = r["stage"] == 0
            assert r["sent"] == ((expected, 0) if first else (0, expected)), name
        on, off = result["tp"]
        assert on["eval"] == pytest.approx(off["eval"], rel=1e-6)


def test_zero2_interleaved_reduces_only_the_groups_a_backward_touched(four_ranks: list[dict]) -> None:
    for i, (case, nvme) in enumerate(ZERO_CASES):
        name = f"pp=2 dp=2 {case.describe()} nvme={nvme}"
        ref = reference(case, 2)
        for rank, result in enumerate(four_ranks):
            got = result["zero"][i]
            losses = torch.tensor(got["losses"])
            torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=0, msg=name)
            for k, v in got["state"].items():
                torch.testing.assert_close(v, ref["state"][k], rtol=0, atol=1e-4, msg=f"{name}: {k}")
            if case.kind != "mlp":
                continue  # gated: the plan reduces a gate's group where any rank used it
            first, *later = zip(got["windows"], got["sent"])
            backwards = len(first[0])
            assert backwards == case.gas * case.virtual
            # The first window has no plan yet: every backward reduces every group.
            assert all(sorted(b["launched"]) == got["reduced"] for b in first[0]), name
            assert first[1] == backwards * sum(got["group_bytes"])
            for window, sent in later:  # then each backward reduces exactly what it touched
                for b in window:
                    assert sorted(b["launched"]) == sorted(b["touched"]), (name, rank, b)
                assert sent == sum(got["group_bytes"][g] for b in window for g in b["touched"])
                assert sent < first[1] * 0.6, (sent, first[1])  # two chunks: about half
