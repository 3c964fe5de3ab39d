"""The optimizer step under backward ([Note: the optimizer step under backward]): with NVMe
optimizer state, each run stepped under the window's last backward gives the same model,
bit for bit, as the step after backward; it turns itself off (or refuses) where something
decides about the update after backward, and what would read the state in between raises."""

from __future__ import annotations

import pytest

from distributed import run_ranks

STEPS = 3
# Set in a rank with a slow model: waits for the engine's queued reads (see Slow).
_SETTLE: list = []


def _model(frozen: bool = False, slow: bool = False):
    import time

    import torch
    import torch.nn.functional as F
    from torch import nn

    class Slow(torch.autograd.Function):
        """The identity, whose backward takes 100 ms and then lets the I/O settle (see
        ``settle`` in ``_train``): the disk's reads keep up, however loaded the machine is."""

        @staticmethod
        def forward(ctx, h):
            return h.view_as(h)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(0.1)
            for settle in _SETTLE:
                settle()
            return grad

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(5))
            self.norm = nn.LayerNorm(32)
            self.head = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = x
            for layer in self.layers:
                h = h + F.gelu(layer(Slow.apply(h) if slow else h))
            return F.cross_entropy(self.head(self.norm(h)).float(), y)

    torch.manual_seed(0)
    net = Net()
    if frozen:  # a frozen parameter beside trainable ones in a module (as an adapter's base weights)
        net.layers[1].bias.requires_grad_(False)
    return net


def _config(path: str, case: dict, mode: object) -> dict:
    zero = {"stage": case["stage"], "sub_group_size": case.get("sub", 600), "reduce_bucket_size": 2000,
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 2, "step_in_backward": mode,
                                  **case.get("opt", {})},
            **case.get("zero", {})}  # fmt: skip
    if case.get("params"):
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0, "buffer_count": 3}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": case.get("gas", 1),
        "bf16": {"enabled": case.get("bf16", False)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def _data(step: int, micro: int):
    import os

    import torch

    g = torch.Generator().manual_seed(1000 * step + 10 * micro + int(os.environ["RANK"]))
    return torch.randn(4, 32, generator=g), torch.randint(0, 4, (4,), generator=g)


def _train(path: str, case: dict, mode: object) -> dict:
    import torch
    from torch import nn

    import terascale
    from terascale.zero import WrapPolicy

    config = _config(path, case, mode)
    engine, *_ = terascale.initialize(model=_model(case.get("frozen", False), case.get("slow", False)), config=config,
                                      wrap_policy=WrapPolicy(module_classes=(nn.Linear,)))  # fmt: skip
    state = engine.model_state
    if case.get("slow") and state.swap_io is not None:
        # The disk keeping pace, whatever the machine's load: the queued writes finish, the
        # buffers they free start their reads (the stepper's poll would at its next
        # gradient hook, which for the last run comes too late), and those finish too.
        def settle() -> None:
            state.swap_io.synchronize()
            if state.early is not None:
                state.early.poll()
            state.swap_io.synchronize()

        _SETTLE[:] = [settle]
    gas = case.get("gas", 1)
    losses, stepped, grad_written = [], [], []
    for s in range(STEPS):
        for m in range(gas):
            x, y = _data(s, m)
            if case.get("bf16"):
                x = x.bfloat16()
            loss = engine(x, y)
            engine.backward(loss)
            losses.append(loss.item())
            if m == gas - 1:
                stepped.append(0 if state.early is None else state.early.stepped)
                grads = state.grads.swapper
                grad_written.append(grads is not None and any(grads._on_disk))
            engine.step()
    out = {
        "losses": losses,
        "state": engine.full_state_dict(),
        "on": engine.steps_in_backward,
        "stepped": stepped,
        "runs": len(state.masters.runs),
        "grads_swapped": state.grads.swapper is not None,
        "grad_files_written": grad_written,
    }
    engine.destroy()
    return out


def _both_modes(path: str, cases: list[dict]) -> list[tuple[dict, dict]]:
    return [(_train(path, case, False), _train(path, case, "auto")) for case in cases]


CASES = [
    # bf16 stage 2, gradients swapped to disk ([Note: gradient swapping]), one window of 2.
    {"stage": 2, "bf16": True, "gas": 2},
    # fp32 stage 2, runs spanning two groups, gradients in memory (4 buffers hold them).
    {"stage": 2, "sub": 1200, "opt": {"buffer_count": 4}},
    # stage 3, parameters on NVMe too, bf16, three micro-steps, every group sharded.
    {"stage": 3, "bf16": True, "gas": 3, "params": True, "zero": {"stage3_param_persistence_threshold": 0}},
    # stage 3 fp32, small groups persistent (stage 3's default threshold), half the runs on NVMe.
    {"stage": 3, "opt": {"ratio": 0.5}, "params": True},
    # stage 2 with a frozen bias (a group of its own beside its layer's weight).
    {"stage": 2, "frozen": True},
]


def test_the_step_under_backward_is_bit_identical_to_the_step_after_it(tmp_path):
    import torch

    results = run_ranks(_both_modes, 2, str(tmp_path), CASES)
    for rank_results in results:
        for case, (off, on) in zip(CASES, rank_results):
            assert not off["on"] and on["on"], case
            assert off["losses"] == on["losses"], case
            assert off["state"].keys() == on["state"].keys()
            for name, value in off["state"].items():
                assert torch.equal(value, on["state"][name]), (case, name)
            # How many runs backward steps depends on when their reads finish (see the next test).
            assert off["stepped"] == [0] * STEPS and all(n <= on["runs"] for n in on["stepped"])
            # Final gradient shards went to the optimizer, not to disk (with one micro-step;
            # earlier micro-steps of a window still accumulate on disk).
            if on["grads_swapped"] and case.get("gas", 1) == 1:
                assert on["grad_files_written"] == [False] * STEPS
            if off["grads_swapped"]:
                assert all(off["grad_files_written"])
    assert any(off["grads_swapped"] for off, _ in results[0])  # the cases reach gradient swapping
    assert not any((tmp_path / "terascale_swap").rglob("*.swp"))


@pytest.mark.alone  # the disk's reads must keep pace with a 100 ms backward (see conftest.py)
def test_a_backward_slower_than_the_disk_steps_every_run(tmp_path):
    # Every layer's backward takes 100 ms and four buffers read ahead: the reads finish
    # before each run's gradients are final, so all runs are stepped under backward,
    # including the first layer's (whose gradient is final last); engine.step() steps none.
    case = {"stage": 3, "bf16": True, "params": True, "slow": True, "opt": {"buffer_count": 4},
            "zero": {"stage3_param_persistence_threshold": 0}}
    (got,) = run_ranks(_train, 1, str(tmp_path), case, "auto")
    assert got["stepped"] == [got["runs"]] * STEPS, got["stepped"]
    assert got["grads_swapped"] and got["grad_files_written"] == [False] * STEPS


def _refusal_rank(path: str) -> list:
    import torch
    from torch import nn

    import terascale

    base = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": path}}
    settings = [
        ("gradient_clipping", {"gradient_clipping": 1.0}, base),
        ("fp16", {"fp16": {"enabled": True, "loss_scale": 128}}, base),
        ("fp16", {"fp16": {"enabled": True}}, base),
        ("health.non_finite", {"health": {"non_finite": {"policy": "skip"}}}, base),
        ("stage 2 or 3", {}, {**base, "stage": 1}),
        ("device 'nvme'", {}, {"stage": 3, "offload_optimizer": {"device": "cpu"}}),
        ("Lamb", {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, base),
    ]
    out = []
    for reason, extra, zero in settings:
        for mode in ("auto", True):
            offload = {**zero["offload_optimizer"], "step_in_backward": mode}
            config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                      **extra, "zero_optimization": {**zero, "offload_optimizer": offload}}  # fmt: skip
            try:
                engine, *_ = terascale.initialize(model=nn.Linear(8, 8), config=config)
            except ValueError as exc:
                out.append((reason, mode, "error", str(exc)))
                continue
            out.append((reason, mode, "on" if engine.steps_in_backward else "off", ""))
            x = torch.randn(2, 8, dtype=next(engine.module.parameters()).dtype)
            engine.backward(engine(x).float().square().mean())
            engine.step()
            engine.destroy()
    return out


def test_it_turns_itself_off_or_refuses_where_the_step_decides_after_backward(tmp_path):
    (results,) = run_ranks(_refusal_rank, 1, str(tmp_path))
    for reason, mode, outcome, message in results:
        if mode == "auto":
            if reason == "Lamb":  # refused with NVMe optimizer state whatever the mode
                assert outcome == "error" and "Lamb" in message, message
            else:
                assert outcome == "off", (reason, outcome, message)
        else:
            assert outcome == "error", (reason, outcome)
            assert reason in message, (reason, message)
            if reason != "Lamb":
                assert "step_in_backward is true" in message, message


def _between_rank(path: str) -> dict:
    import terascale
    from terascale.integrations.deepspeed.params import safe_get_full_fp32_param, safe_get_full_grad

    case = {"stage": 2, "opt": {"buffer_count": 16}}  # gradients in memory: readable without the mode
    out: dict = {}
    for mode in (False, "auto"):
        model = _model(slow=True)  # slow backward: runs are stepped in it
        engine, *_ = terascale.initialize(model=model, config=_config(path, case, mode))
        x, y = _data(0, 0)
        engine.backward(engine(x, y))
        for name, read in (("grad", safe_get_full_grad), ("param", safe_get_full_fp32_param)):
            try:
                read(model.layers[0].weight)
                out[name, mode] = "read"
            except RuntimeError as exc:
                out[name, mode] = str(exc)
        out["norm", mode] = float(engine.window_grad_norm())  # taken as the shards became final
        engine.step()
        out["after_step", mode] = tuple(safe_get_full_fp32_param(model.layers[0].weight).shape)
        if mode == "auto":
            # The learning rate the step uses is fixed by the backward.
            engine.backward(engine(x, y))
            engine.optimizer.param_groups[0]["lr"] = 1.0
            try:
                engine.step()
                out["lr"] = "stepped"
            except RuntimeError as exc:
                out["lr"] = str(exc)
            engine.optimizer.param_groups[0]["lr"] = 1e-2
            engine.zero_grad()  # that window's step failed: drop it
            # zero_grad after a backward that stepped runs raises; training goes on after it.
            engine.backward(engine(x, y))
            out["stepped"] = engine.model_state.early.stepped
            try:
                engine.zero_grad()
                out["zero_grad"] = "dropped"
            except RuntimeError as exc:
                out["zero_grad"] = str(exc)
            engine.backward(engine(x, y))
            engine.step()
        engine.destroy()
    return out


def test_reading_the_state_between_backward_and_step_is_an_error(tmp_path):
    (got,) = run_ranks(_between_rank, 1, str(tmp_path))
    assert got["grad", False] == got["param", False] == "read"
    for key in (("grad", "auto"), ("param", "auto"), "lr", "zero_grad"):
        assert "step_in_backward" in got[key], (key, got[key])
    assert "consumes the gradients" in got["grad", "auto"]
    assert "changed between the window's last backward and engine.step()" in got["lr"]
    assert got["stepped"] > 0
    assert got["norm", False] == got["norm", "auto"] > 0
    assert got["after_step", False] == got["after_step", "auto"] == (32, 32)


def _checkpoint_rank(path: str, ckpt: str) -> dict:
    import torch

    import terascale

    case = {"stage": 3, "bf16": True, "params": True, "gas": 2, "zero": {"stage3_param_persistence_threshold": 0}}

    def build(mode: object):
        from torch import nn

        from terascale.zero import WrapPolicy

        engine, *_ = terascale.initialize(model=_model(), config=_config(path, case, mode),
                                          wrap_policy=WrapPolicy(module_classes=(nn.Linear,)))  # fmt: skip
        return engine

    def train(engine, steps: range) -> list[float]:
        losses = []
        for s in steps:
            for m in range(2):
                x, y = _data(s, m)
                loss = engine(x.bfloat16(), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses

    first = build("auto")
    train(first, range(2))
    first.save_checkpoint(ckpt, tag="t")
    expected = train(first, range(2, 4))
    want = first.full_state_dict()
    first.destroy()
    out = {}
    for mode in ("auto", False):
        again = build(mode)
        again.load_checkpoint(ckpt, tag="t")
        out[mode] = train(again, range(2, 4)) == expected and all(
            torch.equal(v, want[k]) for k, v in again.full_state_dict().items()
        )
        again.destroy()
    return out


def test_a_checkpoint_saved_after_a_step_in_backward_resumes_exactly(tmp_path):
    (tmp_path / "swap").mkdir()
    for got in run_ranks(_checkpoint_rank, 2, str(tmp_path / "swap"), str(tmp_path / "ckpt")):
        assert got == {"auto": True, False: True}


@pytest.mark.parametrize("value", ["maybe", 2])
def test_the_setting_is_checked(value):
    from terascale.config import Config, ConfigError

    with pytest.raises(ConfigError, match="step_in_backward"):
        Config.load({"zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "nvme", "nvme_path": "/tmp", "step_in_backward": value}}})  # fmt: skip
