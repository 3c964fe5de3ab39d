"""The ``elasticity`` section (see ``[Note: elastic batch sizes]``): the global batch and valid
world sizes, the micro-batch × accumulation split per world size, the errors, the Config
integration and ``terascale elastic-config``.

The expected numbers are hand-checked where the arithmetic is small, and otherwise were
computed with DeepSpeed's own ``compute_elastic_config`` (its main branch, which keeps the
global batch ≤ max_train_batch_size) and are hard-coded here: CI has no DeepSpeed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from terascale.config import AutoContext, BatchSizes, Config, ConfigError, Given
from terascale.config.elasticity import (
    HIGHLY_COMPOSITE,
    ElasticityConfig,
    elastic_batch_sizes,
    plan_elastic,
)
from terascale.launcher.cli import main

CORPUS = Path(__file__).parent / "configs"


def _section(**keys: object) -> ElasticityConfig:
    return ElasticityConfig.model_validate({"enabled": True, **keys})


def _split(plan, world: int) -> tuple[int, int]:
    batch = elastic_batch_sizes(plan, world)
    assert batch.train_batch_size == plan.train_batch_size
    assert batch.micro_batch_size * batch.gradient_accumulation_steps * world == plan.train_batch_size
    return batch.micro_batch_size, batch.gradient_accumulation_steps


def _load_problem(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        Config.load(config)
    return str(info.value)


# ---- the computation -----------------------------------------------------------------


def test_multipliers_are_the_highly_composite_numbers() -> None:
    limit = 10080
    counts = [0] * (limit + 1)  # counts[n]: how many divisors n has (a sieve)
    for d in range(1, limit + 1):
        for multiple in range(d, limit + 1, d):
            counts[multiple] += 1
    record, most = [], 0
    for n in range(1, limit + 1):
        if counts[n] > most:
            record.append(n)
            most = counts[n]
    assert list(HIGHLY_COMPOSITE[: len(record)]) == record
    assert HIGHLY_COMPOSITE[-1] == 720720 and list(HIGHLY_COMPOSITE) == sorted(set(HIGHLY_COMPOSITE))


def test_hand_checked_v01_prefers_the_larger_of_two_equally_elastic_batches() -> None:
    # Candidates: 2 × 6 = 12 and 4 × 4 = 16 (LCM 4 gives 16 too). 12 splits over 1, 2, 3, 6
    # ranks, 16 over 1, 2, 4, 8: a tie of four world sizes, so the larger batch wins.
    plan = plan_elastic(_section(max_train_batch_size=16, micro_batch_sizes=[2, 4], max_gpus=16, version=0.1))
    assert (plan.train_batch_size, plan.valid_world_sizes, plan.valid_node_counts) == (16, (1, 2, 4, 8), ())
    assert [_split(plan, w) for w in (1, 2, 4, 8)] == [(4, 4), (4, 2), (4, 1), (2, 1)]

    smaller = plan_elastic(
        _section(max_train_batch_size=16, micro_batch_sizes=[2, 4], max_gpus=16, version=0.1, prefer_larger_batch=False)
    )
    assert (smaller.train_batch_size, smaller.valid_world_sizes) == (12, (1, 2, 3, 6))
    assert [_split(smaller, w) for w in (1, 2, 3, 6)] == [(4, 3), (2, 3), (4, 1), (2, 1)]


# (section, global batch, valid data-parallel world sizes, {world: micro batch}) as DeepSpeed
# computes them.
DEEPSPEED_VERIFIED = {
    "docs example": (
        dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=10000, version=0.1),
        1680,
        (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105, 120, 140, 168,
         210, 280, 420, 840),
        {1: 6, 3: 4, 24: 2, 840: 2},
    ),
    "DeepSpeed's 10k test": (
        dict(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=0.1),
        9792,
        (32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288, 306, 408, 576, 612, 816, 1224),
        {32: 17, 34: 16, 136: 12, 1224: 8},
    ),
    "LCM 42 above the cap 32": (
        dict(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], version=0.1),
        24, (1, 2, 3, 4, 6, 8, 12, 24), {1: 3, 3: 2, 24: 1},
    ),
    "LCM 120 above the cap 100": (
        dict(max_train_batch_size=100, micro_batch_sizes=[8, 10, 12], version=0.1),
        96, (1, 2, 3, 4, 6, 8, 12), {1: 12, 3: 8, 12: 8},
    ),
    "4..64 GPUs": (
        dict(max_train_batch_size=512, micro_batch_sizes=[4, 8], min_gpus=4, max_gpus=64, version=0.1),
        480, (4, 5, 6, 8, 10, 12, 15, 20, 24, 30, 40, 60), {4: 8, 8: 4, 60: 8},
    ),
    "prefer smaller": (
        dict(max_train_batch_size=96, micro_batch_sizes=[3, 5], version=0.1, prefer_larger_batch=False),
        90, (1, 2, 3, 5, 6, 9, 10, 15, 18, 30), {1: 5, 5: 3, 30: 3},
    ),
    "v0.2, 8 GPUs per node": (
        dict(max_train_batch_size=1024, micro_batch_sizes=[2, 4], num_gpus_per_node=8, min_gpus=8, max_gpus=128),
        960, (8, 16, 24, 32, 40, 48, 80, 96, 120), {8: 4, 32: 2, 120: 4},
    ),
    "v0.2, the corpus's section": (
        dict(max_train_batch_size=64, micro_batch_sizes=[2, 4], num_gpus_per_node=8, version=0.2),
        64, (8, 16, 32), {8: 4, 16: 4, 32: 2},
    ),
    "v0.2, model parallel 2": (
        dict(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], num_gpus_per_node=4, model_parallel_size=2,
             max_gpus=64),
        1920, (2, 4, 6, 8, 10, 12, 16, 20, 24, 30, 32), {},
    ),
    "v0.2, model parallel 4, prefer smaller": (
        dict(max_train_batch_size=1500, micro_batch_sizes=[1, 2, 3], num_gpus_per_node=8, model_parallel_size=4,
             min_gpus=16, max_gpus=256, prefer_larger_batch=False),
        1440, (4, 6, 8, 10, 12, 16, 18, 20, 24, 30, 32, 36, 40, 48, 60), {},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", DEEPSPEED_VERIFIED)
def test_plans_match_deepspeed(name: str) -> None:
    keys, batch, worlds, micros = DEEPSPEED_VERIFIED[name]
    plan = plan_elastic(_section(**keys))
    assert plan.train_batch_size == batch
    assert plan.valid_world_sizes == worlds
    assert {w: _split(plan, w)[0] for w in micros} == micros
    for world in worlds:  # every valid world size keeps the global batch
        _split(plan, world)


def test_v02_counts_nodes_and_model_parallel_gpus() -> None:
    # 4 GPUs per node at model-parallel 2 = 2 data-parallel ranks per node; each node's share
    # of the cap 32 is 16, which is the hand-checked v0.1 case above over 1..8 nodes.
    plan = plan_elastic(
        _section(max_train_batch_size=32, micro_batch_sizes=[2, 4], min_gpus=4, max_gpus=32, num_gpus_per_node=4,
                 model_parallel_size=2)
    )  # fmt: skip
    assert plan.version == 0.2 and plan.train_batch_size == 32
    assert plan.valid_node_counts == (1, 2, 4, 8)
    assert plan.valid_world_sizes == (2, 4, 8, 16)
    assert plan.valid_gpu_counts == (4, 8, 16, 32)
    assert [_split(plan, w) for w in (2, 4, 8, 16)] == [(4, 4), (4, 2), (4, 1), (2, 1)]


# ---- errors --------------------------------------------------------------------------


def test_an_invalid_world_size_is_named_with_the_valid_ones() -> None:
    plan = plan_elastic(_section(max_train_batch_size=16, micro_batch_sizes=[2, 4], max_gpus=16, version=0.1))
    with pytest.raises(ConfigError) as info:
        elastic_batch_sizes(plan, 3)
    assert info.value.problems == [
        "data-parallel world size 3 is not valid for elasticity (train_batch_size 16 / 3 ranks is not a whole "
        "multiple of any of elasticity.micro_batch_sizes [2, 4]); valid data-parallel world sizes: 1, 2, 4, 8"
    ]
    with pytest.raises(ConfigError, match="world size must be a positive integer, got 0"):
        elastic_batch_sizes(plan, 0)

    narrow = plan_elastic(_section(max_train_batch_size=16, micro_batch_sizes=[2, 4], min_gpus=2, max_gpus=4, version=0.1))
    with pytest.raises(ConfigError, match=r"world size 8 is not valid .*\(it is outside elasticity.min_gpus..max_gpus\); "
                                          r"valid data-parallel world sizes: 2, 4$"):  # fmt: skip
        elastic_batch_sizes(narrow, 8)


def test_an_invalid_v02_world_size_lists_the_node_counts() -> None:
    # DeepSpeed would run 24 GPUs with a different global batch (48); here that is an error.
    plan = plan_elastic(_section(max_train_batch_size=64, micro_batch_sizes=[2, 4], num_gpus_per_node=8))
    with pytest.raises(ConfigError) as info:
        elastic_batch_sizes(plan, 24)
    assert str(info.value).endswith(
        "valid data-parallel world sizes: 8, 16, 32 (on 1, 2, 4 nodes of 8 GPUs with model_parallel_size 1)"
    )
    # 4 ranks would split 64 evenly, but it is half a node.
    with pytest.raises(ConfigError, match=r"world size 4 is not valid for elasticity \(version 0.2 runs whole nodes "
                                          r"of 8 data-parallel ranks\)"):  # fmt: skip
        elastic_batch_sizes(plan, 4)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({}, "elasticity: elasticity.max_train_batch_size is required (a non-empty value) when elasticity.enabled "
             "is true; elasticity.micro_batch_sizes is required"),
        ({"max_train_batch_size": 8, "micro_batch_size": [2]}, "elasticity.micro_batch_size: unknown key; did you "
                                                               "mean 'micro_batch_sizes'?"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2, 0]}, "elasticity.micro_batch_sizes[1]: expected a "
                                                                   "value > 0, got 0"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2], "version": 0.3}, "elasticity.version: expected 0.1 or "
                                                                                "0.2 (the elasticity versions), got 0.3"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2], "min_gpus": 4, "max_gpus": 2},
         "elasticity.min_gpus 4 is greater than elasticity.max_gpus 2"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2], "version": 0.1, "model_parallel_size": 2},
         "elasticity.model_parallel_size 2 needs elasticity.version 0.2"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2], "num_gpus_per_node": 8, "model_parallel_size": 3},
         "elasticity.num_gpus_per_node 8 is not divisible by elasticity.model_parallel_size 3"),
        ({"max_train_batch_size": 64, "micro_batch_sizes": [2], "num_gpus_per_node": 8, "max_gpus": 4},
         "elasticity.max_gpus 4 is less than elasticity.num_gpus_per_node 8"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2, 12, 16], "version": 0.1},
         "elasticity.max_train_batch_size 8 is too small for elasticity.micro_batch_sizes [12, 16]"),
        ({"max_train_batch_size": 32, "micro_batch_sizes": [2, 8], "num_gpus_per_node": 8},
         "elasticity.max_train_batch_size 32 is too small (its share per node: 32 / 8 data-parallel ranks per "
         "node = 4) for elasticity.micro_batch_sizes [8]"),
    ],
)  # fmt: skip
def test_section_errors_name_the_keys(keys: dict, message: str) -> None:
    assert message in _load_problem({"elasticity": {"enabled": True, **keys}})


def test_a_disabled_section_is_inert_but_typed() -> None:
    cfg = Config.load({"train_batch_size": 8, "elasticity": {"enabled": False, "min_gpus": 9, "max_gpus": 2}})
    assert cfg.resolve_batch(2) == BatchSizes(8, 4, 1)
    assert "elasticity.max_gpu: unknown key; did you mean 'max_gpus'?" in _load_problem({"elasticity": {"max_gpu": 2}})
    with pytest.raises(ConfigError, match="elasticity.enabled is false"):
        plan_elastic(cfg.elasticity)


def test_no_world_size_in_range_fits() -> None:
    # The only candidate is 16 (4 × 4), which splits over 1, 2 and 4 ranks, none in 3..3.
    with pytest.raises(ConfigError) as info:
        plan_elastic(_section(max_train_batch_size=16, micro_batch_sizes=[4], min_gpus=3, max_gpus=3, version=0.1))
    assert info.value.problems == [
        "elasticity: no batch size ≤ 16 made of elasticity.micro_batch_sizes [4] splits evenly over any number of "
        "data-parallel ranks in 3..3; raise elasticity.max_train_batch_size or widen elasticity.min_gpus..max_gpus"
    ]


# ---- the Config --------------------------------------------------------------------


ELASTIC = {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "max_gpus": 16, "version": 0.1}


def test_config_keeps_the_global_batch_across_world_sizes() -> None:
    cfg = Config.load({"elasticity": ELASTIC}).require_built()
    assert [cfg.resolve_batch(w) for w in (1, 2, 4)] == [BatchSizes(16, 4, 4), BatchSizes(16, 4, 2), BatchSizes(16, 4, 1)]
    with pytest.raises(ConfigError, match="world size 3 is not valid"):
        cfg.resolve_batch(3)


def test_batch_keys_beside_elasticity_are_an_error_unless_ignored() -> None:
    raw = {"train_batch_size": 64, "gradient_accumulation_steps": 1, "elasticity": ELASTIC}
    with pytest.raises(ConfigError) as info:
        Config.load(raw).resolve_batch(2)
    assert info.value.problems == [
        'train_batch_size, gradient_accumulation_steps are set (in the config, or by an integration for "auto"), '
        "but elasticity.enabled is true and elasticity decides the batch sizes; remove them, or set "
        "elasticity.ignore_non_elastic_batch_info: true to let the elastic values win"
    ]
    with pytest.raises(ConfigError, match="^invalid terascale config: train_micro_batch_size_per_gpu is set"):
        Config.load({"train_micro_batch_size_per_gpu": 4, "elasticity": ELASTIC}).resolve_batch(2)

    ignored = Config.load({**raw, "elasticity": {**ELASTIC, "ignore_non_elastic_batch_info": True}})
    assert ignored.resolve_batch(2) == BatchSizes(16, 4, 2)


def test_auto_batch_sizes_are_left_to_elasticity() -> None:
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "elasticity": ELASTIC}
    cfg = Config.load(raw).resolve(AutoContext(world_size=2))
    assert cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None
    assert [r.why for r in cfg.resolved] == ["decided by elasticity for the data-parallel world size"] * 2
    assert cfg.resolve_batch(8) == BatchSizes(16, 2, 1)
    # An integration that fills them gives values that conflict, as in DeepSpeed.
    given = {"train_micro_batch_size_per_gpu": Given(4, "TrainingArguments.per_device_train_batch_size")}
    filled = Config.load(raw).resolve(AutoContext(world_size=2, given=given))
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu is set"):
        filled.resolve_batch(2)


def test_the_corpus_section_loads_and_runs_when_enabled() -> None:
    raw = json.loads((CORPUS / "megatron_moe_elasticity_curriculum.json").read_text())
    cfg = Config.load(raw)
    assert not cfg.elasticity.enabled and cfg.resolve_batch(2) == BatchSizes(64, 4, 8)
    enabled = Config.load({**raw, "elasticity": {**raw["elasticity"], "enabled": True}})
    # It sets train_batch_size and micro 4 too, and ignore_non_elastic_batch_info: true.
    assert [enabled.resolve_batch(w) for w in (8, 16, 32)] == [BatchSizes(64, 4, 2), BatchSizes(64, 4, 1),
                                                               BatchSizes(64, 2, 1)]  # fmt: skip


# ---- terascale elastic-config ----------------------------------------------------------


def _write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_cli_prints_the_plan_and_the_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    section = {"enabled": True, "max_train_batch_size": 32, "micro_batch_sizes": [2, 4], "min_gpus": 4,
               "max_gpus": 32, "num_gpus_per_node": 4, "model_parallel_size": 2}  # fmt: skip
    path = _write(tmp_path, {"elasticity": section})
    assert main(["elastic-config", path, "--world", "4"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "elasticity version 0.2",
        "global batch size (train_batch_size): 32",
        "micro batch sizes: 2, 4",
        "valid data-parallel world sizes: 2, 4, 8, 16",
        "valid GPU counts (× model_parallel_size 2): 4, 8, 16, 32",
        "valid node counts (4 GPUs per node): 1, 2, 4, 8",
        "data-parallel world size 4: micro batch 4 × gradient accumulation steps 2 × 4 ranks = 32",
    ]
    assert main(["elastic-config", _write(tmp_path, {"elasticity": ELASTIC})]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "elasticity version 0.1",
        "global batch size (train_batch_size): 16",
        "micro batch sizes: 2, 4",
        "valid data-parallel world sizes: 1, 2, 4, 8",
    ]


@pytest.mark.parametrize(
    ("config", "args", "error"),
    [
        ({"elasticity": ELASTIC}, ["--world", "3"], "data-parallel world size 3 is not valid for elasticity"),
        ({"elasticity": {**ELASTIC, "version": 0.5}}, [], "elasticity.version: expected 0.1 or 0.2"),
        ({"train_batch_size": 16, "elasticity": ELASTIC}, [], "train_batch_size is set"),
        ({"train_batch_size": 16}, [], "elasticity.enabled is false"),
    ],
)
def test_cli_exits_2_with_the_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict, args: list[str], error: str
) -> None:
    assert main(["elastic-config", _write(tmp_path, config), *args]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("terascale elastic-config: error: invalid terascale config")
    assert error in out.err
