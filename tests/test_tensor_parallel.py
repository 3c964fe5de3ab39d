"""Tensor parallelism: slicing, the tensor-parallel layers and auto_tp against the unsliced
single-process computation.

The oracle is parity: every rank builds the full module with the same seed and computes
the full forward and backward itself; the tensor-parallel version must give the same
output (or this rank's part of it) and this rank's slice of every gradient (fp32).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_ranks
from terascale.parallel import TensorSlice, join_slices, sliced_parameters, take_slice


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- slicing (one process)


def test_take_slice_and_join_slices_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    for shape, dim, fused in (((12, 5), 0, 1), ((5, 12), 1, 1), ((12, 5), 0, 3), ((5, 24), 1, 3), ((5, 24), -1, 3),
                              ((4, 6, 8), 1, 1), ((12,), 0, 3)):  # fmt: skip
        full = torch.randn(shape, generator=g)
        for parts in (1, 2, 4):
            if full.shape[dim] % (parts * fused):
                continue
            slices = [TensorSlice(dim, parts, i, fused) for i in range(parts)]
            locals_ = [take_slice(full, s) for s in slices]
            for s, local in zip(slices, locals_):
                assert local.is_contiguous() and local.shape == s.local_shape(full.shape)
                assert s.full_shape(local.shape) == tuple(full.shape)
            assert torch.equal(join_slices(locals_, dim, fused), full)
            # a copy: writing to a part leaves the full tensor alone
            locals_[0].add_(1.0)
            assert not torch.equal(join_slices(locals_, dim, fused), full)


def test_fused_slices_hold_part_of_every_block() -> None:
    # [q | k | v], each 4 rows: with 2 parts, index 1 holds rows 2-3 of q, of k and of v.
    full = torch.arange(12).reshape(12, 1)
    assert take_slice(full, TensorSlice(0, 2, 1, fused=3)).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert take_slice(full, TensorSlice(0, 2, 1)).flatten().tolist() == [6, 7, 8, 9, 10, 11]
    assert take_slice(full.t(), TensorSlice(1, 2, 0, fused=3)).flatten().tolist() == [0, 1, 4, 5, 8, 9]


def test_slice_errors_name_size_and_divisor() -> None:
    with pytest.raises(ValueError, match="size 10 of dim 0 is not divisible by 4"):
        TensorSlice(0, 4, 0).local_shape((10, 3))
    with pytest.raises(ValueError, match="size 12 of dim 1 is not divisible by 24"):
        take_slice(torch.zeros(2, 12), TensorSlice(1, 8, 0, fused=3))
    with pytest.raises(ValueError, match="index 2 is outside"):
        TensorSlice(0, 2, 2)
    with pytest.raises(ValueError, match="differ in shape"):
        join_slices([torch.zeros(2), torch.zeros(3)], 0)


class _Described(nn.Module):
    """A stand-in tensor-parallel layer: describes its weight as sliced, its bias not."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 3))
        self.bias = nn.Parameter(torch.zeros(3))

    def tensor_parallel_slices(self) -> dict[str, TensorSlice]:
        return {"weight": TensorSlice(1, 2, 1, fused=3)}


def test_sliced_parameters_uses_first_names() -> None:
    model = nn.ModuleDict({"a": _Described(), "plain": nn.Linear(2, 2), "c": _Described()})
    model["b"] = model["a"]  # a module under two names
    model["c"].weight = model["a"].weight  # a parameter of two modules
    # tied: the parameter's name is the first one named_parameters() gives
    assert sliced_parameters(model) == {"a.weight": TensorSlice(1, 2, 1, fused=3)}
    model = nn.Sequential(nn.Sequential(_Described()))
    assert sliced_parameters(model) == {"0.0.weight": TensorSlice(1, 2, 1, fused=3)}


# ---------------------------------------------------------------- layers (real ranks)


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _column_cases(group) -> None:
    import torch.distributed as dist

    from terascale.parallel.tensor import ColumnParallelLinear

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, generator=g)  # [batch, seq, hidden]
    w_out = torch.randn(2, 4, 12, generator=g)
    for bias in (True, False):
        for gather_output in (False, True):
            for sp in (False, True):
                what = f"column tp={tp} bias={bias} gather={gather_output} sp={sp}"
                torch.manual_seed(0)
                ref = nn.Linear(8, 12, bias=bias)
                after_ref = torch.rand(3)
                torch.manual_seed(0)
                col = ColumnParallelLinear(8, 12, bias, group=group, gather_output=gather_output, sequence_parallel=sp)
                # the generator ends where the unsliced layer's does (same draws)
                assert torch.equal(torch.rand(3), after_ref), what
                assert torch.equal(col.weight, take_slice(ref.weight.detach(), TensorSlice(0, tp, r))), what
                xr = x.clone().requires_grad_()
                (ref(xr) * w_out).sum().backward()
                y_ref = ref(x).detach()

                xl = (take_slice(x, TensorSlice(1, tp, r)) if sp else x.clone()).requires_grad_()
                y = col(xl)
                mine = TensorSlice(2, tp, r)
                _close(y, y_ref if gather_output else take_slice(y_ref, mine), what + " output")
                (y * (w_out if gather_output else take_slice(w_out, mine))).sum().backward()
                _close(col.weight.grad, take_slice(ref.weight.grad, TensorSlice(0, tp, r)), what + " weight grad")
                if bias:
                    _close(col.bias.grad, take_slice(ref.bias.grad, TensorSlice(0, tp, r)), what + " bias grad")
                x_grad = take_slice(xr.grad, TensorSlice(1, tp, r)) if sp else xr.grad
                _close(xl.grad, x_grad, what + " input grad")
    # init_method initialises the full weight (then sliced) and zeroes the bias
    torch.manual_seed(3)
    full = nn.init.xavier_uniform_(torch.empty(12, 8))
    torch.manual_seed(3)
    col = ColumnParallelLinear(8, 12, group=group, init_method=nn.init.xavier_uniform_)
    assert torch.equal(col.weight, take_slice(full, TensorSlice(0, tp, r))) and not col.bias.any()


def _row_cases(group) -> None:
    import torch.distributed as dist

    from terascale.parallel.tensor import RowParallelLinear

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 12, generator=g)
    w_out = torch.randn(2, 4, 6, generator=g)
    for bias in (True, False):
        for input_is_parallel, sp in ((True, False), (False, False), (True, True)):
            what = f"row tp={tp} bias={bias} input_is_parallel={input_is_parallel} sp={sp}"
            torch.manual_seed(0)
            ref = nn.Linear(12, 6, bias=bias)
            torch.manual_seed(0)
            row = RowParallelLinear(12, 6, bias, group=group, input_is_parallel=input_is_parallel, sequence_parallel=sp)
            assert torch.equal(row.weight, take_slice(ref.weight.detach(), TensorSlice(1, tp, r))), what
            if bias:
                assert torch.equal(row.bias, ref.bias), what
            xr = x.clone().requires_grad_()
            (ref(xr) * w_out).sum().backward()
            y_ref = ref(x).detach()

            xl = (take_slice(x, TensorSlice(2, tp, r)) if input_is_parallel else x.clone()).requires_grad_()
            y = row(xl)
            seq = TensorSlice(1, tp, r)
            _close(y, take_slice(y_ref, seq) if sp else y_ref, what + " output")
            (y * (take_slice(w_out, seq) if sp else w_out)).sum().backward()
            _close(row.weight.grad, take_slice(ref.weight.grad, TensorSlice(1, tp, r)), what + " weight grad")
            if bias:  # replicated: the full gradient on every rank, sequence parallel or not
                _close(row.bias.grad, ref.bias.grad, what + " bias grad")
            x_grad = take_slice(xr.grad, TensorSlice(2, tp, r)) if input_is_parallel else xr.grad
            _close(xl.grad, x_grad, what + " input grad")


def _sequence_parallel_block_cases(group) -> None:
    """x (sequence-split) -> norm -> column(sp) -> gelu -> row(sp) -> + x, against the full
    block: outputs and input gradients are this rank's positions; the norm's (replicated)
    gradients are full and bitwise the same on every rank."""
    import torch.distributed as dist

    from terascale.parallel.tensor import ColumnParallelLinear, RowParallelLinear, SequenceParallelNorm

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 8, generator=g)
    w_out = torch.randn(2, 8, 8, generator=g)
    seq = TensorSlice(1, tp, r)
    for rms in (False, True):
        what = f"sp block tp={tp} rms={rms}"
        torch.manual_seed(0)
        ref_norm = nn.RMSNorm(8, eps=1e-5) if rms else nn.LayerNorm(8)
        ref_up, ref_down = nn.Linear(8, 16), nn.Linear(16, 8)
        with torch.no_grad():  # non-trivial norm parameters
            ref_norm.weight.uniform_(0.5, 1.5)
            if not rms:
                ref_norm.bias.uniform_(-0.5, 0.5)
        norm = SequenceParallelNorm.from_norm(ref_norm, group) if rms else SequenceParallelNorm(8, group=group)
        if not rms:
            norm.load_state_dict(ref_norm.state_dict())
        up = ColumnParallelLinear.from_linear(ref_up, group, sequence_parallel=True)
        down = RowParallelLinear.from_linear(ref_down, group, sequence_parallel=True)

        def block(t, n, a, b):
            return t + b(torch.nn.functional.gelu(a(n(t))))

        xr = x.clone().requires_grad_()
        (block(xr, ref_norm, ref_up, ref_down) * w_out).sum().backward()
        ref_norm_grads = [p.grad.clone() for p in ref_norm.parameters()]
        ref_norm.zero_grad()  # from_norm shares the parameters: start the tp backward at zero
        xl = take_slice(x, seq).requires_grad_()
        y = block(xl, norm, up, down)
        _close(y, take_slice(block(x, ref_norm, ref_up, ref_down).detach(), seq), what + " output")
        (y * take_slice(w_out, seq)).sum().backward()
        _close(xl.grad, take_slice(xr.grad, seq), what + " input grad")
        _close(up.weight.grad, take_slice(ref_up.weight.grad, TensorSlice(0, tp, r)), what + " up grad")
        _close(down.bias.grad, ref_down.bias.grad, what + " down bias grad")
        for p, expected in zip(norm.parameters(), ref_norm_grads):
            _close(p.grad, expected, what + " norm grad")
            assert all(torch.equal(p.grad, other) for other in _gather(p.grad, group)), what


def _embedding_cases(group) -> None:
    import torch.distributed as dist

    from terascale.parallel.tensor import VocabParallelEmbedding

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 16, (2, 4), generator=g)
    ids[0, 0], ids[1, 3] = 5, 15  # the padding row, the last row
    w_out = torch.randn(2, 4, 6, generator=g)
    for padding_idx in (None, 5):
        for sp in (False, True):
            what = f"embedding tp={tp} padding={padding_idx} sp={sp}"
            torch.manual_seed(0)
            ref = nn.Embedding(16, 6, padding_idx=padding_idx)
            torch.manual_seed(0)
            emb = VocabParallelEmbedding(16, 6, group=group, padding_idx=padding_idx, sequence_parallel=sp)
            mine = TensorSlice(0, tp, r)
            assert torch.equal(emb.weight, take_slice(ref.weight.detach(), mine)), what
            y_ref = ref(ids)
            (y_ref * w_out).sum().backward()
            y = emb(ids)
            seq = TensorSlice(1, tp, r)
            _close(y, take_slice(y_ref.detach(), seq) if sp else y_ref, what + " output")
            (y * (take_slice(w_out, seq) if sp else w_out)).sum().backward()
            _close(emb.weight.grad, take_slice(ref.weight.grad, mine), what + " weight grad")
        assert emb.tensor_parallel_slices() == {"weight": mine}
    full = nn.Embedding(16, 6, padding_idx=-1)
    emb = VocabParallelEmbedding.from_embedding(full, group)
    assert emb.padding_idx == 15
    _close(emb(ids), full(ids), f"from_embedding tp={tp}")


def _cross_entropy_cases(group) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from terascale.parallel.tensor import vocab_parallel_cross_entropy

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(5)
    V = 16
    logits = torch.randn(3, 5, V, generator=g) * 3
    target = torch.randint(0, V, (3, 5), generator=g)
    target[0, 1] = target[2, 4] = -100
    target[1, 2] = 3
    mine = TensorSlice(2, tp, r)
    for ignore_index in (-100, 3):
        for smoothing in (0.0, 0.1):
            for reduction in ("mean", "sum", "none"):
                what = f"cross-entropy tp={tp} ignore={ignore_index} smoothing={smoothing} {reduction}"
                if ignore_index == 3:  # -100 is then an ordinary (out of range) id: not for F
                    tgt = target.masked_fill(target == -100, 7)
                else:
                    tgt = target
                full = logits.clone().requires_grad_()
                ref = F.cross_entropy(full.view(-1, V), tgt.view(-1), ignore_index=ignore_index,
                                      reduction=reduction, label_smoothing=smoothing)  # fmt: skip
                ref = ref.view(3, 5) if reduction == "none" else ref
                w = torch.rand(3, 5, generator=g) if reduction == "none" else torch.tensor(1.0)
                (ref * w).sum().backward()
                local = take_slice(logits, mine).requires_grad_()
                loss = vocab_parallel_cross_entropy(local, tgt, group, ignore_index=ignore_index,
                                                    reduction=reduction, label_smoothing=smoothing)  # fmt: skip
                _close(loss, ref.detach(), what + " loss")
                (loss * w).sum().backward()
                _close(local.grad, take_slice(full.grad, mine), what + " grad")


def _dropout_cases(group) -> None:
    import copy

    import torch.distributed as dist

    from terascale.activation.rng import RNGStatesTracker, seed_model_parallel
    from terascale.parallel.tensor import ParallelDropout

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    tracker = RNGStatesTracker(torch.device("cpu"))
    seed_model_parallel(tracker, 1234, r)
    x = torch.ones(256)
    default_before = torch.get_rng_state()
    sliced = ParallelDropout(0.5, tracker)(x)
    assert torch.equal(torch.get_rng_state(), default_before), "ParallelDropout moved the default generator"
    replicated = nn.Dropout(0.5)(x)
    sliced_all, replicated_all = _gather(sliced, group), _gather(replicated, group)
    assert all(torch.equal(replicated, other) for other in replicated_all)
    if tp > 1:
        assert not torch.equal(sliced_all[0], sliced_all[1]), "tensor-parallel dropout masks agree across ranks"
    assert not torch.equal(sliced, replicated)
    assert 64 < int((sliced == 0).sum()) < 192
    dropout = ParallelDropout(0.5, tracker).eval()
    assert dropout(x) is x
    assert copy.deepcopy(dropout).tracker is tracker


def _collective_cases(group) -> None:
    """Direct checks of the sequence collectives along dim 0 ([seq, batch, hidden]) and
    of the identities over a group of one."""
    import torch.distributed as dist

    from terascale.parallel.tensor import (
        copy_to_tensor_region,
        gather_from_sequence_region,
        gather_from_tensor_region,
        reduce_from_tensor_region,
        reduce_scatter_to_sequence_region,
        scatter_to_sequence_region,
        scatter_to_tensor_region,
    )

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    full = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 2)
    mine = TensorSlice(0, tp, r)
    part = take_slice(full, mine).requires_grad_()
    gathered = gather_from_sequence_region(part, group, dim=0, partial_grad=False)
    assert torch.equal(gathered, full)
    gathered.backward(full * 2)
    assert torch.equal(part.grad, take_slice(full * 2, mine))
    mine_full = (full * (r + 1)).requires_grad_()
    scattered = reduce_scatter_to_sequence_region(mine_full, group, dim=0)
    assert torch.equal(scattered, take_slice(full * (tp * (tp + 1) // 2), mine))
    scattered.backward(take_slice(full, mine))
    assert torch.equal(mine_full.grad, full)
    assert torch.equal(scatter_to_sequence_region(full, group, dim=0), take_slice(full, mine))
    if tp == 1:
        for fn in (copy_to_tensor_region, reduce_from_tensor_region, gather_from_tensor_region,
                   scatter_to_tensor_region, gather_from_sequence_region,
                   reduce_scatter_to_sequence_region):  # fmt: skip
            assert fn(full, group) is full, fn.__name__
        # The communicating paths over a group of one rank inside a larger world: a
        # collective that forgot its group would run over the world and change the values.
        from terascale.parallel.tensor import collectives as c

        for dim in (0, 1, -1):
            assert torch.equal(c._all_gather(full, group, dim), full)
            assert torch.equal(c._reduce_scatter(full, group, dim), full)
            assert torch.equal(c._split(full, group, dim), full)
        assert torch.equal(c._all_reduce(full, group), full)
        leaf = full.clone().requires_grad_()
        c._CopyToRegion.apply(leaf, group).backward(full)
        assert torch.equal(leaf.grad, full)
    else:
        with pytest.raises(ValueError, match=f"size {tp + 1} of dim 1 is not divisible by tensor-parallel size {tp}"):
            reduce_scatter_to_sequence_region(torch.zeros(2, tp + 1, 3), group)


def _sliced_parameters_case(group) -> None:
    import torch.distributed as dist

    from terascale.parallel.tensor import (
        ColumnParallelLinear,
        RowParallelLinear,
        SequenceParallelNorm,
        VocabParallelEmbedding,
    )

    tp, r = dist.get_world_size(group), dist.get_rank(group)
    model = nn.ModuleDict({
        "emb": VocabParallelEmbedding(8 * tp, 4, group=group),
        "qkv": ColumnParallelLinear(4, 6 * tp, group=group, fused=3, weight_layout="in_out"),
        "out": RowParallelLinear(2 * tp, 4, group=group),
        "norm": SequenceParallelNorm(4, group=group),
        "head": nn.Linear(4, 3),
    })  # fmt: skip
    assert sliced_parameters(model) == {
        "emb.weight": TensorSlice(0, tp, r),
        "qkv.weight": TensorSlice(1, tp, r, fused=3),
        "qkv.bias": TensorSlice(0, tp, r, fused=3),
        "out.weight": TensorSlice(1, tp, r),
    }
    assert tuple(model["qkv"].weight.shape) == (4, 6)


def _parallelize_cases(group) -> None:
    """A plan of name patterns makes a small model sequence-parallel: the output is this
    rank's positions of the unsliced model's, every gradient matches."""
    import copy

    import torch.distributed as dist

    from terascale.parallel.tensor import Colwise, Rowwise, SequenceParallel, VocabParallel, parallelize_module
    from terascale.parallel.tensor.norm import SequenceParallelNorm

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8), "norm": nn.LayerNorm(8)})
                           for _ in range(2))  # fmt: skip
    ref = nn.ModuleDict({"emb": nn.Embedding(16, 8), "blocks": blocks})

    def run(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        h = m["emb"](ids)
        for b in m["blocks"]:
            h = h + b["down"](torch.relu(b["up"](b["norm"](h))))
        return h

    plan = {"emb": VocabParallel(sequence_parallel=True), "*.up": Colwise(sequence_parallel=True),
            "*.down": Rowwise(sequence_parallel=True), "*.norm": SequenceParallel()}  # fmt: skip
    model = parallelize_module(copy.deepcopy(ref), group, plan)
    assert isinstance(model["blocks"][1]["norm"], SequenceParallelNorm)
    assert list(model.state_dict()) == list(ref.state_dict())
    g = torch.Generator().manual_seed(8)
    ids, w = torch.randint(0, 16, (2, 4), generator=g), torch.randn(2, 4, 8, generator=g)
    seq = TensorSlice(1, dist.get_world_size(group), dist.get_rank(group))
    (run(ref, ids) * w).sum().backward()
    out = run(model, ids)
    _close(out, take_slice(run(ref, ids).detach(), seq), "parallelize_module output")
    (out * take_slice(w, seq)).sum().backward()
    _check_grads(model, ref, sliced_parameters(model), group, "parallelize_module")
    with pytest.raises(ValueError, match="pattern '\\*.nothing' matches no submodule"):
        parallelize_module(copy.deepcopy(ref), group, {"*.nothing": Colwise()})
    with pytest.raises(ValueError, match="'emb' is a Embedding; Colwise takes nn.Linear or Conv1D"):
        parallelize_module(copy.deepcopy(ref), group, {"emb": Colwise()})
    with pytest.raises(ValueError, match="'blocks.0.up' matches more than one pattern"):
        parallelize_module(copy.deepcopy(ref), group, {"*.up": Colwise(), "blocks.0.*": Rowwise()})


def _error_cases(group) -> None:
    import torch.distributed as dist

    from terascale.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    tp = dist.get_world_size(group)
    bad = 2 * tp + 1
    by_tp = f"is not divisible by tensor-parallel size {tp}"
    with pytest.raises(ValueError, match=f"^ColumnParallelLinear: out_features={bad} {by_tp}$"):
        ColumnParallelLinear(4, bad, group=group)
    with pytest.raises(ValueError, match=f"out_features={6 * tp + 3} {by_tp} x 3 fused blocks"):
        ColumnParallelLinear(4, 6 * tp + 3, group=group, fused=3)
    with pytest.raises(ValueError, match=f"^RowParallelLinear: in_features={bad} {by_tp}$"):
        RowParallelLinear(bad, 4, group=group)
    with pytest.raises(ValueError, match=f"^VocabParallelEmbedding: num_embeddings={bad} {by_tp}$"):
        VocabParallelEmbedding(bad, 4, group=group)
    with pytest.raises(ValueError, match="gather_output would interleave the fused blocks"):
        ColumnParallelLinear(4, 6 * tp, group=group, fused=3, gather_output=True)
    with pytest.raises(ValueError, match="sequence_parallel needs input_is_parallel=True"):
        RowParallelLinear(2 * tp, 4, group=group, input_is_parallel=False, sequence_parallel=True)


def _layers_rank() -> None:
    from terascale.parallel import Topology

    # tp=1: a group of one rank per rank, inside a world of two (on rank 1 the group rank
    # differs from the global rank, and a layer that lost its group would see two ranks)
    for tp in (2, 1):
        group = Topology(tp=tp).group("tp")
        _collective_cases(group)
        _column_cases(group)
        _row_cases(group)
        _sequence_parallel_block_cases(group)
        _embedding_cases(group)
        _cross_entropy_cases(group)
        _dropout_cases(group)
        _sliced_parameters_case(group)
        _parallelize_cases(group)
        if tp > 1:
            _error_cases(group)


def test_layers_match_the_unsliced_computation() -> None:
    run_ranks(_layers_rank, 2)


# ---------------------------------------------------------------- auto_tp (real ranks)


def _tiny(kind: str) -> nn.Module:
    import transformers as tf

    llama_like = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**llama_like)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**llama_like)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**llama_like)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                         bos_token_id=0, eos_token_id=0)),
    }  # fmt: skip
    torch.manual_seed(0)
    return configs[kind]()


def _expected_slices(kind: str, tp: int, r: int) -> dict[str, TensorSlice]:
    col, row = TensorSlice(0, tp, r), TensorSlice(1, tp, r)
    out = {}
    for i in range(2):
        if kind == "gpt2":
            p = f"transformer.h.{i}."
            out |= {p + "attn.c_attn.weight": TensorSlice(1, tp, r, 3),
                    p + "attn.c_attn.bias": TensorSlice(0, tp, r, 3),
                    p + "attn.c_proj.weight": col, p + "mlp.c_fc.weight": row, p + "mlp.c_fc.bias": col,
                    p + "mlp.c_proj.weight": col}  # fmt: skip
            continue
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            out[p + name + ".weight"] = col
            if kind == "qwen2" and name.startswith("self_attn"):
                out[p + name + ".bias"] = col
        out |= {p + "self_attn.o_proj.weight": row, p + "mlp.down_proj.weight": row}
    return out


def _check_grads(model: nn.Module, ref: nn.Module, slices: dict[str, TensorSlice], group, what: str) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        s = slices.get(name)
        if s is not None:
            full = join_slices(_gather(p.grad, group), s.dim, s.fused)
        else:  # replicated: the full gradient, the same on every rank
            full = p.grad
            assert all(torch.equal(full, other) for other in _gather(full, group)), f"{what}: {name} grad differs"
        _close(full, ref_params[name].grad, f"{what}: grad of {name}")


def _auto_tp_rank() -> None:
    import copy
    import types

    import torch.distributed as dist

    from terascale.parallel import Topology
    from terascale.parallel.tensor import ColumnParallelLinear, auto_tp

    group = Topology(tp=2).group("tp")
    tp, r = 2, dist.get_rank(group)
    g = torch.Generator().manual_seed(7)
    for kind in ("llama", "qwen2", "mistral", "gpt2"):
        ref = _tiny(kind)
        model = auto_tp(copy.deepcopy(ref), group)
        assert list(model.state_dict()) == list(ref.state_dict()), kind
        slices = sliced_parameters(model)
        assert slices == _expected_slices(kind, tp, r), kind
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            full = ref_params[name].detach()
            assert torch.equal(p, take_slice(full, slices[name]) if name in slices else full), f"{kind}: {name}"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for step in range(3):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            out_ref = ref(input_ids=ids, labels=ids, use_cache=False)
            out = model(input_ids=ids, labels=ids, use_cache=False)
            _close(out.logits, out_ref.logits, f"{kind} step {step} logits")
            _close(out.loss, out_ref.loss, f"{kind} step {step} loss")
            out_ref.loss.backward()
            out.loss.backward()
            _check_grads(model, ref, slices, group, f"{kind} step {step}")
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        for name, p in model.named_parameters():
            s = slices.get(name)
            full = join_slices(_gather(p.detach(), group), s.dim, s.fused) if s else p.detach()
            # Adam's step is about lr whatever the gradient's size, so a gradient near zero
            # that differs in its last bits moves a weight by a visible amount: absolute 1e-5
            what = f"{kind} after 3 steps: {name}"
            torch.testing.assert_close(full, ref_params[name].detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, what=what: f"{what}: {m}")  # fmt: skip

    # a copy shares the process group (a handle) and holds its own parameters
    twin = copy.deepcopy(model)
    assert twin.transformer.h[0].attn.c_attn.group is group
    assert twin.transformer.h[0].attn.c_attn.weight is not model.transformer.h[0].attn.c_attn.weight
    ids = torch.randint(0, 64, (2, 8), generator=g)
    _close(twin(input_ids=ids).logits, model(input_ids=ids).logits, "deepcopy of the auto_tp model")

    # errors: sizes that tp does not divide, unknown models, doing it twice
    import transformers as tf

    def llama(**kw):
        base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
        return tf.LlamaForCausalLM(tf.LlamaConfig(**(base | kw)))

    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by tensor-parallel size 2"):
        auto_tp(llama(num_key_value_heads=1), group)
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible by tensor-parallel size 2"):
        auto_tp(llama(hidden_size=24, num_attention_heads=3, num_key_value_heads=3), group)
    with pytest.raises(ValueError, match="intermediate_size=47 is not divisible by tensor-parallel size 2"):
        auto_tp(llama(intermediate_size=47), group)
    gpt2 = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=30, n_layer=1, n_head=3, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match="n_head=3 is not divisible by tensor-parallel size 2"):
        auto_tp(tf.GPT2LMHeadModel(gpt2), group)
    with pytest.raises(ValueError, match="supports Hugging Face models of type gpt2, llama, mistral, qwen2; got bert"):
        auto_tp(types.SimpleNamespace(config=types.SimpleNamespace(model_type="bert")), group)
    with pytest.raises(ValueError, match="got Linear"):
        auto_tp(nn.Linear(2, 2), group)
    with pytest.raises(ValueError, match="already has tensor-parallel layers"):
        auto_tp(model, group)
    assert isinstance(model.transformer.h[0].attn.c_attn, ColumnParallelLinear)


def test_auto_tp_matches_the_unsliced_model() -> None:
    run_ranks(_auto_tp_rank, 2)
