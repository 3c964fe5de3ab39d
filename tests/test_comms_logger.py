"""The comms logger counts terascale's own collectives with the volumes ZeRO must move.

Two real ranks train a small model at ZeRO stage 2 and stage 3 with a
:class:`terascale.profiling.comms.CommsLogger` active around forward, backward and step,
and the recorded bytes are checked against the known volumes (DeepSpeed's message size:
a reduce-scatter's input holds the whole padded group, an all-gather's input one shard):

- stage 2, per step: a reduce-scatter of every group's Ψ gradient elements, padded to a
  multiple of the world size, then an all-gather of every group's shard (the updated
  parameters);
- stage 3, first step (no trace yet, ``stage3_max_reuse_distance: 0``): every group is
  all-gathered in forward and again in backward (2 Ψ/N elements sent as shards), and its
  gradients reduce-scattered as at stage 2; later steps gather exactly as often as the
  schedule says it did.

Also: async ops complete their records when done (futures, or the wait of gloo's
point-to-point works), ``prof_ops`` filters, ``debug`` names the caller, ``verbose`` logs,
the summary table.
"""

from __future__ import annotations

import math

import pytest

from distributed import run_ranks

FP32 = 4


def _model():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):
        """Three blocks (one group each, odd sizes so groups need padding) and a head."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(16, 15), nn.Linear(15, 15), nn.Linear(15, 15)])
            self.head = nn.Linear(15, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.relu(block(x))
            return F.cross_entropy(self.head(x), y)

    torch.manual_seed(0)
    return Net()


def _engine(stage: int):
    import terascale

    model = _model()
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,  # every group sharded at stage 3
            "stage3_max_reuse_distance": 0,  # backward gathers again what forward freed
        },
    }
    engine, *_ = terascale.initialize(model=model, config=config)
    return model, engine


def _step(engine, logger, step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(step * 10 + engine.dist.rank)
    x = torch.randn(2, 16, generator=g).to(engine.device)
    y = torch.randint(0, 3, (2,), generator=g).to(engine.device)
    # The engine does not activate a logger itself yet: activate it around each phase.
    with logger.active():
        loss = engine(x, y)
    with logger.active():
        engine.backward(loss)
    with logger.active():
        engine.step()


def _volumes(model, engine) -> dict:
    """Ψ from a fresh copy of the model (at stage 3 ``model``'s own parameters are shards);
    per group the elements, padded elements and shard elements of its layout."""
    groups = engine.model_state.groups
    return {
        "psi": sum(p.numel() for p in _model().parameters()),
        "numel": [fg.layout.numel for fg in groups],
        "padded": [fg.layout.padded_numel for fg in groups],
        "shard": [fg.layout.shard_numel for fg in groups],
        "root": [plan.module_name == "" for plan in engine.model_state.plans],
        "world": engine.world_size,
    }


def _stage2_rank() -> dict:
    import contextvars
    import logging
    import threading
    import time

    import torch

    from terascale.comm import ops
    from terascale.config.profiling import CommsLoggerConfig
    from terascale.profiling.comms import CommsLogger

    model, engine = _engine(2)
    rank = engine.dist.rank
    out: dict = {"volumes": _volumes(model, engine)}
    everything = CommsLogger(CommsLoggerConfig(enabled=True), rank)
    only_rs = CommsLogger(CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=["reduce_scatter_tensor"]), rank)
    debug = CommsLogger(CommsLoggerConfig(enabled=True, debug=True, verbose=True), rank)
    off = CommsLogger(CommsLoggerConfig(enabled=False), rank)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("terascale.comms").addHandler(handler)
    logging.getLogger("terascale.comms").setLevel(logging.INFO)

    out["steps"] = []
    for step in range(1, 4):
        _step(engine, everything, step)
        out["steps"].append(everything.totals())
        everything.reset()
    _step(engine, only_rs, 4)
    out["only_rs"] = only_rs.totals()
    _step(engine, debug, 5)
    out["debug_names"] = sorted({r["name"] for r in debug.records()})
    out["verbose_lines"] = list(lines)
    _step(engine, off, 6)
    out["off"] = off.records()
    out["summary"] = debug.summary()
    out["records"] = debug.records()

    # Async ops through the wrappers: a collective (gloo: a future) and point-to-point
    # (gloo: no future, completed by the wait).
    logger = CommsLogger(CommsLoggerConfig(enabled=True), rank)
    with logger.active():
        t = torch.ones(1000, device=engine.device)
        work = ops.all_reduce(t, async_op=True)
        work.wait()
        peer = 1 - rank
        buf = torch.full((256,), float(rank), device=engine.device)
        work = ops.isend(buf, peer) if rank == 0 else ops.irecv(buf, peer)
        out["p2p_is_work"] = isinstance(work, torch.distributed.Work)
        work.wait()
        out["received"] = buf[0].item()
    for _ in range(100):  # a future's callback may run on the backend's thread just after wait()
        if logger.in_flight == 0:
            break
        time.sleep(0.01)
    out["async"] = logger.records()
    out["async_in_flight"] = logger.in_flight
    out["all_reduce_value"] = t[0].item()

    # An autograd worker thread (CUDA backward) has its own, empty context; torch carries
    # the backward caller's context to it in thread-local state, as simulated here.
    def worker(stash) -> None:
        if stash is not None:
            torch._C._stash_obj_in_tls("context", stash)
        try:
            ops.all_reduce(torch.ones(3 if stash is not None else 5, device=engine.device))
        finally:
            if stash is not None:
                torch._C._remove_obj_from_tls("context")

    logger = CommsLogger(CommsLoggerConfig(enabled=True), rank)
    with logger.active():
        stash = contextvars.copy_context()
    for ctx in (stash, None):
        thread = threading.Thread(target=worker, args=(ctx,))
        thread.start()
        thread.join()
    out["worker"] = [(rec["op"], rec["msg_bytes"], rec["count"]) for rec in logger.records()]
    engine.destroy()
    return out


def _stage3_rank() -> dict:
    from terascale.config.profiling import CommsLoggerConfig
    from terascale.profiling.comms import CommsLogger

    model, engine = _engine(3)
    out: dict = {"volumes": _volumes(model, engine)}
    schedule = engine.model_state.schedule
    logger = CommsLogger(CommsLoggerConfig(enabled=True), engine.dist.rank)
    out["steps"], out["gathers"] = [], []
    for step in range(1, 4):
        before = schedule.gathers
        _step(engine, logger, step)
        out["steps"].append(logger.totals())
        out["gathers"].append(schedule.gathers - before)
        gathered = {r["msg_bytes"] for r in logger.records() if r["op"] == "all_gather_into_tensor"}
        out.setdefault("sizes", set()).update(gathered)
        assert logger.in_flight == 0, "every gather and reduction of a step completes within it"
        logger.reset()
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def stage2() -> list[dict]:
    return run_ranks(_stage2_rank, 2)


@pytest.fixture(scope="module")
def stage3() -> list[dict]:
    return run_ranks(_stage3_rank, 2)


def test_stage2_reduce_scatters_psi_gradients_and_gathers_psi_parameters_per_step(stage2):
    for r in stage2:
        v = r["volumes"]
        assert sum(v["numel"]) == v["psi"]  # the groups hold the model, once
        assert v["padded"] == [math.ceil(n / v["world"]) * v["world"] for n in v["numel"]]
        assert v["padded"] != v["numel"]  # odd sizes: the padding is counted too
        for step in r["steps"]:
            rs, ag = step["reduce_scatter_tensor"], step["all_gather_into_tensor"]
            assert rs["count"] == len(v["padded"])  # one per group and micro-step
            assert rs["bytes"] == sum(v["padded"]) * FP32
            assert ag["count"] == len(v["padded"])  # the updated parameters, once
            assert ag["bytes"] == sum(v["padded"]) // v["world"] * FP32
            # Nothing else: the point-to-point sends and receives gloo builds these from
            # are not counted on their own. (Small all-reduces: the first window's
            # agreement on what backward touched, and the engine's norm reductions.)
            assert set(step) <= {"reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"}
            for op in step.values():
                assert op["latency_ms"] > 0 and op["algbw_gbps"] > 0
            # busbw / algbw: (n-1)/n for both at n = 2.
            assert rs["busbw_gbps"] == pytest.approx(rs["algbw_gbps"] / 2)


def test_prof_ops_debug_verbose_and_off(stage2):
    for rank, r in enumerate(stage2):
        assert set(r["only_rs"]) == {"reduce_scatter_tensor"}
        assert r["only_rs"]["reduce_scatter_tensor"]["bytes"] == r["steps"][1]["reduce_scatter_tensor"]["bytes"]
        names = set(r["debug_names"])
        ours = {"all_gather_into_tensor | FlatParamGroup._gather", "reduce_scatter_tensor | ShardedGrads._launch"}
        assert ours <= names
        assert all(n.startswith("all_reduce | ") for n in names - ours)  # the engine's, once it records them
        assert len(r["verbose_lines"]) == sum(rec["count"] for rec in r["records"]) >= 2 * len(r["volumes"]["padded"])
        assert all(line.startswith(f"rank {rank} | ") and " ms | algbw " in line for line in r["verbose_lines"])
        assert r["off"] == []


def test_async_ops_complete_their_records(stage2):
    for rank, r in enumerate(stage2):
        assert r["all_reduce_value"] == 2.0 and r["received"] == 0.0 and r["p2p_is_work"]
        assert r["async_in_flight"] == 0
        recs = {rec["op"]: rec for rec in r["async"]}
        assert set(recs) == {"all_reduce", "isend" if rank == 0 else "irecv"}
        assert recs["all_reduce"]["msg_bytes"] == 1000 * FP32
        assert recs["all_reduce"]["busbw_gbps"] == pytest.approx(recs["all_reduce"]["algbw_gbps"])  # 2(n-1)/n = 1
        p2p = recs["isend" if rank == 0 else "irecv"]
        assert p2p["msg_bytes"] == 256 * FP32 and p2p["count"] == 1
        for rec in recs.values():
            assert rec["total_latency_ms"] > 0


def test_backward_worker_threads_see_the_recorder(stage2):
    for r in stage2:
        assert r["worker"] == [("all_reduce", 3 * FP32, 1)]  # the thread without the stash: unseen


def test_summary_table(stage2):
    from terascale.profiling.comms import format_size

    text = stage2[0]["summary"]
    lines = text.splitlines()
    assert lines[0] == "comms logger, rank 0"
    assert "Count" in lines[1] and "algbw (GB/s)" in lines[1] and "busbw (GB/s)" in lines[1]
    assert "reduce_scatter_tensor | ShardedGrads._launch" in lines
    assert any(line.startswith("total reduce_scatter_tensor") for line in lines)
    padded = stage2[0]["volumes"]["padded"]
    assert lines[-1].startswith("total") and lines[-1].split()[1] == str(sum(r["count"] for r in stage2[0]["records"]))
    # One row per message size under each op: a reduce-scatter's is a padded group.
    rows = lines[lines.index("reduce_scatter_tensor | ShardedGrads._launch") + 1 :]
    sizes = [row[:40].strip() for row in rows[: len(set(padded))]]
    assert sizes == [format_size(n * FP32) for n in sorted(set(padded))]


def test_stage3_gathers_psi_in_forward_and_backward(stage3):
    for r in stage3:
        v = r["volumes"]
        assert sum(v["numel"]) == v["psi"]  # every parameter, once, in some group
        shard_bytes = [s * FP32 for s in v["shard"]]
        first = r["steps"][0]
        # No trace yet: each group is gathered before its forward and again before its
        # backward (a root group, if any, is kept in between).
        want = sum(b if root else 2 * b for b, root in zip(shard_bytes, v["root"]))
        assert first["all_gather_into_tensor"]["bytes"] == want
        assert sum(v["padded"]) // v["world"] * FP32 * 2 >= want
        for step, gathers in zip(r["steps"], r["gathers"]):
            assert set(step) <= {"reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"}
            assert step["all_gather_into_tensor"]["count"] == gathers  # what the schedule issued
            rs = step["reduce_scatter_tensor"]
            assert rs["count"] == len(v["padded"]) and rs["bytes"] == sum(v["padded"]) * FP32
        assert r["sizes"] == set(shard_bytes)


def test_bandwidth_factors():
    from terascale.profiling.comms import algorithm_bytes, bus_factor, format_size

    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("reduce_scatter_tensor", 4) == bus_factor("all_gather_into_tensor", 4) == 0.75
    assert bus_factor("broadcast", 8) == bus_factor("isend", 8) == 1.0
    assert algorithm_bytes("all_gather_into_tensor", 100, 4) == 400
    assert algorithm_bytes("reduce_scatter_tensor", 400, 4) == 400
    assert format_size(512) == "512 B" and format_size(1536) == "1.50 KiB" and format_size(3 * 2**20) == "3.00 MiB"
