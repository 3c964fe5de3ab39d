"""LR schedules against their closed-form DeepSpeed formulas, written out independently."""

from __future__ import annotations

import math

import pytest
import torch

from terascale.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def sgd(lr=0.5, groups=1, momentum=0.0):
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]}
                            for _ in range(groups)], lr=lr, momentum=momentum)


def adam(lr=0.5, betas=(0.9, 0.999)):
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=betas)


def trace(schedule, opt, iterations):
    """LR of group 0 after construction (key -1) and after each step (key = iteration)."""
    out = {-1: opt.param_groups[0]["lr"]}
    for i in range(max(iterations) + 1):
        schedule.step()
        assert schedule.last_batch_iteration == i
        assert schedule.get_last_lr() == [g["lr"] for g in opt.param_groups]
        out[i] = opt.param_groups[0]["lr"]
    return out


# ---- WarmupLR -------------------------------------------------------------------------

def warmup_ref(i, lo, hi, n, kind):
    if i < 0:
        return lo
    if i >= n:
        return hi
    frac = math.log(i + 1) / math.log(n) if kind == "log" else i / n
    return lo + (hi - lo) * frac


CHECKPOINTS = [-1, 0, 1, 5, 9, 10, 11, 25]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    opt = sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10,
                     warmup_type=kind)
    got = trace(sched, opt, CHECKPOINTS)
    for i in CHECKPOINTS:
        assert got[i] == pytest.approx(warmup_ref(i, 0.01, 0.1, 10, kind), rel=1e-12), i
    assert got[-1] == 0.01 and got[0] == 0.01  # log(1) = 0 and 0 / N = 0
    assert got[10] == 0.1 and got[25] == 0.1


def test_warmup_lr_defaults_and_clamped_length():
    opt = sgd(lr=0.3)
    sched = WarmupLR(opt, warmup_num_steps=1, warmup_type="linear")  # max_lr = group lr
    got = trace(sched, opt, [0, 1, 2, 3])
    # warmup_num_steps is clamped to 2 as in DeepSpeed: i=1 is mid-warmup.
    assert [got[i] for i in (-1, 0, 1, 2)] == pytest.approx([0.0, 0.0, 0.15, 0.3])


def test_warmup_lr_per_group_values_and_tensor_lr():
    opt = sgd(groups=2)
    lr_tensor = torch.tensor(0.5)
    opt.param_groups[1]["lr"] = lr_tensor
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2],
                     warmup_num_steps=4, warmup_type="linear")
    for _ in range(3):
        sched.step()  # iteration 2 of 4
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    assert opt.param_groups[1]["lr"] is lr_tensor  # updated in place, still a tensor
    assert lr_tensor.item() == pytest.approx(0.15)


# ---- WarmupDecayLR --------------------------------------------------------------------

def warmup_decay_ref(i, lo, hi, n, total, kind):
    if i < n:
        return warmup_ref(i, lo, hi, n, kind)
    gamma = max(0.0, (total - i) / max(1.0, total - n))
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    opt = sgd()
    sched = WarmupDecayLR(opt, total_num_steps=30, warmup_min_lr=0.01, warmup_max_lr=0.1,
                          warmup_num_steps=10, warmup_type=kind)
    points = [-1, 0, 1, 5, 9, 10, 20, 29, 30, 31, 45]
    got = trace(sched, opt, points)
    for i in points:
        assert got[i] == pytest.approx(warmup_decay_ref(i, 0.01, 0.1, 10, 30, kind),
                                       rel=1e-12), i
    assert got[10] == pytest.approx(0.1)
    assert got[20] == pytest.approx(0.055)  # halfway down
    assert got[30] == pytest.approx(0.01) and got[45] == pytest.approx(0.01)


def test_warmup_decay_default_max_lr_is_deepspeeds():
    opt = sgd(lr=0.7)
    sched = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=10)
    for _ in range(11):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * 90 / 90)


# ---- WarmupCosineLR -------------------------------------------------------------------

def cosine_ref(i, base, n, total, wmin, cmin, kind):
    if i < 0:
        return 0.0
    if i < n:
        frac = math.log(i + 1) / math.log(n) if kind == "log" else i / n
        return base * (wmin + (1 - wmin) * frac)
    progress = min(1.0, (i - n + 1) / max(1, total - n))
    return base * max(0.0, cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    opt = sgd(lr=0.4)
    sched = WarmupCosineLR(opt, total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=10,
                           cos_min_ratio=0.05, warmup_type=kind)
    points = [-1, 0, 1, 5, 9, 10, 19, 28, 29, 30, 50]
    got = trace(sched, opt, points)
    for i in points:
        assert got[i] == pytest.approx(cosine_ref(i, 0.4, 10, 30, 0.1, 0.05, kind), abs=1e-15), i
    assert got[-1] == 0.0
    assert got[0] == pytest.approx(0.04)  # warmup_min_ratio * base
    assert got[19] == pytest.approx(0.4 * (0.05 + 0.95 * 0.5))  # cosine midpoint
    assert got[29] == pytest.approx(0.02) and got[50] == pytest.approx(0.02)  # floor holds


# ---- OneCycle -------------------------------------------------------------------------

def one_cycle_scale(b, s1, s2, k1=0, k2=0):
    """Cycle scale for batch b = i + 1 (0 <= b <= s1 + s2), staircase optional."""
    if b <= s1:
        return math.floor(b * k1 / s1) / k1 if k1 > 0 else b / s1
    down = s1 + s2 - b
    return math.floor(down * k2 / s2) / k2 if k2 > 0 else down / s2


def one_cycle_ref(i, s1, s2, lr=(0.01, 0.1), mom=(0.85, 0.95), k1=0, k2=0,
                  decay_step=0, lr_rate=0.0, mom_rate=0.0):
    total = s1 + s2
    if i < total:
        scale = one_cycle_scale(i + 1, s1, s2, k1, k2)
        return lr[0] + (lr[1] - lr[0]) * scale, mom[1] - (mom[1] - mom[0]) * scale
    d = i - total + 1
    lr_v = lr[0] / (1 + lr_rate * d / decay_step) if decay_step and lr_rate else lr[0]
    mom_v = mom[1] * (1 + mom_rate * d / decay_step) if decay_step and mom_rate else mom[1]
    return lr_v, mom_v


def one_cycle_trace(sched, opt, last, key):
    values = {-1: (opt.param_groups[0]["lr"], opt.param_groups[0][key])}
    for i in range(last + 1):
        sched.step()
        values[i] = (opt.param_groups[0]["lr"], opt.param_groups[0][key])
    return values


@pytest.mark.parametrize("stairs", [(0, 0), (5, 4)], ids=["continuous", "staircase"])
def test_one_cycle_lr_and_betas(stairs):
    opt = adam()
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10,
                     cycle_second_step_size=20, cycle_first_stair_count=stairs[0],
                     cycle_second_stair_count=stairs[1], cycle_min_mom=0.85, cycle_max_mom=0.95,
                     decay_step_size=5, decay_lr_rate=0.5, decay_mom_rate=0.1)
    got = one_cycle_trace(sched, opt, 45, "betas")
    # Construction: min LR and min momentum (DeepSpeed), beta2 kept.
    assert got[-1] == (0.01, (0.85, 0.999))
    points = [0, 1, 4, 8, 9, 10, 14, 20, 28, 29, 30, 34, 45]
    for i in points:
        lr, mom = one_cycle_ref(i, 10, 20, k1=stairs[0], k2=stairs[1], decay_step=5,
                                lr_rate=0.5, mom_rate=0.1)
        assert got[i][0] == pytest.approx(lr, abs=1e-15), i
        assert got[i][1][0] == pytest.approx(mom, abs=1e-15), i
        assert got[i][1][1] == 0.999
    assert got[9][0] == pytest.approx(0.1)  # peak at the end of the first half (b = 10)
    assert got[29][0] == pytest.approx(0.01) and got[29][1][0] == pytest.approx(0.95)
    assert got[34][0] == pytest.approx(0.01 / 1.5)  # d = 5: one full decay interval
    if stairs == (5, 4):
        assert got[1][0] == got[2][0] != got[3][0]  # flat across a stair (b = 2, 3)


def test_one_cycle_sgd_momentum_and_no_decay():
    opt = sgd(momentum=0.9)
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4,
                     cycle_min_mom=0.8, cycle_max_mom=0.9)
    got = one_cycle_trace(sched, opt, 12, "momentum")
    assert got[-1] == (0.1, 0.8)
    for i in range(13):
        lr, mom = one_cycle_ref(i, 4, 4, lr=(0.1, 1.0), mom=(0.8, 0.9))
        assert got[i] == pytest.approx((lr, mom)), i
    assert got[12] == pytest.approx((0.1, 0.9))  # decay disabled: stay at min LR / max mom


def test_one_cycle_without_momentum_support_warns():
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2)
    sched.step()
    assert sched.get_mom() is None
    assert opt.param_groups[0]["lr"] == pytest.approx(0.55)


# ---- LRRangeTest ----------------------------------------------------------------------

@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = sgd()
    sched = LRRangeTest(opt, lr_range_test_min_lr=1e-3, lr_range_test_step_size=10,
                        lr_range_test_step_rate=2.0, lr_range_test_staircase=staircase)
    points = [-1, 0, 1, 8, 9, 10, 25]
    got = trace(sched, opt, points)
    for i in points:
        q = (i + 1) / 10
        if staircase:
            q = math.floor(q)
        assert got[i] == pytest.approx(1e-3 * (1 + 2.0 * q), rel=1e-12), i
    assert got[-1] == 1e-3
    if staircase:
        assert got[8] == 1e-3 and got[9] == pytest.approx(3e-3)


# ---- resume ---------------------------------------------------------------------------

SCHEDULES = {
    "WarmupLR": (lambda o: WarmupLR(o, 0.0, 0.1, 5, "linear"), "momentum"),
    "WarmupDecayLR": (lambda o: WarmupDecayLR(o, 20, 0.0, 0.1, 5), "momentum"),
    "WarmupCosineLR": (lambda o: WarmupCosineLR(o, 20, 0.1, 5), "momentum"),
    "OneCycle": (lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=4,
                                    cycle_first_stair_count=2, decay_step_size=3,
                                    decay_lr_rate=0.1, decay_mom_rate=0.05), "betas"),
    "LRRangeTest": (lambda o: LRRangeTest(o, 1e-3, 3, 1.0, True), "momentum"),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_state_dict_round_trip_resumes_identically(name):
    build, mom_key = SCHEDULES[name]
    make_opt = adam if mom_key == "betas" else (lambda: sgd(momentum=0.9))
    opt = make_opt()
    sched = build(opt)
    for _ in range(7):
        sched.step()
    sched_state, opt_state = sched.state_dict(), opt.state_dict()
    expected = []
    for _ in range(15):
        sched.step()
        expected.append((opt.param_groups[0]["lr"], opt.param_groups[0][mom_key]))

    opt2 = make_opt()
    opt2.load_state_dict(opt_state)  # the decayed LR comes back before the schedule is built
    sched2 = build(opt2)
    sched2.load_state_dict(sched_state)
    assert sched2.last_batch_iteration == 6
    assert sched2.get_last_lr() == pytest.approx([opt_state["param_groups"][0]["lr"]])
    resumed = []
    for _ in range(15):
        sched2.step()
        resumed.append((opt2.param_groups[0]["lr"], opt2.param_groups[0][mom_key]))
    assert resumed == expected


def test_resume_from_constructor_iteration_and_explicit_step():
    opt = sgd(lr=0.123)
    sched = WarmupLR(opt, 0.0, 1.0, 10, "linear", last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.123  # a resumed schedule leaves the LR alone
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    sched.step(last_batch_iteration=8)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.8)


# ---- errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("build, needle", [
    (lambda o: WarmupLR(o, warmup_type="cosine"), "warmup_type"),
    (lambda o: WarmupLR(o, warmup_num_steps=0), "warmup_num_steps"),
    (lambda o: WarmupLR(o, warmup_min_lr=[0.0, 0.1]), "warmup_min_lr"),
    (lambda o: WarmupDecayLR(o, total_num_steps=0), "total_num_steps"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0), "lr_range_test_step_size"),
    (lambda o: WarmupLR(object()), "torch.optim.Optimizer"),
])
def test_invalid_arguments(build, needle):
    with pytest.raises(ValueError, match=needle):
        build(sgd())


def test_decay_shorter_than_warmup_warns():
    with pytest.warns(UserWarning, match="total_num_steps"):
        WarmupDecayLR(sgd(), total_num_steps=5, warmup_num_steps=10)
