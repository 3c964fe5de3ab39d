"""The DeepSpeed names terascale provides with behaviour of their own (beyond the engine):
sparse attention, the transformer layer, init_inference, the op builders and aio handle,
deepspeed.io writers, the data-pipeline pieces, elasticity, Lion, the config models.

Each is checked against a plain reference (dense attention, torch's encoder layer, the
update formula, a file read back). One process, no ranks: ~7 s serially.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F


def test_sparse_attention_is_attention_over_the_layout_blocks() -> None:
    from terascale.ops.sparse_attention import (BertSparseSelfAttention, BigBirdSparsityConfig,
                                                DenseSparsityConfig, FixedSparsityConfig, SparseAttentionUtils,
                                                SparseSelfAttention, VariableSparsityConfig)  # fmt: skip

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)
    kpm = torch.zeros(2, 16)
    kpm[:, 12:] = -10000.0
    dense = SparseSelfAttention(DenseSparsityConfig(4, block=4))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=kpm[:, None, None, :])
    assert torch.allclose(dense(q, k, v, key_padding_mask=kpm), ref, atol=1e-6)

    fixed = FixedSparsityConfig(4, block=4, num_local_blocks=2, attention="unidirectional")
    layout = fixed.make_layout(16)
    assert layout.shape == (4, 4, 4) and torch.equal(layout[0], layout[3])
    assert layout[0].triu(1).sum() == 0  # causal: nothing above the diagonal
    mask = layout[0].bool().repeat_interleave(4, 0).repeat_interleave(4, 1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(SparseSelfAttention(fixed)(q, k, v), ref, atol=1e-6)

    assert VariableSparsityConfig(4, block=4, local_window_blocks=[1, 2]).make_layout(16)[0].tolist() == [
        [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 1]]  # fmt: skip
    assert BigBirdSparsityConfig(4, block=4, num_random_blocks=0).make_layout(16)[0, 0].tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="divisible by the block"):
        dense(q[:, :, :15], k[:, :, :15], v[:, :, :15])

    bert = BertSparseSelfAttention(SimpleNamespace(hidden_size=32, num_attention_heads=4), DenseSparsityConfig(4, 4))
    x = torch.randn(2, 16, 32)
    heads = [t.view(2, 16, 4, 8).transpose(1, 2) for t in (bert.query(x), bert.key(x), bert.value(x))]
    expected = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(2, 16, 32)
    assert torch.allclose(bert(x), expected, atol=1e-6)
    pad_len, ids, mask, *_ = SparseAttentionUtils.pad_to_block_size(
        8, torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5), None, None, None, 0, None)  # fmt: skip
    assert pad_len == 3 and ids.shape == (2, 8) and mask[:, 5:].sum() == 0
    assert SparseAttentionUtils.unpad_sequence_output(3, torch.zeros(2, 8, 4)).shape == (2, 5, 4)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_transformer_layer_is_a_bert_encoder_layer(pre_ln: bool) -> None:
    import terascale as deepspeed

    torch.manual_seed(0)
    config = deepspeed.DeepSpeedTransformerConfig(hidden_size=16, heads=2, attn_dropout_ratio=0.0,
                                                  hidden_dropout_ratio=0.0, num_hidden_layers=2,
                                                  initializer_range=0.02, pre_layer_norm=pre_ln)  # fmt: skip
    layer = deepspeed.DeepSpeedTransformerLayer(config)
    with torch.no_grad():  # non-trivial norms, so that which norm sits where matters
        for p in (layer.attn_nw, layer.attn_nb, layer.norm_w, layer.norm_b):
            p.add_(torch.randn_like(p) * 0.1)
    ref = nn.TransformerEncoderLayer(16, 2, 64, dropout=0.0, activation=lambda t: F.gelu(t, approximate="tanh"),
                                     batch_first=True, layer_norm_eps=1e-12, norm_first=pre_ln)  # fmt: skip
    # torch's norm1 sits before attention (pre-LN) or after it (post-LN); DeepSpeed's attn_nw
    # always follows the attention residual, norm_w is the other one.
    first, second = (layer.norm_w, layer.norm_b), (layer.attn_nw, layer.attn_nb)
    if not pre_ln:
        first, second = second, first
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(layer.attn_qkvw)
        ref.self_attn.in_proj_bias.copy_(layer.attn_qkvb)
        ref.self_attn.out_proj.weight.copy_(layer.attn_ow)
        ref.self_attn.out_proj.bias.copy_(layer.attn_ob)
        ref.linear1.weight.copy_(layer.inter_w)
        ref.linear1.bias.copy_(layer.inter_b)
        ref.linear2.weight.copy_(layer.output_w)
        ref.linear2.bias.copy_(layer.output_b)
        ref.norm1.weight.copy_(first[0]), ref.norm1.bias.copy_(first[1])
        ref.norm2.weight.copy_(second[0]), ref.norm2.bias.copy_(second[1])
    x = torch.randn(2, 5, 16)
    assert torch.allclose(layer(x), ref(x), atol=1e-5)
    assert layer.attn_ow.std() < layer.attn_qkvw.std()  # adjust_init_range scales the output projections


def test_init_inference_casts_and_runs_the_model() -> None:
    import terascale as deepspeed

    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    expected = model(x)
    engine = deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    assert torch.equal(engine(x), expected) and engine.module is model and not model.training
    half = deepspeed.init_inference(nn.Linear(4, 3), config={"dtype": "fp16", "tensor_parallel": {"tp_size": 1}})
    assert next(half.parameters()).dtype == torch.float16
    with pytest.raises(ValueError, match="quant"):
        deepspeed.init_inference(nn.Linear(4, 3), quant={"enabled": True})
    with pytest.raises(ValueError, match="torch.distributed"):
        deepspeed.init_inference(nn.Linear(4, 3), mp_size=2)


def test_op_builders_aio_handle_and_file_writers(tmp_path: Path) -> None:
    import terascale as deepspeed
    from terascale.io import FastFileWriter, FastFileWriterConfig, MockFileWriter
    from terascale.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder, UtilsBuilder

    ops = deepspeed.ops.__compatible_ops__
    assert ops[AsyncIOBuilder.NAME] and ops[CPUAdamBuilder.NAME] and not ops["sparse_attn"]
    flat = UtilsBuilder().load().flatten([torch.ones(2), torch.zeros(3)])
    assert flat.tolist() == [1, 1, 0, 0, 0]
    handle = AsyncIOBuilder().load().aio_handle(1 << 20, 8, False, False, 1)
    t = torch.arange(1000, dtype=torch.float32)
    path = str(tmp_path / "t.bin")
    assert handle.sync_pwrite(t, path) == 1
    back = torch.empty(1000)
    handle.async_pread(back, path)
    assert handle.wait() == 1 and torch.equal(back, t)

    obj = {"w": torch.randn(700), "n": list(range(30))}
    for double in (True, False):
        out = tmp_path / f"obj{double}.pt"
        writer = FastFileWriter(str(out), FastFileWriterConfig(handle, torch.empty(512, dtype=torch.uint8), double))
        torch.save(obj, writer)
        writer.close()
        loaded = torch.load(out)
        assert torch.equal(loaded["w"], obj["w"]) and loaded["n"] == obj["n"]
    mock = MockFileWriter("unused")
    torch.save(obj, mock)
    assert mock.tell() == out.stat().st_size


def test_data_pipeline_pieces(tmp_path: Path) -> None:
    from terascale.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
    from terascale.runtime.data_pipeline.data_sampling.indexed_dataset import (MMapIndexedDataset,
                                                                               MMapIndexedDatasetBuilder)  # fmt: skip

    prefix = str(tmp_path / "tokens")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for seq in ([1, 2, 3], [4, 5], [6]):
        builder.add_item(torch.tensor(seq))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 3 and ds[1].tolist() == [4, 5] and ds.get(0, 1, 2).tolist() == [2, 3]
    assert ds.sizes.tolist() == [3, 2, 1] and ds.doc_idx.tolist() == [0, 1, 2, 3] and MMapIndexedDataset.exists(prefix)

    linear = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
                                  "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}})  # fmt: skip
    assert [linear.update_difficulty(s) for s in (0, 5, 10, 20)] == [8, 32, 64, 64]
    discrete = CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
                                    "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}})  # fmt: skip
    assert [discrete.get_difficulty(s) for s in (5, 6, 11)] == [1, 2, 3]


def test_elasticity_lion_helpers_and_config_models() -> None:
    import terascale as deepspeed
    from terascale.compression.helper import convert_conv1d_to_linear, recursive_getattr
    from terascale.git_version_info import torch_info, version
    from terascale.ops.lion import DeepSpeedCPULion
    from terascale.runtime.zero.config import DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig
    from terascale.utils.torch import required_torch_version

    section = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
               "min_gpus": 32, "max_gpus": 1500, "version": 0.1}  # fmt: skip
    batch, gpus = deepspeed.elasticity.compute_elastic_config({"elasticity": section}, version)
    assert batch == 9792 and len(gpus) == 23
    with pytest.raises(deepspeed.elasticity.config.ElasticityIncompatibleWorldSize):
        deepspeed.elasticity.compute_elastic_config({"elasticity": section}, version, world_size=31)

    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = DeepSpeedCPULion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    p.grad = torch.tensor([0.3, 0.0])
    opt.step()  # p *= 1 - lr*wd; p -= lr * sign(0.1 * g)
    assert torch.allclose(p.detach(), torch.tensor([0.95 - 0.1, -1.9]))
    assert torch.allclose(opt.state[p]["exp_avg"], torch.tensor([0.003, 0.0]))

    class Conv1D(nn.Module):  # GPT-2's layout: weight [in, out]
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight + self.bias

    model = nn.Sequential(nn.Sequential(Conv1D()))
    x = torch.randn(3, 4)
    y = model(x)
    convert_conv1d_to_linear(model, Conv1D)
    assert isinstance(recursive_getattr(model, "0.0"), nn.Linear) and torch.allclose(model(x), y, atol=1e-6)

    assert version.startswith("0.19.8") and torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=1.8) and not required_torch_version(max_version=1.0)
    zero = DeepSpeedZeroConfig(**{"cpu_offload": True, "stage3_prefetch_bucket_size": 12345})
    assert isinstance(zero.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert zero.prefetch_bucket_size == 12345 and DeepSpeedZeroConfig(stage=3).overlap_comm
    cfg = deepspeed.DeepSpeedConfig({"train_batch_size": 2, "tensorboard": {"enabled": True, "job_name": "j"}})
    assert cfg.monitor_config.tensorboard.job_name == "j" and math.isfinite(cfg.gradient_clipping)


@pytest.mark.usefixtures("own_process_group")
def test_tiled_compute_and_safe_set_full_grad() -> None:
    import terascale as deepspeed
    from terascale.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from terascale.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_set_full_grad

    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down, self.head = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 10)

        def mlp(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    m = Model()
    x = torch.randn(2, 13, 8, requires_grad=True)
    ref = m.mlp(x)
    ref.sum().backward()
    x_grad, w_grad = x.grad.clone(), m.up.weight.grad.clone()
    x.grad, m.up.weight.grad = None, None
    out = TiledMLP.apply(Model.mlp, m, x, 4, None)
    out.sum().backward()
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(x.grad, x_grad, atol=1e-6)
    assert torch.allclose(m.up.weight.grad, w_grad, atol=1e-6)
    y = torch.randint(0, 10, (2, 13))

    def loss_fn(self: Model, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(xs), ys, reduction="sum")

    tiled_loss = TiledFusedLogitsLoss.apply(loss_fn, m, x, y, None, 3, None, "sum")
    assert torch.allclose(tiled_loss, loss_fn(m, x.reshape(-1, 8), y.reshape(-1)), atol=1e-5)

    model = nn.Linear(4, 2)
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
              "zero_optimization": {"stage": 2}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.backward(engine(torch.ones(1, 4)).sum())
    before = safe_get_full_fp32_param(model.weight).clone()
    safe_set_full_grad(model.weight, torch.full((2, 4), 0.5))
    assert torch.equal(safe_get_full_grad(model.weight), torch.full((2, 4), 0.5))
    engine.step()
    assert torch.allclose(safe_get_full_fp32_param(model.weight), before - 0.5)
    from terascale.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

    safe_set_local_fp32_param(model.weight, torch.arange(8.0))  # one rank: its part is the whole
    assert torch.equal(safe_get_local_fp32_param(model.weight), torch.arange(8.0))
    assert torch.equal(model.weight.detach().reshape(-1), torch.arange(8.0))


def test_zero3_linear_is_torch_linear_under_autocast_and_torch_func() -> None:
    from terascale.integrations.deepspeed.zero_linear import LinearModuleForZeroStage3, zero3_linear_wrap

    torch.manual_seed(0)
    layer, ref = LinearModuleForZeroStage3(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), ref(x)) and layer(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # the autocast dtype, as DeepSpeed's
    grad = torch.func.grad(lambda w: zero3_linear_wrap(x, w, layer.bias).sum())(layer.weight)
    torch.testing.assert_close(grad, x.sum(0).expand(3, 4))
