"""ZeRO stages 1-3 on 1, 2 and 4 ranks train exactly like one plain process (and like stage 0).

ZeRO gives a parameter that no rank used a zero gradient (DeepSpeed's semantics, see
``[Note: sharded gradients]``), so the reference does the same; stage 0 leaves such a
parameter's gradient None and AdamW skips it, which only ever differs on 'rare'.
"""

from __future__ import annotations

import pytest
import torch

from parity import Case, check

STAGES = (1, 2, 3)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zero_stages_match_single_process(world):
    # accumulation 1 and 3 x clipping off and 0.05 (below every gradient norm here).
    cases = [Case(stage=s, gas=gas, clip=clip) for s in STAGES for gas in (1, 3) for clip in (0.0, 0.05)]
    check(world, cases, zero_unused_grads=True)


def test_zero_stages_match_stage0():
    cases = [Case(stage=s, gas=3, clip=0.05) for s in (0, *STAGES)]
    results = check(2, cases[1:], zero_unused_grads=True)
    stage0 = check(2, cases[:1])
    for rank_results, (reference,) in zip(results, stage0):
        for losses, state, _ in rank_results:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-5, atol=1e-6)
            for k, v in state.items():
                if not k.startswith("rare."):  # never used: zero gradient vs None (see above)
                    torch.testing.assert_close(v, reference[1][k], rtol=1e-5, atol=1e-6, msg=k)


def test_zero_tied_unused_frozen_and_knobs():
    cases = [
        # The head weight is used twice per forward and lives in the root group (the common
        # ancestor of its two uses); 'rare' runs on half the steps, which changes the stage-3
        # trace every step (re-trace, prefetch fallback).
        *(Case(stage=s, gas=2, clip=0.05, tied=True, use_rare=True) for s in STAGES),
        # Frozen input layer (requires_grad=False): sharded at stage 3, never stepped.
        *(Case(stage=s, gas=2, frozen=True) for s in STAGES),
        # The blocks run twice per forward: gathered, freed and gathered again, in forward
        # and in backward, with gradients from both calls accumulated before the reduction.
        *(Case(stage=s, gas=2, clip=0.05, reuse=True) for s in (2, 3)),
        Case(stage=3, reuse=True, zero={"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}),
        # Where the 1/world happens and which dtype is communicated do not change the result.
        Case(stage=2, extra={"prescale_gradients": True}),
        Case(stage=3, gas=2, extra={"gradient_predivide_factor": 2.0}),
        Case(stage=1, gas=2, extra={"communication_data_type": "fp32"}),
        # All-reduce instead of reduce-scatter, no overlap, tiny sub-groups and budgets.
        Case(
            stage=3,
            gas=2,
            clip=0.05,
            use_rare=True,
            zero={
                "reduce_scatter": False,
                "overlap_comm": False,
                "sub_group_size": 50,
                "stage3_prefetch_bucket_size": 700,
                "stage3_max_live_parameters": 1500,
                "stage3_max_reuse_distance": 0,
            },
        ),
        # Small parameters (biases, the LayerNorm) stay gathered: the persistent group.
        Case(stage=3, zero={"stage3_param_persistence_threshold": 100}),
    ]
    check(2, cases, zero_unused_grads=True)
