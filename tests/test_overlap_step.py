"""The host step overlapped with the next window ([Note: the overlapped host step]): against a
plain-PyTorch delayed parameter update on every stage and tier, exact resume, a step that fails
its checks never started, the state's readers waiting for it, and the configs it refuses."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from distributed import run_ranks
from state_tiers import batches, model, tiers_rank, train

WORLD = 2


def _config(stage: int, device: str, tmp: str, *, overlap: bool = True, accumulation: int = 1, clip: float = 0.0,
            optimizer: str = "AdamW", bf16: bool = False, all_on_disk: bool = False, warmup: int = 0) -> dict:  # fmt: skip
    """``all_on_disk``: the parameter shards on NVMe too, and the gradient shards swapped (the
    optimizer's run buffers too few to hold them). ``warmup``: synchronous steps first."""
    offload = {"device": device, "overlap_step": overlap, "overlap_step_warmup": warmup}
    if device == "nvme":
        os.makedirs(tmp, exist_ok=True)
        offload["nvme_path"] = tmp
    zero = {"stage": stage, "sub_group_size": 1500, "offload_optimizer": offload}
    if all_on_disk:
        offload["buffer_count"] = 2
        zero["sub_group_size"] = 1000
        zero["offload_param"] = {"device": "nvme", "nvme_path": tmp, "max_in_cpu": 0}
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                    **({"momentum": 0.9} if optimizer == "SGD" else {})}},
        "zero_optimization": zero,
        **({"bf16": {"enabled": True}} if bf16 else {}),
    }


def _train_rank(configs: list[dict], steps: int, apart: bool = False) -> list[dict]:
    """Per config: ``steps`` optimizer steps; the losses, the full parameters, the seconds
    waited for the background step and how many it ran. ``apart``: the copies to and from
    the host go the way they go on an accelerator (a copy stream, events: the CPU's
    stand-ins), not by exchanging the shards."""
    import torch.distributed as dist

    import terascale
    from terascale.offload import transfer

    if apart:
        transfer.HostStepTransfers.needed = staticmethod(lambda device: True)

    out = []
    for config in configs:
        config = dict(config)
        warmup = config.pop("lambda_warmup", None)  # a torch LambdaLR, stepped by the engine
        schedule = None if warmup is None else (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
        engine, *_ = terascale.initialize(model=model(), config=config, lr_scheduler=schedule)
        accumulation = config["gradient_accumulation_steps"]
        losses = train(engine, batches(dist.get_rank(), steps * accumulation))
        overlap = engine.model_state.overlap
        ran = None if overlap is None else overlap.steps
        assert overlap is None or overlap.copies_apart == apart
        params = {n: p.clone() for n, p in engine.full_state_dict().items()}
        waits = engine.model_state.wait_breakdown()
        numel = sum(p.hi - p.lo for p in engine.model_state.masters.pieces)
        buffers = engine.memory_breakdown()["offload_buffers"]
        engine.destroy()
        out.append({"losses": losses, "params": params, "ran": ran, "waits": waits, "numel": numel, "buffers": buffers})
    return out


def _delayed_reference(
    steps: int, accumulation: int, clip: float, optimizer: str = "AdamW", warmup=None, synchronous: int = 0
) -> tuple[list[list[float]], dict]:
    """Plain PyTorch: the model's gradients averaged over the ranks' batches; at each
    boundary the masters of the previous update go into the model, then the masters take
    this window's update (ZeRO-Offload's delayed parameter update); the first
    ``synchronous`` updates go into the model at once. Losses per rank."""
    net = model()
    masters = [p.detach().clone() for p in net.parameters()]
    if optimizer == "SGD":
        opt = torch.optim.SGD(masters, lr=1e-2, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    schedule = None if warmup is None else torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    data = [batches(r, steps * accumulation) for r in range(WORLD)]
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    for t in range(steps):
        for m in range(accumulation):
            for r in range(WORLD):
                x, y = data[r][t * accumulation + m]
                loss = (net(x) - y).square().mean()
                (loss / (WORLD * accumulation)).backward()
                losses[r].append(loss.item())
        grads = [p.grad.clone() for p in net.parameters()]
        if clip > 0:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            grads = [g * min(1.0, clip / (float(norm) + 1e-6)) for g in grads]
        with torch.no_grad():
            for p, w in zip(net.parameters(), masters):
                p.copy_(w)  # the update of the window before
        for w, g in zip(masters, grads):
            w.grad = g
        opt.step()
        if t < synchronous:
            with torch.no_grad():
                for p, w in zip(net.parameters(), masters):
                    p.copy_(w)
        if schedule is not None:
            schedule.step()
        net.zero_grad()
    names = [n for n, _ in net.named_parameters()]
    return losses, dict(zip(names, masters))


# (stage, tier, accumulation, clipping, optimizer): SGD steps through its own step() on the
# masters (no fused host step), its new values staged whole.
CASES = [(1, "cpu", 1, 0.0, "AdamW"), (2, "cpu", 2, 0.0, "AdamW"), (3, "cpu", 1, 0.5, "AdamW"),
         (2, "nvme", 1, 0.5, "AdamW"), (3, "nvme", 2, 0.0, "AdamW"), (2, "cpu", 1, 0.5, "SGD")]
SCHEDULED = (2, 5)  # cases with a torch LR scheduler (LambdaLR) passed to initialize


def _warmup(step: int) -> float:
    return (step + 1) / 4


def test_the_overlapped_step_is_the_delayed_parameter_update_on_every_stage_and_tier(tmp_path):
    steps = 5
    configs = [_config(s, d, str(tmp_path / f"c{k}"), accumulation=a, clip=c, optimizer=o)
               for k, (s, d, a, c, o) in enumerate(CASES)]  # fmt: skip
    sync = [_config(s, d, str(tmp_path / f"s{k}"), overlap=False, accumulation=a, clip=c, optimizer=o)
            for k, (s, d, a, c, o) in enumerate(CASES)]  # fmt: skip
    for k in SCHEDULED:  # the learning rate changes every step: the update takes the boundary's
        configs[k]["lambda_warmup"] = sync[k]["lambda_warmup"] = _warmup
    results = run_ranks(_train_rank, WORLD, configs + sync, steps)
    for k, (stage, device, accumulation, clip, optimizer) in enumerate(CASES):
        ref_losses, ref_params = _delayed_reference(steps, accumulation, clip, optimizer, _warmup if k in SCHEDULED else None)
        for rank in range(WORLD):
            got = results[rank][k]
            assert got["ran"] == steps
            assert "host_step" in got["waits"]
            torch.testing.assert_close(got["losses"], ref_losses[rank], rtol=2e-5, atol=1e-6)
            for name, value in ref_params.items():
                torch.testing.assert_close(got["params"][name], value, rtol=2e-5, atol=2e-6, msg=f"{CASES[k]} {name}")
        # The host holds the window's gradients and the staged parameters (fp32 both): 8
        # bytes an element of the rank's shard, counted in the memory breakdown.
        for rank in range(WORLD):
            over, plain = results[rank][k], results[rank][len(CASES) + k]
            if device == "cpu":
                assert over["buffers"] - plain["buffers"] == 8 * over["numel"]
        # Not the synchronous trajectory: the second window ran on the first one's parameters.
        sync_losses = results[0][len(CASES) + k]["losses"]
        assert sync_losses[:accumulation] == results[0][k]["losses"][:accumulation]
        assert sync_losses[-1] != results[0][k]["losses"][-1]


def test_everything_on_disk_the_update_writes_second_files(tmp_path):
    """Stage 3 with parameters, optimizer state and gradients all in swap files: the
    update reads one window's gradient files while the next window writes the other set,
    and writes the new parameters into each group's second file; the same delayed update."""
    steps = 5
    for accumulation, clip in ((1, 0.5), (2, 0.0)):
        config = _config(3, "nvme", str(tmp_path / f"a{accumulation}"), accumulation=accumulation, clip=clip,
                         all_on_disk=True)  # fmt: skip
        results = run_ranks(_disk_rank, WORLD, config, steps)
        ref_losses, ref_params = _delayed_reference(steps, accumulation, clip)
        for rank in range(WORLD):
            got = results[rank]
            assert got["grad_files"] and got["param_files"], got
            torch.testing.assert_close(got["losses"], ref_losses[rank], rtol=2e-5, atol=1e-6)
            for name, value in ref_params.items():
                torch.testing.assert_close(got["params"][name], value, rtol=2e-5, atol=2e-6)


def _disk_rank(config: dict, steps: int) -> dict:
    import torch.distributed as dist

    import terascale
    from terascale.zero import overlap_step

    overlap_step.host_room = lambda: 0  # as on a host that cannot hold the new parameters: second files

    engine, *_ = terascale.initialize(model=model(), config=config)
    state = engine.model_state
    losses = train(engine, batches(dist.get_rank(), steps * config["gradient_accumulation_steps"]))
    out = {"losses": losses, "grad_files": state.grads.swapper is not None and state.overlap.nbytes_on_disk() > 0,
           "param_files": state.overlap.second_files > 0 and state.params.nbytes_on_disk() > 0,
           "params": {n: p.clone() for n, p in engine.full_state_dict().items()}}  # fmt: skip
    engine.destroy()
    return out


def test_the_accelerators_copy_path_gives_the_same_bits(tmp_path):
    """Gradients and parameters through host buffers and a copy stream (an accelerator's
    way, on the CPU's stand-ins) against the shards exchanged in place."""
    cases = [CASES[0], CASES[2], CASES[4]]
    configs = [_config(s, d, str(tmp_path / f"c{k}"), accumulation=a, clip=c, optimizer=o)
               for k, (s, d, a, c, o) in enumerate(cases)]  # fmt: skip
    direct = run_ranks(_train_rank, WORLD, configs, 4)
    copied = run_ranks(_train_rank, WORLD, configs, 4, True)
    for a, b in zip(direct, copied):
        for x, y in zip(a, b):
            assert x["losses"] == y["losses"]
            assert all(torch.equal(x["params"][n], y["params"][n]) for n in x["params"])


def test_the_first_steps_warm_up_synchronously_then_overlap_also_after_a_resume(tmp_path):
    steps, warmup = 6, 3
    results = run_ranks(_train_rank, WORLD, [_config(2, "cpu", str(tmp_path), warmup=warmup),
                                             _config(2, "cpu", str(tmp_path), overlap=False)], steps)  # fmt: skip
    ref_losses, ref_params = _delayed_reference(steps, 1, 0.0, synchronous=warmup)
    for rank in range(WORLD):
        over, sync = results[rank]
        assert over["losses"][: warmup + 1] == sync["losses"][: warmup + 1]  # the synchronous step's, bit for bit
        assert over["losses"][-1] != sync["losses"][-1]
        torch.testing.assert_close(over["losses"], ref_losses[rank], rtol=2e-5, atol=1e-6)
        for name, value in ref_params.items():
            torch.testing.assert_close(over["params"][name], value, rtol=2e-5, atol=2e-6)
    # Saved after 3 of the 4 warm-up steps: the resumed run warms up one step more, as the run did.
    got = run_ranks(tiers_rank, WORLD, [_config(2, "cpu", str(tmp_path), warmup=4)], str(tmp_path / "ckpt"))
    for rank in range(WORLD):
        assert got[rank][0]["resumed_equal"] and got[rank][0]["resumed"] == got[rank][0]["losses"][3:]


def test_bf16_with_bf16_states_overlapped_trains_like_the_synchronous_step(tmp_path):
    """bf16 compute, masters and moments: the trajectory stays within bf16 noise of the
    synchronous one (a step of delay is all that differs) and ends lower than it started."""
    steps = 8
    cfg = lambda overlap: {**_config(2, "cpu", str(tmp_path), overlap=overlap, bf16=True),
                           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                    "bf16_optimizer_states": True}}  # fmt: skip
    over, sync = run_ranks(_train_rank, WORLD, [cfg(True), cfg(False)], steps)[0]
    assert over["ran"] == steps
    assert over["losses"][-1] < over["losses"][0]
    assert abs(over["losses"][-1] - sync["losses"][-1]) < 0.1 * sync["losses"][0]


@pytest.mark.parametrize("stage,device,all_on_disk", [(2, "cpu", False), (3, "nvme", False), (3, "nvme", True)])
def test_a_checkpoint_waits_for_the_update_and_resumes_exactly(tmp_path, stage, device, all_on_disk):
    configs = [_config(stage, device, str(tmp_path / "swap"), all_on_disk=all_on_disk)]
    result = run_ranks(_tiers_without_room if all_on_disk else tiers_rank, WORLD, configs, str(tmp_path / "ckpt"))
    for rank in range(WORLD):
        got = result[rank][0]
        assert got["resumed_equal"]
        assert got["resumed"] == got["losses"][3:]


def _tiers_without_room(configs: list[dict], save_dir: str) -> list[dict]:
    """``tiers_rank`` as on a host that cannot hold the new parameters (second files)."""
    from terascale.zero import overlap_step

    overlap_step.host_room = lambda: 0
    return tiers_rank(configs, save_dir)


def _overflow_rank(config: dict, poisoned: int | None, drop: int | None) -> dict:
    """fp16 overlapped training over 6 batches: ``poisoned`` makes that step's gradients
    infinite (the step is skipped), ``drop`` leaves that batch out."""
    import torch.distributed as dist

    import terascale

    engine, *_ = terascale.initialize(model=model(), config=config)
    data = batches(dist.get_rank(), 6)
    losses, scales = [], []
    for t, (x, y) in enumerate(data):
        if t == drop:
            continue
        loss = (engine(x.half()).float() - y).square().mean()
        engine.backward(loss * float("inf") if t == poisoned else loss)
        started = engine.model_state.overlap.steps
        engine.step()
        # Nothing was started for it (the update before stays pending, not installed).
        assert engine.model_state.overlap.steps == started + (t != poisoned)
        assert engine.model_state.overlap.pending
        losses.append(loss.item())
        scales.append(engine.loss_scale)
    out = {"losses": losses, "skipped": engine.skipped_steps, "scales": scales,
           "params": {n: p.clone() for n, p in engine.full_state_dict().items()}}  # fmt: skip
    engine.destroy()
    return out


def test_a_step_that_overflows_is_never_started_and_training_goes_on_as_without_its_batch(tmp_path):
    config = {**_config(2, "cpu", str(tmp_path)), "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    poisoned = run_ranks(_overflow_rank, WORLD, config, 2, None)
    dropped = run_ranks(_overflow_rank, WORLD, config, None, 2)
    for a, b in zip(poisoned, dropped):
        assert a["skipped"] == 1 and b["skipped"] == 0
        assert a["scales"][2] == a["scales"][1] / 2  # the overflow halved the scale
        del a["losses"][2]
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def _failing_rank(config: dict) -> str:
    import terascale
    from terascale.offload import host_adam

    engine, *_ = terascale.initialize(model=model(), config=config)
    data = batches(0, 3)
    train(engine, data[:1])

    def broken(*args, **kwargs):
        raise OSError("disk gone")

    engine.model_state.settle()  # the first window's update is in
    host_adam.step = broken  # the background step of the second window fails
    x, y = data[1]
    loss = (engine(x) - y).square().mean()
    engine.backward(loss)
    engine.step()  # starts it: the failure shows at the next boundary
    x, y = data[2]
    engine.backward((engine(x) - y).square().mean())
    try:
        engine.step()
    except RuntimeError as error:
        return str(error)
    finally:
        engine.destroy()
    return "no error"


def test_a_failure_in_the_background_step_is_raised_at_the_next_boundary(tmp_path):
    message = run_ranks(_failing_rank, 1, _config(2, "cpu", str(tmp_path)))[0]
    assert "overlap_step" in message and "disk gone" in message


def _build_rank(config: dict, optimizer: str | None) -> str:
    import terascale

    try:
        kwargs = {}
        if optimizer == "lamb":
            config = copy.deepcopy(config)
            config["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
        engine, *_ = terascale.initialize(model=model(), config=config, **kwargs)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    engine.destroy()
    return "built"


def test_what_the_overlapped_step_refuses(tmp_path):
    base = _config(2, "cpu", str(tmp_path))
    ratio = copy.deepcopy(base)
    ratio["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    nowhere = copy.deepcopy(base)
    nowhere["zero_optimization"]["offload_optimizer"] = {"device": "none", "overlap_step": True}
    in_backward = copy.deepcopy(_config(2, "nvme", str(tmp_path)))
    in_backward["zero_optimization"]["offload_optimizer"]["step_in_backward"] = True
    results = [run_ranks(_build_rank, 1, c, o)[0] for c, o in
               [(ratio, None), (nowhere, None), (in_backward, None), (base, "lamb")]]  # fmt: skip
    assert "ratio 0.5" in results[0] and "overlap_step" in results[0]
    assert "overlap_step" in results[1] and "'cpu' or 'nvme'" in results[1]
    assert "step_in_backward is true" in results[2] and "overlap_step" in results[2]
    assert "Lamb" in results[3] and "overlap_step" in results[3]
    # "auto" (the default) with NVMe leaves the step to the overlap, without a word.
    assert run_ranks(_build_rank, 1, _config(2, "nvme", str(tmp_path)), None)[0] == "built"
