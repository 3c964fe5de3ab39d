"""Live elasticity: nodes leave and join a running job whose rank processes stay.

Each test runs "nodes" (``terascale run --nnodes 1:N --nproc 1`` agents on this machine,
each in its own session) training ``tests/scripts/live_train.py``, injects a fault from
outside, and checks against plain PyTorch training the same global batches in one
process: the sample sequence (every step's global batch, by sample hash) identical, the
final parameters within fp32 rounding, the survivors' process ids unchanged, and the
path the engine took (its resize records and log lines).
"""

from __future__ import annotations

import datetime
import json
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import live_jobs as lj
from terascale.checkpoint.spans import Span
from terascale.elastic.membership import Epoch, FencedError, Membership, Timing
from terascale.elastic.mirror import ring_peers
from terascale.elastic.spans import PackedState, _plan

STEPS = 40
SLEEP = "0.05"  # per step: a fault injected after step N lands a few steps later at most
RTOL = 1e-5


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lj.make_tokens(tmp_path_factory.mktemp("live-data"))


@pytest.fixture(scope="module")
def reference(tokens: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Plain PyTorch on the same global batches: at 8 samples a step, and at 12."""
    out = {}
    for batch in (8, 12):
        folder = tmp_path_factory.mktemp(f"reference{batch}")
        lj.reference(tokens, folder, STEPS, batch)
        out[batch] = folder
    return out


def _check_against(out: Path, ref: Path) -> None:
    assert lj.sample_mismatches(out, ref) == [], "the job trained other samples than the undisturbed sequence"
    assert lj.relative_difference(out, ref) < RTOL


def _pids_at(out: Path, world: int) -> set[int]:
    return {d["pid"] for records in lj.steps(out).values() for d in records if d["world"] == world}


def _finish(out: Path, nodes: list, tokens: Path) -> Path:
    """Stop the job a few steps on, wait for it, and train plain PyTorch as far."""
    last = max(lj.steps(out)) + 5
    lj.stop_at(out, last)
    for n in nodes:
        assert n.wait(180) == 0, n.text()[-3000:]
    ref = out.parent / "reference"
    lj.reference(tokens, ref, last, 8)
    return ref


def test_node_killed_survivor_keeps_its_process_and_rejoin_grows_back(tokens: Path, tmp_path: Path) -> None:
    out, port = tmp_path / "run", lj.free_port()
    out.mkdir()
    args = ("--steps", "100000", "--stop-file", str(out / "stop"), "--step-sleep", SLEEP, "--stage", "3")
    a = lj.Node(port, tokens, out, "a", script_args=args).listening(port)
    b = lj.Node(port, tokens, out, "b", script_args=args)
    lj.wait_for_step(out, 8, world=2)
    killed = b.kill()
    lj.wait_for_step(out, 0, world=1, after=killed)
    survivors = _pids_at(out, 1)
    b = lj.Node(port, tokens, out, "b2", script_args=args)
    lj.wait_for_pid_step(out, 2, after=killed, exclude=survivors | _pids_at(out, 2))
    _check_against(out, _finish(out, [a, b], tokens))
    kinds = [(r["kind"], tuple(r["world"])) for r in lj.resizes(out)]
    assert ("fault", (2, 1)) in kinds and ("grow", (1, 2)) in kinds, kinds
    # The survivor is one process throughout: it trained at world 2, then 1, then 2.
    assert len(survivors) == 1 and survivors <= _pids_at(out, 2)
    assert "continuing from step" in a.text() and "restart path" not in a.text()
    # The mirror's host memory is reported: two own snapshots and two of the peer's shards.
    memory = json.loads((out / f"memory-{next(iter(survivors))}.json").read_text())
    assert memory["elastic_mirror_peak"] >= 2 * memory["optimizer_state"] > 0


def test_a_paused_node_is_dropped_then_fenced_and_rejoins_as_a_new_member(tokens: Path, tmp_path: Path) -> None:
    out, port = tmp_path / "run", lj.free_port()
    out.mkdir()
    args = ("--steps", "100000", "--stop-file", str(out / "stop"), "--step-sleep", SLEEP)
    agent = ("--elastic_timeout", "3")
    a = lj.Node(port, tokens, out, "a", script_args=args, agent_args=agent).listening(port)
    b = lj.Node(port, tokens, out, "b", script_args=args, agent_args=agent)
    lj.wait_for_step(out, 8, world=2)
    before = _pids_at(out, 2)
    stopped = time.time()
    b.signal_ranks(signal.SIGSTOP)
    lj.wait_for_step(out, 0, world=1, after=stopped)  # the collective timed out: the job went on without it
    b.signal_ranks(signal.SIGCONT)
    # The paused process never trains again; a new process of node b does, at world 2.
    lj.wait_for_pid_step(out, 2, after=stopped, exclude=before)
    _check_against(out, _finish(out, [a, b], tokens))
    assert "is not in epoch" in b.text() and "starting it again as a new member" in b.text()


def test_both_holders_of_a_shard_lost_falls_back_to_the_checkpoint_in_the_same_process(
    tokens: Path, reference: dict, tmp_path: Path
) -> None:
    out, port = tmp_path / "run", lj.free_port()
    out.mkdir()
    args = ("--steps", str(STEPS), "--step-sleep", SLEEP, "--batch", "12", "--save-dir", str(tmp_path / "ckpt"),
            "--save-every", "4")  # fmt: skip
    nodes = [lj.Node(port, tokens, out, "a", max_nodes=3, script_args=args).listening(port)]
    nodes += [lj.Node(port, tokens, out, name, max_nodes=3, script_args=args) for name in "bc"]
    lj.wait_for_step(out, 10, world=3)
    nodes[1].kill()  # b's state lives on b and in c's mirror: both gone
    nodes[2].kill()
    assert nodes[0].wait(180) == 0, nodes[0].text()[-3000:]
    text = nodes[0].text()
    assert "falling back to the last checkpoint" in text and "in the same processes" in text
    _check_against(out, reference[12])
    assert len(_pids_at(out, 1) | _pids_at(out, 3)) == 3  # a's process trained on at world 1


@pytest.mark.slow  # make test-all: keeps make test within its budget (the path is torchrun's restart, tested there)
def test_the_restart_path_is_taken_for_a_layout_that_cannot_resize_live(tokens: Path, reference: dict,
                                                                        tmp_path: Path) -> None:  # fmt: skip
    out, port = tmp_path / "run", lj.free_port()
    out.mkdir()
    args = ("--steps", str(STEPS), "--step-sleep", SLEEP, "--mirror-every", "0", "--save-dir", str(tmp_path / "ck"),
            "--save-every", "4", "--nvme", str(tmp_path / "nvme"))  # fmt: skip
    (tmp_path / "nvme").mkdir()
    a = lj.Node(port, tokens, out, "a", script_args=args).listening(port)
    b = lj.Node(port, tokens, out, "b", script_args=args)
    lj.wait_for_step(out, 10, world=2)
    b.kill()
    assert a.wait(180) == 0, a.text()[-3000:]
    assert "taking the restart path" in a.text() and "starting it again as a new member" in a.text()
    assert lj.sample_mismatches(out, reference[8]) == []


# -- the parts, in one process ---------------------------------------------------------------


def test_membership_epochs_are_decided_once_and_a_silent_member_is_left_out() -> None:
    store = dist.HashStore()
    timing = Timing(interval=0.02, expiry=0.2, last_call=0.05, join_timeout=20)
    members = [Membership(store, "job", f"node{k}", min_members=2, max_members=3, timing=timing) for k in range(3)]
    epochs: list = [None] * 3

    def join(k: int) -> None:
        epochs[k] = members[k].join()

    threads = [threading.Thread(target=join, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    first = epochs[0]
    assert first.number == 1 and all(e == first for e in epochs) and first.world_size == 3
    assert first.carried == ()
    silent = next(m for m in members if first.rank_of(m.id) == 2)
    silent.close()  # stops beating, as a stopped process
    time.sleep(0.1)
    others = [m for m in members if m is not silent]
    second = [m.after_fault() for m in others]
    assert second[0] == second[1] and silent.id not in second[0].members and second[0].carried == second[0].members
    silent.epoch = first
    with pytest.raises(FencedError, match="not in epoch 2"):
        silent.after_fault()
    for m in members:
        m.close()


def test_transfer_plan_takes_each_element_once_from_its_first_holder() -> None:
    def pieces(spans: list[Span]) -> list:
        return [(0, p) for p in PackedState.layout((s, torch.empty(s.numel)) for s in spans)]

    supplies = [pieces([Span("master", "w", 0, 6)]), pieces([Span("master", "w", 4, 10)]), []]
    moves = _plan(supplies, [[Span("master", "w", 2, 8)], [], [Span("master", "w", 0, 10)]])
    assert [(m.src, m.dst, m.lo, m.hi) for m in moves] == [(0, 0, 2, 6), (1, 0, 6, 8), (0, 2, 0, 6), (1, 2, 6, 10)]
    with pytest.raises(RuntimeError, match=r"no rank holds elements \[10, 12\)"):
        _plan(supplies, [[Span("master", "w", 8, 12)]])


def test_mirrors_go_to_the_same_index_on_the_next_node() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert [ring_peers(nodes, r) for r in range(6)] == [(2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3)]
    assert ring_peers(["a", "a"], 1) == (1, 1)  # one node: nothing leaves it


def test_epoch_round_trips_through_json() -> None:
    e = Epoch(3, ("x/1", "y/2"), ("x", "y"), ("x/1",))
    assert Epoch.from_json(e.to_json()) == e and e.rank_of("y/2") == 1


def test_an_agent_starts_no_rank_again_once_the_job_is_over() -> None:
    # A rank that fails after the store's host closed the job (or after that host ended) is
    # not started again: there is no job left to join, and a new rank would wait for a store
    # that is gone (the suite once hung on exactly that).
    from terascale.elastic.agent import _job_over

    store = dist.TCPStore("127.0.0.1", lj.free_port(), is_master=True, wait_for_workers=False)
    assert not _job_over(store, "job")
    dist.PrefixStore("terascale/elastic/job/", store).set("closed", "1")
    assert _job_over(store, "job")
    port = lj.free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    del host  # the store's host ended
    assert _job_over(client, "job")
