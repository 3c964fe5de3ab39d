"""``terascale estimate --layouts``: memory and communication of pp x tp x dp layouts by
the formulas of [Note: 3D layout estimates], checked on hand-computed rows."""

from __future__ import annotations

import pytest

from terascale.launcher.cli import main
from terascale.parallel.estimate import estimate_layouts

SHAPE = dict(params=1.2e9, world=8, layers=24, hidden=2048, heads=16, seq=1024, global_batch=32, micro_batch=2)


def _row(rows, pp, tp, dp, stage):
    [row] = [r for r in rows if (r.pp, r.tp, r.dp, r.stage) == (pp, tp, dp, stage)]
    return row


def test_layouts_follow_the_zero_and_megatron_formulas() -> None:
    rows = estimate_layouts(**SHAPE)
    assert {(r.pp, r.tp, r.dp) for r in rows} >= {(1, 1, 8), (2, 2, 2), (8, 1, 1), (1, 8, 1), (4, 2, 1)}
    sbh = 1024 * 2 * 2048
    r = _row(rows, 2, 2, 2, 1)
    psi = 1.2e9 / 4
    assert r.micro_batches == 32 // (2 * 2) == 8
    assert r.model_states == pytest.approx(4 * psi + 12 * psi / 2)
    assert r.activations == pytest.approx(24 * sbh * (10 + 24 / 2))
    assert r.dp_bytes == pytest.approx(2 * 0.5 * 2 * psi)  # one all-reduce of the gradients
    assert r.tp_bytes == pytest.approx(8 * 12 * 4 * 2 * 0.5 * 2 * sbh)
    assert r.pp_bytes == pytest.approx(8 * 2 * 2 * sbh)
    z3 = _row(rows, 1, 1, 8, 3)
    assert z3.model_states == pytest.approx(16 * 1.2e9 / 8)
    assert z3.dp_bytes == pytest.approx(2 * 3 * 7 / 8 * 2 * 1.2e9)  # 2 micro-batches x (RS + 2 AG)
    assert z3.tp_bytes == z3.pp_bytes == 0
    # a layout exists only where tp divides the heads and pp the layers
    assert all(16 % r.tp == 0 and 24 % r.pp == 0 for r in rows)


def test_estimate_cli_lists_the_layouts_that_fit(capsys) -> None:
    args = ["estimate", "--params", "1.2e9", "--world", "8", "--layers", "24", "--hidden", "2048", "--heads", "16",
            "--seq", "1024", "--global-batch", "32", "--micro-batch", "2", "--layouts", "--device-memory", "8"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pp x tp x dp layouts" in out and "need more than 8 GiB per rank" in out
    assert main(["estimate", "--params", "1e9", "--layouts"]) == 2
    with pytest.raises(ValueError, match="layers must be >= 1"):
        estimate_layouts(**{**SHAPE, "layers": 0})
