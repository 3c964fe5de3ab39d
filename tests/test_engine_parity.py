"""Stage 0 on 1, 2 and 4 ranks with accumulation trains exactly like one plain process."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from parity import Case, check, train_rank
from toy import make_model


# Tied weights with a branch unused on half the steps, prescale, predivide, fp32 communication.
_VARIANTS = [
    Case(gas=2, clip=0.05, tied=True, use_rare=True),
    Case(extra={"prescale_gradients": True}),
    Case(gas=2, extra={"gradient_predivide_factor": 2.0}),
    Case(extra={"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}),
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stage0_matches_single_process(world):
    # accumulation 1 and 3, clipping off and on (0.05 is below every gradient norm here).
    check(world, [Case(gas=gas, clip=clip) for gas in (1, 3) for clip in (0.0, 0.05)])


def test_tied_weights_unused_branch_prescale_predivide():
    # The head weight is used twice per forward; 'rare' gets no gradient on half the steps
    # and must then be left untouched by AdamW (grad None), as in plain PyTorch.
    # Prescaling and predividing change where the 1/world happens, not the result.
    check(2, _VARIANTS)


def test_unused_param_keeps_grad_none_and_is_not_decayed():
    results = run_ranks(train_rank, 2, 2, [Case()])
    init = make_model().state_dict()
    for rank_results in results:
        state = rank_results[0][1]
        # 'rare' never ran: AdamW must not have touched it (no weight decay without a grad).
        torch.testing.assert_close(state["rare.weight"], init["rare.weight"], rtol=0, atol=0)
