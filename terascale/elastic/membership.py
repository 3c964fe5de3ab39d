"""Membership epochs of a live elastic job, kept in a c10d store.

[Note: membership epochs]
A live elastic job (``terascale run --nnodes MIN:MAX``) keeps its rank processes when
nodes leave or join. Who trains is a sequence of *epochs*: epoch ``e`` is a list of
member ids, and a member's rank in epoch ``e`` is its index in that list. The list is
written once, with ``compare_set`` on the store's key ``members/<e>``: whoever writes
first decides, every other member reads the same list, so the members of an epoch always
agree (no two formations can train as epoch ``e``). The store is torch's own
(``dist.TCPStore`` hosted by the agent that owns the rendezvous endpoint, or any
``dist.Store``, such as the etcd store of ``torch.distributed.elastic``): every fact the
job agrees on is one of its keys.

* **Liveness.** Each member process runs a heartbeat thread that increments its counter
  ``hb/<id>`` every ``interval`` seconds. A member is alive when its counter moved within
  the last ``expiry`` seconds, as seen by the reader: counters, not clocks, so machines
  need not agree on the time. The thread keeps beating while the main thread waits in a
  collective; a process that is killed or stopped (SIGSTOP, a frozen VM) stops beating.
* **Joining.** A new process registers ``join/<n>`` (its id) and waits for the next epoch
  that lists it. At job start nobody trains: the first epoch is decided by whichever
  joiner finds at least ``min_members`` live joiners and has waited ``last_call``
  seconds for more.
* **Growing** (a planned change). At an optimizer-step boundary epoch ``e``'s rank 0 sees
  live joiners and writes ``resize/<e>`` = the next step; every member reads that key at
  each boundary, and they all leave epoch ``e`` after that step. The key is written at
  boundary ``s`` for boundary ``s + 1``: no member can finish step ``s + 1`` (its
  collectives need rank 0) before rank 0 wrote it, so every member sees it in time
  without a collective of its own.
* **Shrinking** (a fault). A member whose collective fails or times out writes
  ``fault/<e>`` and decides epoch ``e + 1`` from liveness: epoch ``e``'s members and the
  joiners whose counters move during one ``expiry`` window. Members that arrive after the
  decision read it. A member left out (it was stopped past the expiry) is *fenced*: it
  holds no rank in any later epoch and must join again as a new member, with a new id;
  the checkpoint lease refuses its writes ([Note: checkpoint directory lease]).

torch's dynamic rendezvous (``DynamicRendezvousHandler``) forms a round the same way but
detects a lost node only by keep-alive expiry and polls the store once a second while it
waits, so a shrink costs the expiry plus up to two seconds of polling before any work;
here a fault is detected by the failed collective, waits are on store keys (``wait``
returns as the key is written), and the expiry is short because a falsely dropped
member is fenced, not allowed to split the job.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

logger = logging.getLogger("terascale")

# Environment a live elastic agent gives each rank process ([Note: the live elastic agent]).
ENV_STORE = "TERASCALE_ELASTIC_STORE"  # host:port of the job's TCPStore
ENV_RUN_ID = "TERASCALE_ELASTIC_RUN_ID"
ENV_NODE = "TERASCALE_ELASTIC_NODE"  # the agent's id: members with the same one share a machine
ENV_MIN = "TERASCALE_ELASTIC_MIN"  # members (ranks), not nodes
ENV_MAX = "TERASCALE_ELASTIC_MAX"
ENV_LAST_CALL = "TERASCALE_ELASTIC_LAST_CALL"
# Waits poll the store (a check is ~0.1 ms): store.wait would log a warning at every timeout.
POLL_S = 0.02
# After the restart path, how long the next epoch waits for the members to come back.
RESTART_WAIT_S = 60.0


@dataclass(frozen=True)
class Timing:
    """How fast members are seen alive or dead, in seconds."""

    interval: float = 0.2  # between heartbeats
    expiry: float = 1.0  # a counter that did not move for this long: the member is gone
    last_call: float = 0.5  # at job start, how long a quorum waits for more joiners
    join_timeout: float = 600.0  # how long a joiner waits for an epoch that takes it


@dataclass(frozen=True)
class Epoch:
    """One membership: ``members`` (ids, in rank order) and the node of each."""

    number: int
    members: tuple[str, ...]
    nodes: tuple[str, ...]
    carried: tuple[str, ...] = ()  # members that were in the epoch before: they hold the state

    def rank_of(self, member: str) -> int:
        return self.members.index(member)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "nodes": list(self.nodes),
                           "carried": list(self.carried)})  # fmt: skip

    @classmethod
    def from_json(cls, text: str | bytes) -> Epoch:
        d = json.loads(text)
        return cls(int(d["number"]), tuple(d["members"]), tuple(d["nodes"]), tuple(d.get("carried", ())))


class FencedError(RuntimeError):
    """This process was left out of the job's membership (it stopped answering)."""


class JobClosed(RuntimeError):
    """The job finished while this process waited to join."""


class Membership:
    """This process's view of the job's epochs, over ``store`` (keys under ``run_id``).

    ``node`` groups members that share a machine (mirrors go to another node). The id of
    this process is new for every ``Membership``: a process that was fenced and joins
    again is a new member.
    """

    def __init__(self, store: dist.Store, run_id: str, node: str, *, min_members: int, max_members: int,
                 timing: Timing = Timing(), allowed: Callable[[int], bool] | None = None) -> None:  # fmt: skip
        assert 1 <= min_members <= max_members, (min_members, max_members)
        self.store = dist.PrefixStore(f"terascale/elastic/{run_id}/", store)
        self.node, self.timing = node, timing
        self.min_members, self.max_members = min_members, max_members
        self.allowed = allowed or (lambda world: True)  # world sizes the job can train at
        self.id = f"{node}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.epoch: Epoch | None = None
        self._seen: dict[str, tuple[int, float | None]] = {}  # member -> (counter, when it was read)
        self._ever: set[str] = set()  # members of any epoch up to _members_known
        self._members_known = 0
        self._stop = threading.Event()
        self._beat_count = 0
        # Not a daemon: a daemon thread inside a store call when the interpreter finalizes
        # aborts the process ("terminate called without an active exception"). It ends
        # with the main thread instead (or at close).
        self._beats = threading.Thread(target=self._beat, name="terascale-heartbeat")
        self.store.set(f"node/{self.id}", node)
        self._beat_once()
        self._beats.start()

    # -- heartbeats ---------------------------------------------------------------------

    def _beat_once(self) -> None:
        self.store.add(f"hb/{self.id}", 1)

    def _beat(self) -> None:
        main = threading.main_thread()
        while not self._stop.wait(self.timing.interval) and main.is_alive():
            try:
                self._beat_once()
            except Exception:  # the store is gone: the job is over or its host died
                return

    def close(self) -> None:
        """Stop beating (others see this member gone after the expiry)."""
        self._stop.set()
        if self._beats.is_alive() and self._beats is not threading.current_thread():
            self._beats.join()

    def counters(self, members: Sequence[str]) -> list[int]:
        return [self.store.add(f"hb/{m}", 0) for m in members]

    def alive(self, members: Sequence[str], window: float | None = None) -> list[str]:
        """The ``members`` whose heartbeat moved within ``window`` (default the expiry),
        watched from now: returns as soon as every one of them moved."""
        window = self.timing.expiry if window is None else window
        first = self.counters(members)
        moved = [False] * len(members)
        deadline = time.monotonic() + window
        while True:
            now = self.counters(members)
            moved = [m or a != b for m, a, b in zip(moved, first, now)]
            if all(moved) or time.monotonic() >= deadline:
                return [m for m, ok in zip(members, moved) if ok]
            time.sleep(min(self.timing.interval / 2, max(0.0, deadline - time.monotonic())))

    # -- reading the job's keys -----------------------------------------------------------

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def current(self) -> int:
        """The newest decided epoch's number (0: none yet)."""
        return int(self.store.add("epoch", 0))

    def read_epoch(self, number: int) -> Epoch | None:
        text = self._get(f"members/{number}")
        return None if text is None else Epoch.from_json(text)

    def joiners(self) -> list[str]:
        """Every member that asked to join, in the order they asked."""
        n = int(self.store.add("joins", 0))
        return [self.store.get(f"join/{k}").decode() for k in range(1, n + 1)]

    def node_of(self, member: str) -> str:
        return self.store.get(f"node/{member}").decode()

    def closed(self) -> bool:
        return self.store.check(["closed"])

    def close_job(self) -> None:
        """Say the job is over: processes still waiting to join exit."""
        self.store.set("closed", "1")

    # -- deciding an epoch ----------------------------------------------------------------

    def _decide(self, number: int, candidates: Sequence[str]) -> Epoch:
        """Write epoch ``number`` from ``candidates`` (alive, in rank order) unless someone
        already did; return the one written."""
        members = list(dict.fromkeys(candidates))[: self.max_members]
        while members and not self.allowed(len(members)):
            members.pop()  # the rest stand by for a later epoch
        before = self.read_epoch(number - 1) if number > 1 else None
        carried = tuple(m for m in members if before is not None and m in before.members)
        proposal = Epoch(number, tuple(members), tuple(self.node_of(m) for m in members), carried)
        written = self.store.compare_set(f"members/{number}", "", proposal.to_json())
        epoch = Epoch.from_json(written)
        if epoch == proposal:
            logger.info("elastic: epoch %d decided: %d member(s) %s", number, len(members), members)
            # The newest epoch's number only grows (a slow decider of an older one cannot lower it).
            self.store.add("epoch", max(0, number - self.current()))
        return epoch

    def _waiting_joiners(self, known: Sequence[str]) -> list[str]:
        return [j for j in self.joiners() if j not in known]

    def pending_joiners(self) -> list[str]:
        """Live joiners no epoch ever held, without waiting: a joiner counts once its
        counter moved between two looks at most ``expiry`` apart (rank 0 asks at step
        boundaries; a look long ago says nothing about now)."""
        assert self.epoch is not None
        now = time.monotonic()
        for k in range(self._members_known + 1, self.epoch.number + 1):  # every member so far, once
            past = self.read_epoch(k)
            self._ever.update(past.members if past is not None else ())
        self._members_known = self.epoch.number
        live = []
        for j in self._waiting_joiners(tuple(self._ever)):
            count = self.store.add(f"hb/{j}", 0)
            seen = self._seen.get(j)
            self._seen[j] = (count, now)
            if seen is not None and seen[0] != count and now - (seen[1] or 0.0) <= self.timing.expiry:
                if not self._left(j):
                    live.append(j)
        return live

    def _expected(self, number: int, live: Sequence[str]) -> int:
        """How many joiners the epoch after ``number`` waits for when ``number`` ended on
        the restart path: its members come back as new ones, beside those that waited."""
        marker = self._get(f"restart/{number}")
        epoch = self.read_epoch(number)
        if marker is None or epoch is None:
            return 0
        coming = sum(1 for m in epoch.members if self._get(f"left/{m}") == "restart")
        waited = [j for j in self.joiners()[: int(marker)] if j not in epoch.members and j in live]
        return min(self.max_members, coming + len(waited))

    def leave_for_restart(self) -> None:
        """This member ends for the restart path; its agent starts it again as a new one."""
        assert self.epoch is not None
        self.store.compare_set(f"restart/{self.epoch.number}", "", str(int(self.store.add("joins", 0))))
        self.store.set(f"left/{self.id}", "restart")
        self.close()

    def _gone(self, epoch: Epoch | None) -> bool:
        """Whether every member of ``epoch`` left or stopped beating (watched across calls)."""
        if epoch is None:
            return False
        now = time.monotonic()
        for m in epoch.members:
            if self._left(m):
                continue
            count = self.store.add(f"hb/{m}", 0)
            seen = self._seen.get(m)
            if seen is None or seen[0] != count:
                self._seen[m] = (count, now)
                return False
            if now - (seen[1] or now) < self.timing.expiry:
                return False
        return True

    def _left(self, member: str) -> bool:
        return self.store.check([f"left/{member}"])

    def join(self) -> Epoch:
        """Register and wait for an epoch that lists this process; returns it.

        Raises JobClosed if the job ends first, TimeoutError after ``join_timeout``.
        """
        n = self.store.add("joins", 1)
        self.store.set(f"join/{n}", self.id)
        self.registered_at = time.time()  # when the running members can first see this joiner
        deadline = time.monotonic() + self.timing.join_timeout
        number = self.current()
        quorum_since: float | None = None
        gone_since: float | None = None
        while time.monotonic() < deadline:
            if self.closed():
                raise JobClosed("the job finished before this process could join it")
            nxt = self.read_epoch(number + 1)
            if nxt is not None:
                number += 1
                if self.id in nxt.members:
                    self.epoch = nxt
                    return nxt
                continue
            if number == 0 or self._gone(self.read_epoch(number)):
                # Nobody trains (job start, or every member of the newest epoch is gone):
                # the joiners form the next epoch themselves.
                live = self.alive(self._waiting_joiners(()), window=self.timing.interval * 3)
                live = [j for j in live if not self._left(j)]
                gone_since = gone_since or time.monotonic()
                need = self._expected(number, live) if time.monotonic() - gone_since < RESTART_WAIT_S else 0
                if len(live) >= self.max_members or (
                    len(live) >= max(self.min_members, need)
                    and quorum_since is not None
                    and time.monotonic() - quorum_since >= self.timing.last_call
                ):
                    self._decide(number + 1, live)
                    continue
                quorum_since = (quorum_since or time.monotonic()) if len(live) >= self.min_members else None
            time.sleep(POLL_S)
        raise TimeoutError(f"no epoch of the job took this process within {self.timing.join_timeout:.0f} s")

    def next_planned(self) -> Epoch:
        """Leave the current epoch at a planned resize: the next epoch holds its members
        that are alive and the live joiners (in that order)."""
        assert self.epoch is not None
        number = self.epoch.number + 1
        written = self.read_epoch(number)
        if written is not None:
            return self._enter(written)
        request = json.loads(self._get(f"resize/{self.epoch.number}") or '{"joiners": []}')
        return self._enter(self._decide(number, [*self.epoch.members, *request["joiners"]]))

    def after_fault(self) -> Epoch:
        """Leave the current epoch after a failed collective: the next epoch holds the
        members and joiners that are alive. Raises FencedError if this process is not
        among them."""
        assert self.epoch is not None
        number = self.epoch.number + 1
        self.store.set(f"fault/{self.epoch.number}", self.id)
        written = self.read_epoch(number)
        if written is None:
            waiting = [j for j in self._waiting_joiners(self.epoch.members) if not self._left(j)]
            live = self.alive([*self.epoch.members, *waiting])
            written = self._decide(number, live)
        return self._enter(written)

    def _enter(self, epoch: Epoch) -> Epoch:
        if self.id not in epoch.members:
            self.epoch = None
            raise FencedError(
                f"member {self.id} is not in epoch {epoch.number} of the job (it stopped answering for longer "
                f"than {self.timing.expiry:.1f} s): it may join again as a new member"
            )
        self.epoch = epoch
        return epoch

    def faulted(self) -> bool:
        """Whether some member reported a failure in the current epoch."""
        return self.epoch is not None and self.store.check([f"fault/{self.epoch.number}"])

    # -- planned resizes ------------------------------------------------------------------

    def request_resize(self, after_step: int, joiners: Sequence[str]) -> int:
        """Ask every member to leave the current epoch after ``after_step`` for one that
        adds ``joiners``; returns the step all of them will leave after (an earlier
        request wins)."""
        assert self.epoch is not None
        key = f"resize/{self.epoch.number}"
        value = json.dumps({"after": after_step, "joiners": list(joiners)})
        return int(json.loads(self.store.compare_set(key, "", value))["after"])

    def resize_after(self) -> int | None:
        """The step after which the current epoch ends, if a resize was requested."""
        assert self.epoch is not None
        text = self._get(f"resize/{self.epoch.number}")
        return None if text is None else int(json.loads(text)["after"])

    def leave(self) -> None:
        """This process is done (its training finished): stop beating, say so."""
        try:
            self.store.set(f"left/{self.id}", "1")
        except Exception:  # noqa: BLE001 - the store's host already ended the job
            pass
        self.close()
