"""The engine's side of long runs: resume, interval and signal saves, and the health monitors.

A run configured with ``checkpoint.save_dir`` keeps going by itself (README, "Long runs"):

* ``initialize`` resumes from the newest checkpoint every rank can read completely
  (``auto_resume``; a corrupted newest one is passed over with a warning), on whatever
  world size the job now has (load-time reshard; accumulation re-derived; the data
  position carried, ``[Note: elastic data position]``);
* after every optimizer step it saves when ``interval_steps`` / ``interval_seconds`` say
  so, asynchronously, through ``local_dir`` when given (``[Note: node-local checkpoints]``);
* SIGTERM (a preemption notice) makes every rank save at the next step and exit, within
  ``signal_deadline_s`` of the signal (``[Note: saving on SIGTERM]``);
* ``health`` adds the collective watchdog, the straggler detector and the non-finite
  policy (``terascale.health``).

The engine calls :meth:`Resilience.phase` around forward, backward and the step,
:meth:`check_finite` before an update and :meth:`after_step` after it; saves and loads go
through the engine's :class:`~terascale.engine.checkpointing.Checkpointer`. Nothing here
branches on the ZeRO stage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from terascale.checkpoint.directory import CheckpointDirectory, verify
from terascale.checkpoint.lease import LeaseError
from terascale.checkpoint.manifest import CheckpointError, Manifest
from terascale.comm import DistributedContext
from terascale.comm import ops as comm_ops
from terascale.config import Config
from terascale.engine.checkpointing import Checkpointer
from terascale.engine.model_state import ModelState, collective_wait_s
from terascale.engine.monitor import Reporter
from terascale.engine.train_state import TrainState
from terascale.health.non_finite import NonFiniteError, NonFiniteEvent, NonFinitePolicy, Verdict
from terascale.health.sigterm import SIGTERM_EXIT_CODE, SigtermWatch
from terascale.health.straggler import StragglerDetector
from terascale.health.watchdog import waiting_in

logger = logging.getLogger("terascale")


class Resilience:
    """Resume, interval saves, save-on-SIGTERM and the in-training health monitors of one
    engine's training: ``train_state`` says where it is, ``checkpointer`` saves and loads
    it, ``reporter`` logs."""

    def __init__(
        self,
        config: Config,
        dist_ctx: DistributedContext,
        model_state: ModelState,
        train_state: TrainState,
        checkpointer: Checkpointer,
        reporter: Reporter,
    ) -> None:
        self._config, self._dist, self._train = config, dist_ctx, train_state
        self._checkpointer, self._reporter = checkpointer, reporter
        ck, health = config.checkpoint, config.health
        self.save_dir = ck.save_dir
        self.local_dir = ck.local_dir
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._last_save = time.monotonic()
        self._failed_saves = 0  # interval saves that failed in a row
        self.resumed_in_s = 0.0  # how long auto_resume's load took (0: nothing resumed)
        self._non_finite = NonFinitePolicy(health.non_finite.policy, health.non_finite.max_rollbacks)
        if health.non_finite.policy == "rollback" and self.save_dir is None:
            raise ValueError(
                "health.non_finite.policy 'rollback' goes back to the last checkpoint in checkpoint.save_dir; "
                "set checkpoint.save_dir (and an interval: checkpoint.interval_steps)"
            )
        self._straggler = None
        if health.straggler.enabled:
            self._straggler = StragglerDetector(
                health.straggler.every_n_steps,
                health.straggler.threshold,
                device=dist_ctx.device,
                pp_rank=dist_ctx.pp_rank,
                waited=lambda: collective_wait_s(model_state),
            )
            self._straggler.window_starts(train_state.global_steps + 1)
        self._watchdog = None
        if health.watchdog.enabled and self._world > 1:
            from terascale.health.watchdog import CollectiveWatchdog

            self._watchdog = CollectiveWatchdog(dist_ctx, timeout_s=health.watchdog.timeout_s, blocked_only=True)
        self._signal = None
        if ck.save_on_signal and self.save_dir:
            training_thread = threading.get_ident()
            self._signal = SigtermWatch(ck.signal_deadline_s, lambda: waiting_in(training_thread, dist_ctx))

    @property
    def checks_non_finite(self) -> bool:
        return self._non_finite.policy != "none"

    @property
    def straggler_report(self) -> Any:
        """The straggler detector's last report (None before its first check or when it is off)."""
        return None if self._straggler is None else self._straggler.last

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
        if self._signal is not None:
            self._signal.uninstall()

    # -- during the step -----------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str, timed: bool = True) -> Iterator[None]:
        """Mark ``name`` (forward/backward/step) for the watchdog, time it for the straggler
        check when ``timed``, and tell the SIGTERM watch if an exception leaves it."""
        self.mark(name)
        with self.guard(), self._straggler.phase() if self._straggler is not None and timed else nullcontext():
            yield

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Tell the SIGTERM watch when an error leaves the block: a SIGTERM then ends the
        process at once ([Note: saving on SIGTERM])."""
        try:
            yield
        except Exception:
            if self._signal is not None:
                self._signal.failed()
            raise

    def mark(self, name: str) -> None:
        """Tell the watchdog (and the SIGTERM watch) this rank reached ``name`` (step, save, load, ...)."""
        if self._watchdog is not None:
            self._watchdog.progress(self._train.micro_steps, name)
        if self._signal is not None:
            self._signal.progressed()

    def loss_flag(self) -> torch.Tensor | None:
        """With the non-finite check on: this rank's window loss as a term for the gradient
        norm's sum, 0 when finite and NaN when not, so that one all-reduce carries both
        (a bad loss anywhere makes the global norm NaN); None with the check off."""
        if not self.checks_non_finite:
            return None
        loss = self._train.window_loss
        return torch.where(torch.isfinite(loss), 0.0, float("nan")).to(torch.float32)

    def check_finite(self, norm: torch.Tensor) -> Verdict:
        """The fate of the step whose global gradient norm (with every rank's loss flag,
        :meth:`loss_flag`) is ``norm`` (see ``terascale.health.non_finite``); raises
        NonFiniteError to stop. Collective only when the norm is not finite: the ranks
        then name whose loss it was."""
        if bool(torch.isfinite(norm)):
            return self._non_finite.verdict(None)
        loss_bad = torch.tensor([0.0 if bool(torch.isfinite(self._train.window_loss)) else 1.0], device=self._dist.device)
        flags = [torch.empty_like(loss_bad) for _ in range(self._world)]
        if self._world > 1:
            comm_ops.all_gather(flags, loss_bad)
        else:
            flags = [loss_bad]
        ranks = tuple(r for r, f in enumerate(flags) if float(f) > 0)
        event = NonFiniteEvent(self._train.global_steps + 1, float(norm), ranks)
        verdict = self._non_finite.verdict(event)
        if event is not None and self._reporter.reports:
            logger.warning("%s: %s", event.describe(), {"skip": "step skipped", "rollback": "rolling back"}[verdict])
        return verdict

    def rollback(self) -> None:
        """Back to the last checkpoint in ``save_dir`` (collective). The data position is
        kept: the batches that went bad stay consumed."""
        self._checkpointer.wait()
        folder = self._newest_complete()
        if folder is None:
            raise NonFiniteError(f"health.non_finite.policy 'rollback': no checkpoint in '{self.save_dir}' to go back to")
        step = self._train.global_steps
        self.mark("load")
        # verify_content=False: _newest_complete compared the checksums already.
        self._checkpointer.load(folder, None, load_optimizer_states=True, load_lr_scheduler_states=True,
                                load_module_only=False, data_position=False, verify_content=False)  # fmt: skip
        if self._reporter.reports:
            logger.warning("rolled back from step %d to '%s' (step %d)", step + 1, folder, self._train.global_steps)

    def after_step(self) -> None:
        """After an optimizer step: the straggler check, then the saves that are due."""
        self.act_after_step(self.agree_after_step())

    def agree_after_step(self) -> tuple[bool, bool]:
        """The collective part of :meth:`after_step` (the straggler check, the flags):
        (any rank got SIGTERM, a timed save is due). A live elastic job runs it gated, so a
        peer lost here is a fault like any other ([Note: collectives after a fault])."""
        with self.guard():
            step = self._train.global_steps
            if self._straggler is not None:
                report = self._straggler.check(step)
                self._straggler.window_starts(step + 1)
                if report is not None and self._reporter.reports:
                    if report.stragglers:
                        logger.warning(report.describe())
                    self._reporter.write({"Health/straggler_max_ratio": report.max_ratio})
            return self._agree_on_flags()

    def act_after_step(self, agreed: tuple[bool, bool]) -> None:
        """The saves :meth:`agree_after_step` found due (never gated: a save's commit must
        not see a failed collective as done)."""
        with self.guard():
            self._act_after_step(*agreed)

    def _act_after_step(self, signalled: bool, due: bool) -> None:
        step = self._train.global_steps
        if signalled:
            self._save_and_exit()
        every = self._config.checkpoint.interval_steps
        if due or (every is not None and step % every == 0):
            self.save_now()

    def save_now(self) -> str:
        """An interval save: asynchronous, to ``local_dir`` then ``save_dir`` (or straight to
        ``save_dir``). Collective; returns the tag.

        The previous interval save having failed (a full disk, a filesystem gone for a
        while) is a warning and this one tries again, up to ``checkpoint.max_failed_saves``
        failures in a row: training goes on and the newest complete checkpoint stays as it
        was, where stopping would lose every step since it. A lost lease always stops."""
        assert self.save_dir is not None
        self.mark("save")
        self._last_save = time.monotonic()
        try:
            self._checkpointer.wait()
            self._failed_saves = 0
        except LeaseError:
            raise
        except CheckpointError as exc:
            self._failed_saves += 1
            limit = self._config.checkpoint.max_failed_saves
            if self._failed_saves >= limit:
                raise CheckpointError(f"{self._failed_saves} interval saves in a row failed (checkpoint.max_failed_saves "
                                      f"is {limit}); the last: {exc}") from exc  # fmt: skip
            if self._reporter.reports:
                logger.warning("%s; training goes on and saves again now (%d of %d failures in a row allowed)",
                               exc, self._failed_saves, limit - 1)  # fmt: skip
        if self.local_dir is not None:
            return self._checkpointer.save(self.local_dir, None, None, True, asynchronous=True, mirror_to=self.save_dir)
        return self._checkpointer.save(self.save_dir, None, None, True, asynchronous=True)

    def _agree_on_flags(self) -> tuple[bool, bool]:
        """(any rank got SIGTERM, interval_seconds elapsed on any rank): one small
        all-reduce, only when those features are on (clocks differ between ranks)."""
        interval = self._config.checkpoint.interval_seconds
        if self._signal is None and interval is None:
            return False, False
        due = interval is not None and time.monotonic() - self._last_save >= interval
        flags = torch.tensor([float(self._signal is not None and self._signal.received), float(due)], device=self._dist.device)
        if self._world > 1:
            comm_ops.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def _save_and_exit(self) -> None:
        """Every rank saw that one of them got SIGTERM ([Note: saving on SIGTERM]): save
        synchronously to ``save_dir`` (not ``local_dir``: the node may not come back) and
        exit with 143; the watch's deadline still ends the process if the save hangs."""
        assert self.save_dir is not None and self._signal is not None
        self._signal.saving()
        started = time.monotonic()
        try:
            self._checkpointer.wait()
        except Exception as exc:  # noqa: BLE001 - the save below supersedes it
            logger.warning("an earlier asynchronous save failed (%s); saving now", exc)
        self.mark("save")
        tag = self._checkpointer.save(self.save_dir, None, None, True, asynchronous=False)
        if self._reporter.reports:
            logger.warning(
                "SIGTERM: saved checkpoint '%s' in %.1f s (%.1f s after the signal); exiting",
                Path(self.save_dir) / tag, time.monotonic() - started, time.monotonic() - self._signal.received_at,
            )
        raise SystemExit(SIGTERM_EXIT_CODE)

    # -- at start-up -----------------------------------------------------------------------------

    def auto_resume(self) -> str | None:
        """Take the lease of ``save_dir`` (a directory another live job writes is refused
        before anything is read or written: [Note: checkpoint directory lease]); then, with
        ``checkpoint.auto_resume``, load the newest checkpoint every rank can read
        completely, from ``local_dir`` or ``save_dir``. Collective; returns its folder."""
        if self.save_dir is not None:
            self._checkpointer.hold(self.save_dir)
        if not self._config.checkpoint.auto_resume:
            return None
        folder = self._newest_complete()
        if folder is None:
            if self._reporter.reports:
                logger.info("auto_resume: no checkpoint in '%s' yet; starting from step 0", self.save_dir)
            return None
        self.mark("load")
        started = time.perf_counter()
        # verify_content=False: _newest_complete compared the checksums already.
        self._checkpointer.load(folder, None, load_optimizer_states=True, load_lr_scheduler_states=True,
                                load_module_only=False, verify_content=False)  # fmt: skip
        self.resumed_in_s = time.perf_counter() - started
        saved = Manifest.read(folder)
        if self._reporter.reports:
            logger.info("auto_resume: resumed from '%s' at step %d in %.2f s (saved on %d ranks, now %d)",
                        folder, self._train.global_steps, self.resumed_in_s, saved.world_size, self._world)  # fmt: skip
        self._last_save = time.monotonic()
        if self._straggler is not None:
            self._straggler.window_starts(self._train.global_steps + 1)
        return str(folder)

    def _newest_complete(self) -> Path | None:
        """The newest checkpoint (by step; the local copy first at equal steps) that is
        complete on every rank; newer incomplete ones are named in a warning. Collective.

        Each rank verifies candidates newest first and stops at the first complete one;
        the ranks then agree on the oldest of their picks, and check again below it until
        all picks are the same (a node-local copy is complete only where it was written).
        With ``checkpoint.verify_content`` each rank also compares the checksums of its
        share of a candidate's files, so the agreement passes over a corrupted one
        (``[Note: checkpoint checksums]``).
        """
        roots = [d for d in (self.local_dir, self.save_dir) if d is not None]
        bound = None
        problems: set[str] = set()
        rank = dist.get_rank() if dist.is_initialized() else 0
        content = self._config.checkpoint.verify_content
        checked: dict[str, str | None] = {}  # a folder's problem: each is read once, not once a round
        while True:
            mine = _best_complete(roots, bound, content=content, share=(rank, self._world), checked=checked)
            everyone: list[Any] = [None] * self._world
            if self._world > 1:
                comm_ops.all_gather_object(everyone, mine, group=self._checkpointer.coordination_group())
            else:
                everyone = [mine]
            problems |= {p for _, ps in everyone for p in ps}
            picks = [pick for pick, _ in everyone]
            chosen = None if None in picks else min(picks)
            if chosen is None or all(pick == chosen for pick in picks):
                break
            bound = chosen
        if problems and self._reporter.reports:
            for text in sorted(problems):
                logger.warning("not resuming from an incomplete checkpoint: %s", text)
        return None if chosen is None else Path(chosen[2])


def _best_complete(
    roots: list[str], bound: tuple | None, *, content: bool = False, share: tuple[int, int] = (0, 1),
    checked: dict[str, str | None] | None = None,
) -> tuple[tuple[int, int, str] | None, list[str]]:
    """The newest complete checkpoint ``(step, preference, folder)`` under ``roots`` not
    newer than ``bound`` (the first root preferred at equal steps), and the problems of the
    newer ones passed over. ``content``, ``share``: as :func:`verify`'s; ``checked`` keeps
    the folders verified already and their problems."""
    checked = {} if checked is None else checked
    candidates = []
    for preference, root in enumerate(reversed(roots)):
        directory = CheckpointDirectory(root)
        if directory.root.is_dir():
            for folder in directory.root.iterdir():
                if folder.is_dir() and not folder.name.startswith("."):
                    candidates.append((_step_of(folder), preference, str(folder)))
    problems = []
    for candidate in sorted(candidates, reverse=True):
        if bound is not None and candidate > bound:
            continue
        if candidate[2] not in checked:
            checked[candidate[2]] = verify(Path(candidate[2]), content=content, share=share)
        problem = checked[candidate[2]]
        if problem is None:
            return candidate, problems
        problems.append(f"'{candidate[2]}': {problem}")
    return None, problems


def _step_of(folder: Path) -> int:
    """The optimizer step a checkpoint folder was saved at: from its default tag
    (``global_step<N>``), else its manifest, else -1 (tried last)."""
    digits = folder.name.removeprefix("global_step")
    if digits.isdigit():
        return int(digits)
    try:
        return int(Manifest.read(folder).engine["global_steps"])
    except Exception:  # noqa: BLE001 - unreadable: verify() will say why
        return -1
