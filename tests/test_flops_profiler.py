"""The flops profiler: FLOPs per module against hand counts (linear, conv, attention),
forward and backward, activation checkpointing's recompute, the report, get_model_profile,
and that profiling leaves no trace on the model or its training."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from terascale.profiling import FlopsProfiler, ModuleProfile, get_model_profile
from terascale.profiling.flops_report import format_params, format_seconds, human


def _profile(model: nn.Module, run, **kwargs) -> FlopsProfiler:
    prof = FlopsProfiler(model, **kwargs)
    with prof:
        run()
    return prof


# -- counts against hand-computed FLOPs --------------------------------------------------------


@pytest.mark.parametrize("input_grad", [True, False])
def test_linear_forward_and_backward(input_grad: bool) -> None:
    B, n_in, n_out = 4, 16, 32
    lin = nn.Linear(n_in, n_out)
    x = torch.randn(B, n_in, requires_grad=input_grad)
    prof = _profile(lin, lambda: lin(x).sum().backward())
    fwd = 2 * B * n_in * n_out  # the bias addition is not a multiply-accumulate
    # Backward: the weight gradient (one matmul), and the input gradient when x needs one.
    bwd = 2 * fwd if input_grad else fwd
    assert prof.total_flops(include_backward=False) == fwd
    assert prof.total_flops() == fwd + bwd
    assert prof.total_macs() == (fwd + bwd) // 2
    assert prof.total_macs(include_backward=False) == B * n_in * n_out
    assert prof.total_params() == n_in * n_out + n_out
    root = prof.module_profile("")
    assert (root.fwd_flops, root.bwd_flops, root.calls) == (fwd, bwd, 1)
    assert root.fwd_latency_s > 0 and prof.forward_latency() == root.fwd_latency_s


@pytest.mark.parametrize("input_grad", [True, False])
def test_conv2d(input_grad: bool) -> None:
    B, c_in, c_out, k, H, W = 2, 3, 8, 3, 10, 12
    conv = nn.Conv2d(c_in, c_out, k, padding=1)
    x = torch.randn(B, c_in, H, W, requires_grad=input_grad)
    prof = _profile(conv, lambda: conv(x).sum().backward())
    fwd = 2 * B * c_out * H * W * c_in * k * k  # 'same' padding: one output per input position
    assert prof.total_flops(include_backward=False) == fwd
    assert prof.total_flops() - fwd == (2 * fwd if input_grad else fwd)
    assert prof.total_params() == c_out * c_in * k * k + c_out


class Attention(nn.Module):
    """Multi-head self-attention with its matrix products spelled out."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, S, self.heads, D // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.heads)
        y = scores.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, S, D))


def test_attention_block() -> None:
    B, S, D, H = 2, 8, 32, 4
    att = Attention(D, H)
    x = torch.randn(B, S, D, requires_grad=True)
    prof = _profile(att, lambda: att(x).sum().backward())
    proj = 2 * B * S * D * D  # each of q, k, v, o
    bmm = 2 * B * H * S * S * (D // H)  # q @ k^T, and scores @ v
    for name in "qkvo":
        assert prof.module_profile(name).fwd_flops == proj
        assert prof.module_profile(name).bwd_flops == 2 * proj
    assert prof.total_flops(include_backward=False) == 4 * proj + 2 * bmm
    assert prof.total_flops() == 3 * (4 * proj + 2 * bmm)  # every product has two in backward
    # torch's own block agrees (need_weights: the two products run as bmm's).
    mha = nn.MultiheadAttention(D, H, batch_first=True)
    prof = _profile(mha, lambda: mha(x, x, x))
    assert prof.total_flops() == 4 * proj + 2 * bmm


def test_fused_attention_on_cpu_is_counted() -> None:
    B, H, S, E = 2, 4, 8, 16

    class Sdpa(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q)

    q = torch.randn(B, H, S, E, requires_grad=True)
    prof = _profile(Sdpa(), lambda: Sdpa()(q).sum().backward())  # a fresh module: not profiled
    assert prof.total_flops() == 0
    model = Sdpa()
    prof = _profile(model, lambda: model(q).sum().backward())
    bmm = 2 * B * H * S * S * E
    assert prof.total_flops(include_backward=False) == 2 * bmm
    assert prof.total_flops() - 2 * bmm == 5 * bmm  # torch's count: scores recomputed, four products


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d, bias=False)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int = 8, blocks: int = 2, ckpt: str | None = None) -> None:
        super().__init__()
        self.stem = nn.Linear(d, d, bias=False)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d, 1, bias=False)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            if self.ckpt is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        return self.head(self.drop(h)).sum()  # the loss: the backward starts at the module's output


def test_forward_backward_over_steps_and_reset() -> None:
    B, d = 4, 8
    net = Net(d)
    x = torch.randn(B, d)
    mm = 2 * B * d * d  # one d x d product
    prof = FlopsProfiler(net)
    prof.start()
    for _ in range(2):
        net(x).backward()
    prof.stop()
    fwd = mm + 2 * (4 * mm) + 2 * B * d  # stem, two blocks (d->2d->d), head
    assert prof.total_flops(include_backward=False) == 2 * fwd
    # x needs no gradient: the stem computes only its weight's.
    assert prof.total_flops() - 2 * fwd == 2 * (mm + 2 * (8 * mm) + 2 * (2 * B * d))
    blocks = prof.module_profile("blocks")  # a ModuleList is never called: its blocks' sum
    assert blocks.fwd_flops == 2 * 8 * mm and blocks.calls == 0 and blocks.fwd_latency_s > 0
    assert prof.module_profile("blocks.1.fc2").calls == 2
    prof.start()
    net(x).backward()
    prof.stop()
    assert prof.total_flops(include_backward=False) == 3 * fwd  # windows add up
    prof.reset()
    assert prof.total_flops() == 0 and prof.forward_latency() == 0
    assert prof.total_params() == d * d + 2 * (4 * d * d) + d


def test_module_called_twice() -> None:
    lin = nn.Linear(8, 8, bias=False)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin(x))

    model = Twice()
    x = torch.randn(2, 8, requires_grad=True)
    prof = _profile(model, lambda: model(x).sum().backward())
    one = 2 * 2 * 8 * 8
    p = prof.module_profile("lin")
    assert (p.calls, p.fwd_flops, p.bwd_flops) == (2, 2 * one, 4 * one)


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_activation_checkpointing_counts_the_recompute(mode: str) -> None:
    B, d = 4, 8
    x = torch.randn(B, d)
    mm = 2 * B * d * d
    plain = _profile(net := Net(d), lambda: net(x).backward())
    ckpt_net = Net(d, ckpt=mode)
    # Without early stop torch recomputes the whole block (with it, it stops at the last
    # activation backward needs, and the profile shows that instead: counted as measured).
    with set_checkpoint_early_stop(False):
        ckpt = _profile(ckpt_net, lambda: ckpt_net(x).backward())
    assert ckpt.total_flops(include_backward=False) == plain.total_flops(include_backward=False)
    for k in range(2):
        b, c = plain.module_profile(f"blocks.{k}"), ckpt.module_profile(f"blocks.{k}")
        assert (b.fwd_flops, b.bwd_flops) == (4 * mm, 8 * mm)
        assert (c.fwd_flops, c.bwd_flops) == (4 * mm, 8 * mm + 4 * mm)
        for name in ("fc1", "fc2"):
            inner = ckpt.module_profile(f"blocks.{k}.{name}")
            assert (inner.fwd_flops, inner.bwd_flops, inner.calls) == (2 * mm, 6 * mm, 1)
    assert ckpt.total_flops() == plain.total_flops() + 2 * 4 * mm


def test_early_stopped_recompute_is_counted_as_measured() -> None:
    B, d = 4, 8
    net = Net(d, blocks=1, ckpt="non-reentrant")
    mm = 2 * B * d * d
    prof = _profile(net, lambda: net(torch.randn(B, d)).backward())
    # fc2's output is not an activation backward needs: the recompute stops after fc1.
    assert prof.module_profile("blocks.0").bwd_flops == 8 * mm + 2 * mm
    assert prof.module_profile("blocks.0.fc1").bwd_flops == 4 * mm + 2 * mm
    assert prof.module_profile("blocks.0.fc2").bwd_flops == 4 * mm


# -- parameters --------------------------------------------------------------------------------


def test_param_numel_gives_full_sizes() -> None:
    net = Net(8)
    full = {name: 1000 + p.numel() for name, p in net.named_parameters()}
    prof = _profile(net, lambda: net(torch.randn(2, 8)), param_numel=full)
    assert prof.total_params() == sum(full.values())
    assert prof.module_profile("blocks.0").params == full["blocks.0.fc1.weight"] + full["blocks.0.fc2.weight"]
    with pytest.raises(ValueError, match="blocks.1.fc2.weight"):
        FlopsProfiler(net, param_numel={k: v for k, v in full.items() if k != "blocks.1.fc2.weight"})


def test_empty_parameters_without_param_numel_warn() -> None:
    lin = nn.Linear(4, 4)
    lin.weight.data = torch.empty(0)  # what a stage-3 parameter holds outside its use
    with pytest.warns(UserWarning, match="param_numel"):
        prof = FlopsProfiler(lin)
    assert prof.total_params() == 4


# -- the report --------------------------------------------------------------------------------


def _tree_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "params (" in line and line.endswith("FLOP/s")]


def test_report_tree_depth_and_top_modules() -> None:
    net = Net(8)
    prof = _profile(net, lambda: net(torch.randn(4, 8)).backward())
    root = prof.module_profile("")
    text = prof.report(module_depth=1, top_modules=1)
    lines = _tree_lines(text)
    labels = [line.split(":")[0] for line in lines]
    assert labels == ["Net", "  (stem) Linear", "  (blocks) ModuleList", "  (drop) Dropout", "  (head) Linear"]
    assert f"{format_params(root.params)} params (100.00%)" in lines[0]
    assert human(root.flops, "FLOPs") in lines[0]
    assert "depth 2:" not in text and "depth 1:" in text
    # depth 1, top 1 by params: the ModuleList (both blocks), one entry per line.
    agg = text.split("depth 1:")[1].splitlines()
    assert agg[1].strip() == f"params      - ModuleList: {format_params(prof.module_profile('blocks').params)}"
    assert agg[2].count(":") == 1

    text = prof.report(module_depth=2, top_modules=2, detailed=True, step_time_s=0.5)
    lines = _tree_lines(text)
    labels = [line.split(":")[0] for line in lines]
    assert labels[2:5] == ["  (blocks) ModuleList", "    (0) Block", "    (1) Block"]
    assert not any(label.startswith("      ") for label in labels)  # the blocks' layers are at depth 3
    assert "depth 2:" in text and "depth 3:" not in text
    depth2 = text.split("depth 2:")[1].splitlines()
    assert depth2[1].strip().startswith("params      - Block: ") and depth2[1].count(":") == 1  # one class there
    depth1_flops = text.split("depth 1:")[1].splitlines()[2]
    assert depth1_flops.count(":") == 2 and depth1_flops.index("ModuleList") < depth1_flops.index("Linear")
    assert human(root.flops / 0.5, "FLOP/s") in text

    full = prof.report()  # -1: the whole tree
    assert "      (fc1) Linear" in [line.split(":")[0] for line in _tree_lines(full)]
    assert "detailed profile" not in prof.report(detailed=False)
    with pytest.raises(ValueError):
        prof.report(top_modules=0)


def test_units() -> None:
    assert human(2.1e9, "FLOPs") == "2.1 GFLOPs"
    assert human(1234, "MACs") == "1.23 KMACs"
    assert human(12) == "12"
    assert format_params(7e9) == "7 B" and format_params(1.5e6) == "1.5 M"
    assert format_seconds(0.0123) == "12.3 ms" and format_seconds(2.5) == "2.5 s"


def test_ignore_modules() -> None:
    net = Net(8)
    prof = _profile(net, lambda: net(torch.randn(4, 8)).backward(), ignore_modules=[Block])
    names = [p.name for p in prof.profiles()]
    assert "blocks.0" not in names and "blocks.0.fc1" not in names and "stem" in names
    assert prof.total_flops(include_backward=False) == 2 * 4 * 8 * 8 * 9 + 2 * 4 * 8  # the blocks stay in the root's


# -- get_model_profile -------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))


def test_get_model_profile_values(capsys: pytest.CaptureFixture[str]) -> None:
    model = _mlp()
    model.train()
    flops, macs, params = get_model_profile(model, input_shape=(8, 16), print_profile=False)
    # DeepSpeed's convention: a linear layer's FLOPs are 2 * B * in * out, MACs half of that.
    assert flops == 2 * 8 * (16 * 64 + 64 * 10)
    assert macs == flops // 2
    assert params == 16 * 64 + 64 + 64 * 10 + 10
    assert model.training  # the mode is restored
    assert capsys.readouterr().out == ""
    assert get_model_profile(model, args=[torch.randn(8, 16)], print_profile=False) == (flops, macs, params)
    assert get_model_profile(model, kwargs={"input": torch.randn(8, 16)}, print_profile=False) == (flops, macs, params)
    text = get_model_profile(model, input_shape=(8, 16), as_string=True, print_profile=False)
    assert text == (human(flops, "FLOPs"), human(macs, "MACs"), format_params(params))
    assert text == ("26.62 KFLOPs", "13.31 KMACs", "1.74 K")
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model)
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model, input_shape=(8, 16), args=[torch.randn(8, 16)])


def test_get_model_profile_prints_or_writes(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _mlp()
    get_model_profile(model, input_shape=(2, 16), module_depth=1, top_modules=2, warm_up=0)
    out = capsys.readouterr().out
    assert "terascale flops profiler" in out and "  (0) Linear:" in out
    path = tmp_path / "sub" / "profile.txt"
    get_model_profile(model, input_shape=(2, 16), output_file=str(path), detailed=False)
    assert capsys.readouterr().out == ""
    written = path.read_text()
    assert "aggregated profile per module" in written and "(0) Linear:" not in written


# -- no trace left -----------------------------------------------------------------------------


def _no_hooks_left(model: nn.Module) -> bool:
    modules_clean = all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    params_clean = all(not p._backward_hooks for p in model.parameters())
    global_clean = not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    return modules_clean and params_clean and global_clean and torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize("ckpt", [None, "non-reentrant"])
def test_training_is_unchanged_by_a_profiled_step(ckpt: str | None) -> None:
    torch.manual_seed(0)
    reference = Net(8, ckpt=ckpt)
    profiled = copy.deepcopy(reference)
    data = torch.randn(4, 3, 8)

    def train(model: nn.Module, prof: FlopsProfiler | None) -> list[float]:
        torch.manual_seed(1)  # dropout draws the same masks in both runs
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(4):
            if prof is not None and step in (1, 2):
                prof.start()
            loss = model(data[:, step % 3])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if prof is not None and step in (1, 2):
                prof.stop()
            losses.append(loss.item())
        return losses

    prof = FlopsProfiler(profiled)
    assert train(reference, None) == train(profiled, prof)
    for a, b in zip(reference.parameters(), profiled.parameters()):
        assert torch.equal(a, b)
    assert prof.total_flops() > 0 and _no_hooks_left(profiled)


def test_modules_that_write_into_their_input() -> None:
    class AddInPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.add_(1.0)

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), AddInPlace(), nn.ReLU(inplace=True), nn.Linear(8, 8))
    profiled = copy.deepcopy(reference)
    x = torch.randn(4, 8, requires_grad=True)
    reference(x).sum().backward()
    expected = [p.grad for p in reference.parameters()] + [x.grad]
    x.grad = None
    prof = _profile(profiled, lambda: profiled(x).sum().backward())
    assert all(torch.equal(a, p) for a, p in zip(expected, [p.grad for p in profiled.parameters()] + [x.grad]))
    one = 2 * 4 * 8 * 8
    counts = [(p.fwd_flops, p.bwd_flops) for p in prof.profiles()]
    assert counts == [(2 * one, 4 * one), (one, 2 * one), (0, 0), (0, 0), (one, 2 * one)]


def test_start_twice_is_an_error() -> None:
    prof = FlopsProfiler(nn.Linear(2, 2))
    prof.start()
    with pytest.raises(ValueError, match="twice"):
        prof.start()
    prof.stop()
    prof.stop()  # stopping a stopped profiler does nothing
    assert isinstance(prof.profiles()[0], ModuleProfile)
