"""The host step's transfers ([Note: the host step's transfers]): the staging pipeline's
bookkeeping on the CPU's stream stand-ins, and the engine's host step through it, bit for bit
the step without it."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from terascale.offload.transfer import GradientsAhead, HostStepTransfers


def test_gradients_come_down_one_run_ahead_and_values_go_up():
    torch.manual_seed(0)
    runs = [[0, 1], [2], [3, 4]]
    grads = {i: torch.randn(10 + i).bfloat16() for i in range(5)}
    shards = {i: torch.zeros(10 + i, dtype=torch.bfloat16) for i in range(5)}
    asked: list[list[int]] = []

    def grads_of(run: list[int]) -> list[torch.Tensor]:
        asked.append(run)
        return [grads[i] for i in run]

    t = HostStepTransfers(torch.device("cpu"), pin_memory=False, grad_dtype=torch.bfloat16, param_dtype=torch.bfloat16)
    for step in range(3):  # the staging buffers are kept and reused from step to step
        asked.clear()
        t.begin(runs, grads_of)
        assert t.active and asked == [runs[0]]  # the first run's copy starts at once
        for k, run in enumerate(runs):
            got = t.host_grads(run)
            assert asked == runs[: k + 2] if k + 1 < len(runs) else asked == runs  # the next one is under way
            assert all(torch.equal(g, grads[i]) for g, i in zip(got, run))
            outs = t.outputs(run, [grads[i].numel() for i in run])
            for out, g in zip(outs, got):
                out.copy_(g.float() * (step + 2))
            t.upload(run, [shards[i] for i in run])
        t.finish()
        assert not t.active
        for i in range(5):
            assert torch.equal(shards[i], (grads[i].float() * (step + 2)).bfloat16())
    # Two buffers each way, each as large as the largest run asked so far.
    assert t.nbytes() == 2 * 2 * (2 * (13 + 14))
    assert not t.pinned()  # asked for unpinned buffers (there is no accelerator to pin for)


def test_a_run_read_ahead_but_not_stepped_is_dropped_at_finish():
    t = HostStepTransfers(torch.device("cpu"), pin_memory=False, grad_dtype=torch.float32, param_dtype=torch.float32)
    t.begin([[0], [1]], lambda run: [torch.ones(4)])
    t.host_grads([0])  # run 1's copy is now under way
    t.finish()
    t.begin([[0]], lambda run: [torch.ones(4)])
    t.finish()


def test_a_run_goes_down_ahead_once_all_its_groups_are_final_and_is_copied_again_if_forgotten():
    # Pieces (group, lo, hi): run 0 spans groups 0 and 1, run 1 is in group 2.
    pieces = [(0, 0, 4), (1, 2, 6), (2, 0, 3)]
    runs = [[0, 1], [2]]
    shards = {0: torch.arange(4.0), 1: torch.arange(10.0, 16.0), 2: torch.arange(20.0, 23.0)}
    t = HostStepTransfers(torch.device("cpu"), pin_memory=False, grad_dtype=torch.float32, param_dtype=torch.float32)
    ahead = GradientsAhead(t, runs, pieces)
    asked: list[list[int]] = []

    def grads_of(run: list[int]) -> list[torch.Tensor]:
        asked.append(run)
        return [shards[pieces[i][0]][pieces[i][1] : pieces[i][2]] for i in run]

    for forget in (False, True):
        asked.clear()
        ahead.arm()
        ahead.final(2, shards[2])
        ahead.final(0, shards[0])  # run 0 still waits for group 1
        assert t.nbytes() == 4 * (3 if not forget else 11)  # run 1 is down; run buffers are kept
        ahead.final(1, shards[1])
        assert t.nbytes() == 4 * 11
        if forget:  # a gradient changed after backward: the step copies it again
            shards[1][2] = 99.0
            ahead.forget()
        t.begin(runs, grads_of)
        got = [t.host_grads(run) for run in runs]
        t.finish()
        assert t.ahead_runs == (0 if forget else 2) and asked == (runs if forget else [])
        assert torch.equal(got[0][1], shards[1][2:6]) and torch.equal(got[1][0], shards[2])


def _engine_rank(configs: list[dict], staged: bool, set_grads: bool = False) -> list[dict]:
    import terascale
    from terascale.integrations.deepspeed.params import safe_get_full_grad, safe_set_full_grad
    from terascale.offload import transfer

    if staged:  # the pipeline where the shards and the host are apart; here on the CPU's stand-ins
        transfer.HostStepTransfers.needed = staticmethod(lambda device: True)
    out = []
    for config in configs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        engine, *_ = terascale.initialize(model=model, config=config)
        assert (engine.model_state.host_transfers is not None) == staged
        g = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(4):
            x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
            dtype = next(engine.module.parameters()).dtype
            loss = (engine(x.to(dtype)).float() - y).square().mean()
            engine.backward(loss)
            if set_grads:  # after backward: the copies made ahead are stale
                for p in engine.module.parameters():
                    safe_set_full_grad(p, safe_get_full_grad(p) * torch.linspace(0.1, 2.0, p.numel()).view(p.shape))
            engine.step()
            losses.append(loss.item())
        transfers = engine.model_state.host_transfers
        ahead = None if transfers is None else transfers.ahead_runs
        out.append({"losses": losses, "params": {n: p.clone() for n, p in engine.full_state_dict().items()}, "ahead": ahead})
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_host_step_through_the_pipeline_is_the_step(stage):
    def config(optimizer: str = "AdamW", **bf16) -> dict:
        return {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 0.5,
            "optimizer": {"type": optimizer, "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "sub_group_size": 1000, "offload_optimizer": {"device": "cpu"}},
            **({"bf16": {"enabled": True, **bf16}} if bf16 else {}),
        }

    configs = [config(), config("AdamW8bit"), config(bf16_master_weights_and_grads=True, bf16_optimizer_states=True),
               config(enabled=True), config("SGD")]  # fmt: skip
    plain = run_ranks(_engine_rank, 2, configs, False)
    staged = run_ranks(_engine_rank, 2, configs, True)
    for a, b in zip(plain, staged):
        for x, y in zip(a, b):
            assert x["losses"] == y["losses"]
            assert all(torch.equal(x["params"][n], y["params"][n]) for n in x["params"])
            assert y["ahead"] > 0  # every run's gradients went down under backward
    # Gradients set between backward and the step: the copies made ahead are dropped.
    plain = run_ranks(_engine_rank, 2, configs[:1], False, True)
    staged = run_ranks(_engine_rank, 2, configs[:1], True, True)
    for a, b in zip(plain, staged):
        assert a[0]["losses"] == b[0]["losses"] and b[0]["ahead"] == 0
        assert all(torch.equal(a[0]["params"][n], b[0]["params"][n]) for n in a[0]["params"])
