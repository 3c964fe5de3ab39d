"""The engine's side of live elasticity: resizes at step boundaries, in the running process.

A rank started by the live elastic agent ([Note: the live elastic agent]) trains in
membership epochs ([Note: membership epochs]). :class:`LiveElastic` is what the engine
calls at four points:

* around every phase (:meth:`gated`): collectives stop after a failure ([Note:
  collectives after a fault]);
* before each update (:meth:`before_update`): the mirror refresh of the previous step
  must finish reading the state ([Note: in-memory redundancy]);
* at each optimizer-step boundary (:meth:`interrupted`, :meth:`recover`,
  :meth:`after_step`): after a fault every member leaves the epoch, the survivors and the
  joiners form the next, and the state of the newest step every old rank's state exists
  for is restored; without a fault, rank 0 admits waiting joiners by asking all members to
  resize after the next step;
* at the end of construction (:meth:`adopt_state`): a rank that joins a running job
  receives its state from the running ranks instead of resuming from a checkpoint.

A resize (:meth:`_resize`) leaves the old groups, forms the new ones, rebuilds the
model state (:meth:`Engine.rebuild`) and fills it from the spans
the members hold ([Note: state moves as spans]); the training record (counters, loss
scale, LR scheduler, optimizer options, the data position) comes with them, so the job
consumes the same global sample sequence whatever the resizes. Layouts this cannot
rebuild (:func:`live_blockers`) take the restart path instead: the process exits with
:data:`EXIT_RESTART`, its agent starts it again and the new members resume from the
last checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from terascale.checkpoint.manifest import parse_dtype
from terascale.checkpoint.spans import OPTIM, OptimKey, SliceMode, Span
from terascale.comm import DistributedContext, ops
from terascale.config import Config
from terascale.config.elasticity import plan_elastic
from terascale.elastic.gate import FaultGate, is_communication_error
from terascale.elastic.membership import Epoch, FencedError, Membership
from terascale.elastic.mirror import Mirror, Snapshot
from terascale.elastic.spans import PackedState, exchange
from terascale.elastic.world import collective_timeout, init_epoch_group, leave_epoch_group
from terascale.data.loader import GlobalBatches
from terascale.engine.checkpoint_records import buffer_slices, optim_keys, rng_state, set_rng_state
from terascale.optim.onebit import ReducesOwnGradients

if TYPE_CHECKING:
    from terascale.engine.engine import Engine

logger = logging.getLogger("terascale")

EXIT_RESTART = 75  # the agent starts the process again (the restart path)
EXIT_FENCED = 76  # left out of the membership: the agent starts it again as a new member
JOIN_CHECK_S = 0.25  # how often rank 0 looks for joiners (a few store reads)


def live_elastic(config: Config, dist_ctx: DistributedContext) -> LiveElastic | None:
    """The engine's live elasticity, where a live elastic agent started this rank."""
    return None if dist_ctx.elastic is None else LiveElastic(config, dist_ctx)


def live_blockers(engine: Engine) -> list[str]:
    """What keeps ``engine`` from resizing in place (empty: it can)."""
    ctx, config = engine.dist, engine.config
    out = []
    if ctx.mp_world_size > 1 or ctx.pp_world_size > 1 or ctx.sp_world_size > 1:
        out.append("tensor, pipeline or sequence parallelism (their groups are rebuilt by a restart)")
    if engine.parallel_layout.experts.groups:
        out.append("expert parallelism")
    zero = config.zero_optimization
    for name, tier in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if tier is not None and getattr(tier, "device", "none") == "nvme":
            out.append(f"zero_optimization.{name} on NVMe (its swap files are per rank)")
    if zero.offload_optimizer is not None and zero.offload_optimizer.overlap_step:
        out.append("offload_optimizer.overlap_step (its delayed update is in flight at every boundary)")
    if isinstance(engine.optimizer, ReducesOwnGradients):
        out.append(f"{type(engine.optimizer).__name__} (it holds per-rank compression state)")
    if engine.optimizer is None:
        out.append("a forward-only engine")
    return out


class LiveElastic:
    """One engine's live elasticity over ``dist_ctx.elastic`` (a Membership)."""

    def __init__(self, config: Config, dist_ctx: DistributedContext) -> None:
        self.membership: Membership = dist_ctx.elastic
        self.gate = FaultGate(timeout=collective_timeout())
        self.every = config.elasticity.mirror_interval_steps
        self.mirror: Mirror | None = None
        self.blockers: list[str] = []
        self._next_join_check = 0.0
        self.resizes: list[dict[str, Any]] = []  # one record per resize (read by tests and benchmarks)
        if config.elasticity.enabled:  # later epochs take only world sizes the global batch splits into
            valid = frozenset(plan_elastic(config.elasticity).valid_world_sizes)
            self.membership.allowed = valid.__contains__

    def host_bytes(self) -> int:
        """Host memory of the snapshots and mirrors (``memory_breakdown()['elastic_mirror']``)."""
        return 0 if self.mirror is None else self.mirror.host_bytes()

    # -- during the step -------------------------------------------------------------------

    @contextmanager
    def gated(self) -> Iterator[None]:
        self.gate.inner = ops.active_recorder()
        with ops.recording(self.gate):
            yield

    def before_update(self) -> None:
        if self.mirror is not None:
            self.mirror.before_update()

    def saving(self, save: Callable[[], None]) -> None:
        """Run ``save`` (the step's due checkpoint) ungated: a save's commit must never take a
        failed collective for a finished one. A peer lost during it trips the gate, so the
        step boundary recovers; the interrupted save was never committed."""
        try:
            save()
        except Exception as err:
            if not is_communication_error(err):
                raise
            self.gate.trip(err)

    def interrupted(self) -> bool:
        """Whether this step cannot be applied: a collective failed here or at a peer."""
        return self.gate.broken or self.membership.faulted()

    # -- at the boundary -------------------------------------------------------------------

    def after_step(self, engine: Engine) -> None:
        """After optimizer step ``s``: refresh the mirror, admit joiners, or resize."""
        m, step = self.membership, engine.global_steps
        after = m.resize_after()
        if after is not None and step >= after:
            self._resize(engine, planned=True)
            return
        if self.mirror is not None and self.mirror.due(step):
            slices = self._own_slices(engine)
            self.mirror.refresh(step, slices, self._meta(engine, slices))
        if engine.dist.rank == 0 and after is None and time.monotonic() >= self._next_join_check:
            self._next_join_check = time.monotonic() + JOIN_CHECK_S
            joiners = m.pending_joiners()
            if joiners and len(m.epoch.members) < m.max_members:
                m.request_resize(step + 1, joiners)
                logger.warning("elastic: %d member(s) waiting to join (%s); resizing after step %d", len(joiners),
                               ", ".join(joiners), step + 1)  # fmt: skip

    def recover(self, engine: Engine) -> None:
        """The step was interrupted by a fault: go on in the next epoch from the newest
        step held in memory (or the last checkpoint)."""
        self._resize(engine, planned=False)

    def close(self) -> None:
        """Training is over: finish the refresh in flight (the peers run the same one), say
        this member is done and leave the epoch's groups (the job's, made here)."""
        if self.mirror is not None:
            self.mirror.wait()
            self.mirror = None
        self.membership.leave()
        leave_epoch_group()

    # -- resizing --------------------------------------------------------------------------

    def _resize(self, engine: Engine, planned: bool) -> None:
        m = self.membership
        started = time.perf_counter()
        old = m.epoch
        assert old is not None
        at_step = engine.global_steps
        if self.blockers:
            self._restart(f"the layout has {'; '.join(self.blockers)}")
        holdings: list[Snapshot]
        if planned:
            if self.mirror is not None:
                self.mirror.wait()  # its thread uses the old groups
            holdings = [self._capture(engine, old.rank_of(m.id))]
        # Leave the old groups first: a refresh blocked on a lost peer fails at once then.
        leave_epoch_group()
        if not planned:
            holdings = self.mirror.holdings() if self.mirror is not None else []
        self.mirror = None
        self.gate.reset()
        epoch = self._next_after_fault(m, planned)
        decided = time.perf_counter()
        for attempt in range(3):
            try:
                init_epoch_group(m, epoch, engine.dist.backend)
                break
            except Exception as err:  # noqa: BLE001 - a member of the new epoch never came (it died meanwhile)
                if attempt == 2 or not is_communication_error(err):
                    raise
                logger.warning("elastic: epoch %d did not form (%s); deciding the next without the missing",
                               epoch.number, str(err).splitlines()[0][:120])  # fmt: skip
                leave_epoch_group()
                epoch = self._next_after_fault(m)
        ctx = dataclasses.replace(
            engine.dist, rank=dist.get_rank(), world_size=dist.get_world_size(), dp_group=dist.group.WORLD,
            dp_rank=dist.get_rank(), dp_world_size=dist.get_world_size(), carried_state=True,
        )  # fmt: skip
        formed = time.perf_counter()
        engine.rebuild(ctx)
        rebuilt = time.perf_counter()
        restored = self._adopt(engine, holdings)
        engine.train_state.clear_window()  # the next micro-step starts a window of the new split
        record = {
            "kind": "grow" if planned else "fault",
            "epoch": epoch.number,
            "world": (old.world_size, epoch.world_size),
            "step": at_step,
            "restored_step": restored,
            "decide_s": decided - started,  # capture (a planned resize) and agreeing on the members
            "groups_s": formed - decided,
            "rebuild_s": rebuilt - formed,
            "adopt_s": time.perf_counter() - rebuilt,  # the spans moved and loaded, the mirror started
            "pause_s": time.perf_counter() - started,
        }
        self.resizes.append(record)
        logger.warning(
            "elastic: %s: epoch %d -> %d, world %d -> %d, continuing from step %s in the same processes "
            "(%.2f s; %.2f s to agree on the members)",
            "members joined" if planned else "a member was lost", old.number, epoch.number, old.world_size,
            epoch.world_size, restored, record["pause_s"], record["decide_s"],
        )  # fmt: skip

    def _next_after_fault(self, m: Membership, planned: bool = False) -> Epoch:
        try:
            return m.next_planned() if planned else m.after_fault()
        except FencedError as err:
            logger.error("elastic: %s", err)
            m.leave()
            sys.exit(EXIT_FENCED)

    def _restart(self, reason: str) -> None:
        logger.warning("elastic: the membership changed and %s: taking the restart path (the processes start "
                       "again and resume from the last checkpoint)", reason)  # fmt: skip
        self.membership.leave_for_restart()
        sys.exit(EXIT_RESTART)

    def adopt_state(self, engine: Engine) -> bool:
        """At the end of construction: set up the mirror and, for a rank that joined a
        running job, take the state from the running ranks (True: nothing to resume)."""
        self.blockers = live_blockers(engine)
        loader = engine.training_dataloader
        if isinstance(loader, GlobalBatches):
            loader.worker_context = _fork_server()
        if self.blockers:
            logger.warning("elastic: resizes of this job take the restart path: %s", "; ".join(self.blockers))
        if not engine.dist.carried_state:
            self._start_mirror(engine)
            return False
        self._adopt(engine, [])
        return True

    def _start_mirror(self, engine: Engine) -> None:
        group = dist.new_group(backend="gloo")  # the refresh thread's own channel
        if self.every > 0 and not self.blockers:
            m = self.membership
            assert m.epoch is not None
            self.mirror = Mirror(group, m.epoch.rank_of(m.id), m.epoch.nodes, self.every,
                                 pin=engine.device.type == "cuda")  # fmt: skip

    # -- the state ---------------------------------------------------------------------------

    def _own_slices(self, engine: Engine) -> list[tuple[Span, torch.Tensor]]:
        state = engine.model_state
        return [s for chunk in state.state_slices(engine.optimizer, SliceMode.SAVE) for s in chunk] + buffer_slices(
            engine.module
        )

    def _meta(self, engine: Engine, slices: list[tuple[Span, torch.Tensor]]) -> dict[str, Any]:
        """What a snapshot of ``slices`` (this rank's, now) carries besides tensors."""
        return {
            "record": engine.training_record(),
            "rng": rng_state(),
            "world": engine.dist.world_size,
            "optim_keys": optim_keys(slices),
        }

    def _capture(self, engine: Engine, rank: int) -> Snapshot:
        slices = self._own_slices(engine)
        packed = PackedState.empty(PackedState.layout(slices))
        packed.fill(slices)
        return Snapshot(rank, engine.global_steps, packed, self._meta(engine, slices))

    def _adopt(self, engine: Engine, holdings: list[Snapshot]) -> int | None:
        """(Collective over the new epoch.) Fill ``engine``'s new state from the members'
        ``holdings``; returns the step restored (None: from the last checkpoint)."""
        group = dist.new_group(backend="gloo")
        mine = [(h.owner, h.step, h.meta["world"]) for h in holdings]
        every: list = [None] * dist.get_world_size()
        ops.all_gather_object(every, mine, group=group)
        step = _newest_complete(every)
        loader = engine.training_dataloader
        if isinstance(loader, GlobalBatches):
            loader.reshape(engine.dist.dp_rank, engine.dist.dp_world_size, engine.micro_batch_size)
        elif loader is not None:
            logger.warning("elastic: the training loader is not terascale.data's: after a resize its samples "
                           "are not the undisturbed run's (build it with initialize(training_data=...))")  # fmt: skip
        if step is None:
            self._from_checkpoint(engine, every)
            self._start_mirror(engine)
            return None
        held = [h for h in holdings if h.step == step]
        metas: list = [None] * dist.get_world_size()
        ops.all_gather_object(metas, [(h.owner, h.meta) for h in held], group=group)
        by_owner = {owner: meta for ranks in metas for owner, meta in ranks}
        meta = by_owner[min(by_owner)]
        keys = {k.removeprefix(OPTIM): OptimKey(parse_dtype(v["dtype"]), bool(v["scalar"]))
                for k, v in meta["optim_keys"].items()}  # fmt: skip
        state, optimizer = engine.model_state, engine.optimizer
        demand = [s for chunk in state.state_slices(optimizer, SliceMode.LOAD, keys) for s in chunk]
        demand += buffer_slices(engine.module)
        exchange([h.state for h in held], demand, group)
        # A second pass writes the loaded masters into the parameters (and gathers them).
        for _chunk in state.state_slices(optimizer, SliceMode.LOAD, keys):
            pass
        engine.restore_training_record(meta["record"])
        rank = engine.dist.rank
        if rank in by_owner:
            set_rng_state(by_owner[rank]["rng"])
        self._start_mirror(engine)
        return step

    def _from_checkpoint(self, engine: Engine, every: list) -> None:
        owners = sorted({o for ranks in every for o, _, _ in ranks})
        save_dir = engine.config.checkpoint.save_dir
        if save_dir is None:
            raise RuntimeError(
                f"elastic: the state of some lost ranks is nowhere in memory (the ranks holding {owners} survive) "
                "and there is no checkpoint.save_dir to fall back to: the job cannot continue"
            )
        logger.warning("elastic: no step is held whole in memory (a rank and the peer mirroring it were both lost); "
                       "falling back to the last checkpoint in %s, in the same processes", save_dir)  # fmt: skip
        path, _ = engine.load_checkpoint(save_dir)
        if path is None:
            raise RuntimeError(f"elastic: no checkpoint in {save_dir} to fall back to: the job cannot continue")


def _fork_server() -> Any:
    """A fork server for the loader's readers, started clean and with torch loaded."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "terascale.data"])
    return context


def _newest_complete(every: list) -> int | None:
    """The newest step for which some member holds each old rank's state."""
    held: dict[int, set[int]] = {}
    world: dict[int, int] = {}
    for ranks in every:
        for owner, step, size in ranks:
            held.setdefault(step, set()).add(owner)
            world[step] = size
    for step in sorted(held, reverse=True):
        if held[step] >= set(range(world[step])):
            return step
    return None


