"""DeepSpeed's ZeRO-3 parameter attributes, forward-only engines and pinned groups, 2 real ranks.

- [Note: ZeRO-3 parameter attributes]: a stage-3 engine's and a ``zero.Init``'s parameters
  answer ``ds_shape``, ``ds_numel``, ``ds_status`` (live: NOT_AVAILABLE between uses,
  AVAILABLE inside their module's forward and inside ``GatheredParameters``), ``ds_id``,
  ``ds_tensor`` (every rank's together: the whole parameter), ``ds_persist``,
  ``ds_active_sub_modules``, ``partition_numel()``; ZeRO-2 parameters and those of a
  destroyed engine have none; copies are plain parameters; ``torch.compile`` (forward and
  backward) and training (against plain PyTorch) see ordinary parameters.
- Forward-only engines (no optimizer: TRL's reference model): the plain model's outputs
  with the parameters sharded, no masters; backward, step and saving refused by name;
  weights loaded with ``load_module_only``; a scheduler without an optimizer refused.
- [Note: pinned groups] and [Note: the parameter coordinator TRL reads]: a forward inside
  ``GatheredParameters`` over every parameter frees nothing, after TRL's hook removal
  through ``engine.optimizer.parameter_offload`` as before it; the context frees them.

Serially, on this 2-core machine, the file takes about 8 s (one pair of forked ranks; the
compile of a 2-layer module is most of it).
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import pickle

import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks

IN, H = 8, 16
LR = 1e-2


class Net(nn.Module):
    """Two repeated blocks (a group each at ZeRO-3) and a head (the root group)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(IN if i == 0 else H, H), nn.LayerNorm(H)) for i in range(2))
        self.head = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _config(stage: int, optimizer: bool = True, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage,
              "stage3_param_persistence_threshold": 0}, **extra}  # fmt: skip
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    return config


def _gather(obj: object) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _attributes_rank(ckpt: str) -> dict:
    import torch.distributed as dist

    import terascale as ts
    from terascale.zero import GatheredParameters, Init
    from terascale.zero.param_attributes import ZeroParameter, ZeroParamStatus

    r: dict = {}
    rank = int(os.environ["RANK"])  # the group forms in initialize
    full = {n: p.detach().clone() for n, p in _net().named_parameters()}
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(3, 4, IN, generator=g), torch.randn(3, 4, 1, generator=g)

    engine, *_ = ts.initialize(model=_net(), config=_config(3))
    named = dict(engine.module.named_parameters())
    r["types"] = {type(p).__name__ for p in named.values()}
    r["shapes"] = all(p.ds_shape == full[n].shape and p.ds_numel == full[n].numel() for n, p in named.items())
    r["between"] = {p.ds_status for p in named.values()}
    r["ids"] = sorted(p.ds_id for p in named.values()) == list(range(len(named)))
    r["persist"] = all(p.ds_persist == engine.model_state.group_of(p).persistent for p in named.values())
    r["summary"] = all(p.ds_summary()["ds_shape"] == tuple(full[n].shape) and p.ds_summary()["status"] == "NOT_AVAILABLE"
                       for n, p in named.items() if not p.ds_persist)  # fmt: skip
    seen = {}
    block = engine.module.blocks[0]
    weight = block[0].weight

    def during(module, args):
        seen["status"], seen["active"] = weight.ds_status, id(block) in weight.ds_active_sub_modules

    handle = block.register_forward_pre_hook(during)
    # The same training as plain PyTorch on the full batch (per rank: its half).
    ref = _net()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for x, y in zip(xs, ys):
        loss = F.mse_loss(engine(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        losses.append(loss.item())
    handle.remove()
    r["during"] = (seen["status"], seen["active"])
    r["after_step"] = weight.ds_status
    trained = engine.full_state_dict()
    r["trained"] = max((trained[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    # ds_tensor: every rank's part, in rank order, is the whole parameter.
    parts = _gather({n: p.ds_tensor.clone() for n, p in named.items()})
    numels = _gather({n: p.partition_numel() for n, p in named.items()})
    r["ds_tensor"] = all(
        torch.equal(torch.cat([part[n] for part in parts]), trained[n].reshape(-1).to(parts[0][n].dtype))
        and sum(k[n] for k in numels) == p.ds_numel
        for n, p in named.items()
    )
    # TRL's unwrap_model_for_generation: gather everything, "remove the hooks", run forwards.
    offload = engine.optimizer.parameter_offload
    with GatheredParameters(engine.module.parameters()):
        r["inside"] = {p.ds_status for p in named.values()}
        module = offload.module
        for _, p in itertools.chain(module.named_parameters(recurse=True), module.ds_external_parameters()):
            p.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        with torch.no_grad():
            out = [engine.module(xs[0]) for _ in range(2)]  # pinned: nothing freed in between
        r["pinned"] = all(p.numel() == full[n].numel() for n, p in named.items())
        offload._register_deepspeed_module(offload.module)
    r["released"] = ({p.ds_status for p in named.values()}, sum(p.numel() for p in named.values()))
    with torch.no_grad():
        r["generated_like"] = (out[0] - ref(xs[0])).abs().max().item()
    r["copies"] = (type(copy.deepcopy(weight)).__name__, type(pickle.loads(pickle.dumps(weight))).__name__)
    engine.save_checkpoint(ckpt)
    engine.destroy()
    r["destroyed"] = ({type(p).__name__ for p in named.values()}, hasattr(weight, "ds_status"))

    # ZeRO-2: DeepSpeed's parameters have no ds_* attributes there, and neither do these.
    engine2, *_ = ts.initialize(model=_net(), config=_config(2))
    r["zero2"] = (hasattr(engine2.module.head.weight, "ds_numel"), hasattr(engine2.optimizer, "parameter_offload"))
    engine2.destroy()

    # zero.Init: partitioned at construction, the attributes from the Init; then the engine's.
    with Init(config=_config(3)):
        built = _net()
    w = built.head.weight
    r["init"] = (type(w).__name__, w.numel(), w.ds_shape, w.ds_status, w.ds_tensor.numel())
    with GatheredParameters([w]):
        r["init_gathered"] = w.ds_status
    engine3, *_ = ts.initialize(model=built, config=_config(3))
    r["init_engine"] = (type(w).__name__, w.ds_status, w.ds_numel)
    engine3.destroy()

    # A forward-only engine: no optimizer, sharded, the plain model's outputs.
    fwd, optimizer, _, scheduler = ts.initialize(model=_net(), config=_config(3, optimizer=False))
    fwd.eval()
    with torch.no_grad():
        r["fwd_out"] = (fwd(xs[0]) - _net()(xs[0])).abs().max().item()
    memory = fwd.memory_breakdown()
    r["fwd_state"] = (optimizer, scheduler, fwd.optimizer, memory["master_params"], memory["grads"],
                      fwd.module.head.weight.numel(), fwd.module.head.weight.ds_status)  # fmt: skip
    refused = {}
    for what, call in [
        ("backward", lambda: fwd.backward(F.mse_loss(fwd(xs[0]), ys[0]))),
        ("step", fwd.step),
        ("save", lambda: fwd.save_checkpoint(ckpt + "-fwd")),
        ("load", lambda: fwd.load_checkpoint(ckpt)),
    ]:
        try:
            call()
        except ValueError as err:
            refused[what] = str(err)
    r["fwd_refused"] = refused
    fwd.load_checkpoint(ckpt, load_module_only=True)
    with torch.no_grad():
        r["fwd_loaded"] = (fwd(xs[0]) - ref(xs[0])).abs().max().item()
    fwd.destroy()
    try:
        ts.initialize(model=_net(), config={**_config(3, optimizer=False),
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}})  # fmt: skip
    except ValueError as err:
        r["scheduler_alone"] = str(err)

    # torch.compile sees ordinary parameters: forward and backward as eager.
    compiled, eager = _net(), _net()
    for p in compiled.parameters():
        p.__class__ = ZeroParameter
    out_c = torch.compile(compiled, backend="aot_eager", fullgraph=True)(xs[0])
    out_c.pow(2).sum().backward()
    out_e = eager(xs[0])
    out_e.pow(2).sum().backward()
    r["compiled"] = torch.equal(out_c, out_e) and all(
        torch.equal(a.grad, b.grad) for a, b in zip(compiled.parameters(), eager.parameters())
    )
    return r


def test_param_attributes_forward_only_engines_and_pinned_groups(tmp_path):
    from terascale.zero.param_attributes import ZeroParamStatus as S

    for r in run_ranks(_attributes_rank, 2, str(tmp_path / "ckpt")):
        assert r["types"] == {"ZeroParameter"}
        assert r["shapes"] and r["ids"] and r["persist"] and r["summary"] and r["ds_tensor"]
        assert r["between"] == {S.NOT_AVAILABLE} and r["after_step"] is S.NOT_AVAILABLE
        assert r["during"] == (S.AVAILABLE, True)  # live: the group's state inside its forward
        assert r["trained"] < 1e-6  # the training is plain PyTorch's
        assert r["inside"] == {S.AVAILABLE} and r["pinned"] and r["generated_like"] < 1e-6
        assert r["released"] == ({S.NOT_AVAILABLE}, 0)
        assert r["copies"] == ("Parameter", "Parameter")
        assert r["destroyed"] == ({"Parameter"}, False)
        assert r["zero2"] == (False, False)
        name, numel, shape, status, local = r["init"]
        assert (name, numel, tuple(shape), status) == ("ZeroParameter", 0, (1, H), S.NOT_AVAILABLE)
        assert local == math.ceil(H / 2)
        assert r["init_gathered"] is S.AVAILABLE
        assert r["init_engine"] == ("ZeroParameter", S.NOT_AVAILABLE, H)
        assert r["fwd_out"] == 0.0
        assert r["fwd_state"] == (None, None, None, 0, 0, 0, S.NOT_AVAILABLE)
        assert set(r["fwd_refused"]) == {"backward", "step", "save", "load"}
        assert all("forward only" in message for message in r["fwd_refused"].values())
        assert r["fwd_loaded"] < 1e-6
        assert "needs an optimizer" in r["scheduler_alone"]
        assert r["compiled"]
