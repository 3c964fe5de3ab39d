"""Ulysses sequence parallelism through ``terascale.initialize``: a Hugging Face Llama whose
every sequence is split over the sequence-parallel ranks, composed with ZeRO, against the
unchanged model in one process (plain PyTorch, SGD with momentum: the update is
proportional to the gradient, so one summed or averaged over the wrong ranks shows): the
loss at every step on every rank, the global gradient norm (clipping reads it) and every
parameter after the steps."""

from __future__ import annotations

import pytest

from distributed import run_ranks

STEPS, SEQ, VOCAB = 3, 32, 96
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)  # fmt: skip


def _model(kv_heads: int, impl: str = "sdpa"):
    import torch
    import transformers

    config = transformers.LlamaConfig(**LLAMA, num_key_value_heads=kv_heads)
    config._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def _batches(replicas: int):
    """Per step, per data replica: (input_ids, labels) of 2 sequences, some targets ignored."""
    import torch

    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(replicas):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
            labels = ids.clone()
            labels[0, 2 : 2 + SEQ // 2] = -100  # most of one slice ignored: slices count unevenly
            step.append((ids, labels))
        out.append(step)
    return out


def _reference(kv_heads: int, replicas: int, lr: float, clip: float) -> tuple[list[list[float]], list[float], dict]:
    import torch

    model = _model(kv_heads)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, norms = [], []
    for step in _batches(replicas):
        opt.zero_grad()
        out = [model(input_ids=ids, labels=labels).loss for ids, labels in step]
        (sum(out) / replicas).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        losses.append([loss.item() for loss in out])
    return losses, norms, model.state_dict()


def _sp_rank(sp: int, stage: int, kv_heads: int, extra: dict | None = None) -> dict:
    import torch

    import terascale
    from terascale.comm import init_distributed

    ctx = init_distributed()
    replicas = ctx.world_size // sp
    # Clipping above the norm (which is ~2-3): the engine computes the norm, the update stays
    # proportional to the gradient (clipped, a wrong scale would cancel out).
    lr, clip = 0.5, 50.0
    ref_losses, ref_norms, want = _reference(kv_heads, replicas, lr, clip)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
              "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
              "zero_optimization": zero, "sequence_parallel_size": sp, **(extra or {})}  # fmt: skip
    engine, *_ = terascale.initialize(model=_model(kv_heads), config=config)
    assert engine.get_sequence_parallel_world_size() == sp and engine.dp_world_size == replicas
    replica = engine.get_data_parallel_rank()
    for step, batch in enumerate(_batches(replicas)):
        ids, labels = batch[replica]  # every rank of a sequence group reads the same sample
        out = engine(ids, labels=labels)
        loss = out.loss
        tiled = (extra or {}).get("sequence_parallel", {}).get("tiled_loss") is True
        assert (out.logits is None) == tiled  # a tiled loss never builds the logits
        if out.logits is not None:
            assert out.logits.shape == (2, SEQ // sp, VOCAB)  # this rank's slice
        torch.testing.assert_close(loss.item(), ref_losses[step][replica], rtol=2e-5, atol=1e-6)
        engine.backward(loss)
        engine.step()
        assert engine.get_global_grad_norm() == pytest.approx(ref_norms[step], rel=1e-4)
    got = engine.full_state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")
    return {"stage": stage}


@pytest.mark.parametrize("stage, kv_heads", [(0, 4), (3, 4), (3, 2), pytest.param(0, 2, marks=pytest.mark.slow)],
                         ids=["mha-0", "mha-3", "gqa-3", "gqa-0"])  # fmt: skip
def test_sequence_parallel_llama_equals_one_process(stage, kv_heads):
    run_ranks(_sp_rank, 2, 2, stage, kv_heads)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_sequence_parallel_at_zero_1_and_2(stage):
    run_ranks(_sp_rank, 2, 2, stage, 2)


def test_sequence_and_data_parallel_on_four_ranks():
    """sp 2 x dp 2 at ZeRO-3: replicas read different samples, gradients summed over each
    sequence group and averaged over the replicas; the model state is sharded over all four."""
    run_ranks(_sp_rank, 4, 2, 3, 2)


def test_sequence_parallel_composes_with_offload_and_activation_checkpointing(tmp_path):
    """ZeRO-3 with parameters and optimizer on the host, every decoder layer recomputed (the
    all-to-alls run again in backward) with its saved inputs on the host; the MLPs and the
    loss tiled."""
    extra = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                   "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
             "activation_checkpointing": {"policy": "blocks", "cpu_checkpointing": True},
             "sequence_parallel": {"tiled_mlp": True, "tiled_loss": True, "mlp_tiles": 3, "loss_tile_bytes": 4096}}  # fmt: skip
    run_ranks(_sp_rank, 2, 2, 3, 2, extra)


def _checkpoint_rank(sp: int, save_dir: str, load: bool) -> dict:
    import torch

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "sequence_parallel_size": sp}  # fmt: skip
    engine, *_ = terascale.initialize(model=_model(2), config=config)
    data = _batches(1)
    if load:
        engine.load_checkpoint(save_dir)
    else:
        for ids, labels in (step[0] for step in data[:2]):
            engine.backward(engine(ids, labels=labels).loss)
            engine.step()
        engine.save_checkpoint(save_dir)
    state = engine.full_state_dict()
    ids, labels = data[2][0]
    loss = engine(ids, labels=labels).loss
    engine.backward(loss)
    engine.step()
    return {"state": state, "next": engine.full_state_dict(), "loss": loss.item()}


def test_a_checkpoint_saved_with_sequence_parallelism_loads_without_it(tmp_path, caplog):
    """Saved at sp 2 (ZeRO-3 over both ranks), loaded in one process: the same model, and
    the same next step from its optimizer state."""
    import torch

    saved = run_ranks(_checkpoint_rank, 2, 2, str(tmp_path), False)
    (loaded,) = run_ranks(_checkpoint_rank, 1, 1, str(tmp_path), True)
    for rank in saved:
        assert rank["loss"] == pytest.approx(loaded["loss"], rel=2e-5)
        for key in ("state", "next"):
            for k, v in rank[key].items():
                torch.testing.assert_close(loaded[key][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _refused(case: str) -> str:
    import torch

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "sequence_parallel_size": 2}  # fmt: skip
    model = _model(2)
    try:
        if case == "world":
            config["sequence_parallel_size"] = 3
        elif case == "heads":
            import transformers

            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "hidden_size": 24,
                                                                              "num_attention_heads": 3}))  # fmt: skip
        elif case == "own model":
            model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
        elif case == "both spellings":
            config["sequence_parallel"] = {"size": 4}
        engine, *_ = terascale.initialize(model=model, config=config)
        if case == "length":
            ids = torch.zeros(2, SEQ - 1, dtype=torch.long)
            engine(ids, labels=ids)
    except ValueError as err:
        return str(err)
    return "not refused"


def _refusals(cases: list[str]) -> dict[str, str]:
    return {case: _refused(case) for case in cases}


def test_sizes_that_do_not_split_are_refused_naming_the_numbers():
    got = run_ranks(_refusals, 2, ["world", "length", "heads", "own model", "both spellings"])[0]
    assert "sequence_parallel_size 3 does not divide the 2 ranks" in got["world"]
    assert "sequences of 31 tokens do not split over 2 sequence-parallel ranks" in got["length"]
    assert "sequence_parallel_size 2 does not divide the 3 attention heads of LlamaForCausalLM" in got["heads"]
    assert got["own model"] == "not refused"  # DeepSpeed's: the groups are built, splitting is the program's
    assert "sequence_parallel_size is 2 but sequence_parallel.size is 4" in got["both spellings"]


def _masked_rank(case: str) -> None:
    """One SGD step at sp 2 on a batch whose attention is not plain causal, against the
    unchanged model: left padding (sdpa), packed sequences (eager), Mistral's sliding window
    shorter than the sequence; and Qwen2 with one key/value head (eager) on a plain batch."""
    import torch
    import transformers

    import terascale
    from terascale.comm import init_distributed

    init_distributed()

    def model():
        torch.manual_seed(0)
        if case == "window":
            config = transformers.MistralConfig(**LLAMA, num_key_value_heads=2, sliding_window=8)
        elif case == "qwen2-mqa":  # one key/value head, repeated for the two ranks
            config = transformers.Qwen2Config(**LLAMA, num_key_value_heads=1)
        else:
            config = transformers.LlamaConfig(**LLAMA, num_key_value_heads=2)
        config._attn_implementation = "eager" if case in ("packed", "qwen2-mqa") else "sdpa"
        return type(transformers.AutoModelForCausalLM.from_config(config))(config).float()

    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if case == "padding":
        pad = torch.ones(2, SEQ, dtype=torch.long)
        pad[0, :11] = 0  # left padding (right padding hides behind the causal mask) in rank 0's slice
        batch["attention_mask"] = pad
        batch["labels"][pad == 0] = -100
    elif case == "packed":
        batch["position_ids"] = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).expand(2, SEQ)
    ref = model()
    ref_loss = ref(**batch, use_cache=False).loss  # without a cache, as training runs: packed sequences seen
    ref_loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "zero_optimization": {"stage": 0}, "sequence_parallel_size": 2}  # fmt: skip
    engine, *_ = terascale.initialize(model=model(), config=config)
    loss = engine(**batch).loss
    torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=2e-5, atol=1e-6)
    engine.backward(loss)
    engine.step()
    got = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=2e-6, msg=lambda m, k=k: f"{case} {k}: {m}")


@pytest.mark.parametrize("case", ["padding", "packed", "window", "qwen2-mqa"])
def test_padding_packed_sequences_and_sliding_windows_split_exactly(case):
    run_ranks(_masked_rank, 2, case)


def _rows() -> list[tuple]:
    """Every sequence of :func:`_batches` in turn: (input_ids [S], labels [S])."""
    return [(ids[i], labels[i]) for ((ids, labels),) in _batches(1) for i in range(2)]


def _alst_program() -> tuple[list[float], dict]:
    import torch
    import torch.distributed as dist

    import terascale as deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    UlyssesSPAttentionHF = deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF  # noqa: N806
    UlyssesSPDataLoaderAdapter = deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter  # noqa: N806
    groups = deepspeed.utils.groups
    model = _model(2)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=2, micro_batch_size=1,
                                                          seq_length=SEQ, seq_length_is_variable=True)  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    sp_group = groups._get_sequence_parallel_group()
    sp_rank, sp_world = groups._get_sequence_parallel_rank(), groups._get_sequence_parallel_world_size()
    assert sp_world == 2 and sp_group is engine.get_sequence_parallel_group()
    rank = dist.get_rank()
    rows = [{"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ)} for ids, labels in _rows()]
    loader = torch.utils.data.DataLoader(rows[rank::2], batch_size=1)  # each rank's own samples
    adapter = UlyssesSPDataLoaderAdapter(loader, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world,
                                         device=torch.device("cpu"))  # fmt: skip
    losses = []
    for batch in adapter:  # rank 0's sample, then rank 1's, ...
        shift = batch["shift_labels"]
        out = engine(**batch, labels=shift)
        good = (shift != -100).sum()
        gathered = torch.distributed.nn.functional.all_gather(out.loss, group=sp_group)
        goods = [torch.zeros_like(good) for _ in range(sp_world)]
        dist.all_gather(goods, good, group=sp_group)
        loss = sum(part * n for part, n in zip(gathered, goods) if n > 0) / sum(goods)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def test_deepspeed_alst_programs_run_with_one_changed_import():
    import torch

    results = run_ranks(_alst_program, 2)
    # The reference: the unchanged model, SGD, the samples in the adapter's order (rank 0's
    # first sample, rank 1's, rank 0's second, ...: the rows in order).
    model = _model(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    want = []
    for ids, labels in _rows():
        opt.zero_grad()
        loss = model(input_ids=ids[None], labels=labels[None]).loss
        loss.backward()
        opt.step()
        want.append(loss.item())
    for losses, state in results:
        assert losses == pytest.approx(want, rel=2e-5), (losses, want)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")


def _tiled_alone_rank() -> None:
    """Tiling without sequence parallelism: a left-padded batch keeps the model's own mask."""
    import torch

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    pad = torch.ones(2, SEQ, dtype=torch.long)
    pad[0, :9] = 0
    labels = ids.masked_fill(pad == 0, -100)
    ref = _model(2)
    want = ref(input_ids=ids, attention_mask=pad, labels=labels, use_cache=False).loss
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "sequence_parallel": {"tiled_mlp": True, "tiled_loss": True, "mlp_tiles": 3, "loss_tile_bytes": 4096}}  # fmt: skip
    engine, *_ = terascale.initialize(model=_model(2), config=config)
    out = engine(input_ids=ids, attention_mask=pad, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss.item(), want.item(), rtol=2e-5, atol=1e-6)


def test_tiling_without_sequence_parallelism_keeps_the_padding_mask():
    run_ranks(_tiled_alone_rank, 1)


class _OwnModel:
    """A program's own causal LM whose attention is DeepSpeed's DistributedAttention with
    no group (``initialize`` gives it the engine's), built lazily inside the ranks."""

    @staticmethod
    def build(split: bool):
        import torch
        import torch.nn.functional as F
        from torch import nn

        from terascale.parallel.sequence import attention

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.embed = nn.Embedding(VOCAB, 32)
                self.qkv = nn.Linear(32, 96)
                self.out = nn.Linear(32, 32)
                self.head = nn.Linear(32, VOCAB)
                local = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731  [b, s, h, d] in and out
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
                self.attn = attention.DistributedAttention(local, None, scatter_idx=2, gather_idx=1) if split else None
                self.local = local

            def forward(self, ids):
                x = self.embed(ids)
                q, k, v = self.qkv(x).view(*ids.shape, 3, 4, 8).unbind(2)
                ctx = self.attn(q, k, v) if self.attn is not None else self.local(q, k, v)
                return self.head(x + self.out(ctx.flatten(2)))

        return Net()


def _own_model_rank() -> None:
    import torch

    import terascale
    from terascale.comm import init_distributed
    from terascale.parallel.sequence import sequence_loss, slice_batch

    init_distributed()
    ((ids, labels),) = _batches(1)[0]
    ref = _OwnModel.build(split=False)
    logits = ref(ids)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "sequence_parallel_size": 2}  # fmt: skip
    engine, *_ = terascale.initialize(model=_OwnModel.build(split=True), config=config)
    part = slice_batch({"input_ids": ids, "labels": labels}, engine.get_sequence_parallel_rank(), 2)
    out = engine(part.inputs["input_ids"])
    loss = sequence_loss(out, part.inputs["shift_labels"], part.num_targets, engine.get_sequence_parallel_group())
    torch.testing.assert_close(loss.item(), want.item(), rtol=2e-5, atol=1e-6)
    want.backward()
    engine.backward(loss)
    engine.step()  # SGD: the update is -lr x the gradient, which must be the unsplit one
    got = engine.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach() - 0.1 * p.grad, rtol=1e-4, atol=2e-6, msg=name)


def test_a_programs_own_attention_through_distributed_attention():
    run_ranks(_own_model_rank, 2)


def _loader_rank() -> list:
    import torch

    import terascale
    from terascale.comm import init_distributed

    init_distributed()
    data = [{"input_ids": torch.full((SEQ,), i), "labels": torch.full((SEQ,), i)} for i in range(16)]
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "sequence_parallel_size": 2}  # fmt: skip
    engine, _, loader, _ = terascale.initialize(model=_model(2), config=config, training_data=data)
    assert engine.train_batch_size() == 2 * 2  # micro 2 x 2 data replicas
    batches = [b["input_ids"][:, 0].tolist() for b, _ in zip(loader, range(2))]
    engine.backward(engine(**next(iter(loader))).loss)  # trains on what the loader gives
    engine.step()
    return batches


def test_the_ranks_of_a_sequence_group_read_the_same_samples():
    seen = run_ranks(_loader_rank, 4)
    assert seen[0] == seen[1] and seen[2] == seen[3]  # sequence groups [0, 1], [2, 3]
    assert not set(sum(seen[0], [])) & set(sum(seen[2], []))  # the replicas read different samples
