"""Each rank's state in a peer's host memory, refreshed behind compute.

[Note: in-memory redundancy]
After optimizer step ``s`` (every ``mirror_interval_steps``), a background thread copies
this rank's spans ([Note: state moves as spans]) into a host buffer, its *own snapshot*
of step ``s``, and sends it to its *receiver*, the rank with the same index on the next
node (ring order over nodes), while it receives its *sender*'s into a *mirror* buffer.
Masters and optimizer states change only in the optimizer step, which waits for the
thread (:meth:`Mirror.before_update`), so the copy runs under the next step's forward
and backward with no copy of its own first, as an asynchronous checkpoint does.

Each rank keeps the last two complete snapshots of its own and of its sender (the
buffers alternate): a fault while step ``s + 1``'s refresh is in flight leaves step
``s`` whole everywhere. After a fault the survivors restore the newest step that every
old rank's state exists for, on its own rank or in its receiver's mirror (at most the
step the fault interrupted and, when the fault lands inside the refresh, the one before
it, are lost). When a rank and its receiver both died there is no such step in memory:
the job falls back to the last checkpoint.

Host memory: four times the rank's state shard (two own snapshots, two mirrors), shown
as ``elastic_mirror`` in ``memory_breakdown()``. Parameters are not mirrored: a resize
casts them from the masters, as a checkpoint load does.
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from terascale.checkpoint.spans import Span
from terascale.comm import ops
from terascale.elastic.spans import PackedState, Piece
from terascale.elastic.world import collective_timeout

logger = logging.getLogger("terascale")


@dataclass
class Snapshot:
    """One rank's (``owner``, its rank in the epoch it was taken) state at ``step``."""

    owner: int
    step: int
    state: PackedState
    meta: dict[str, Any] = field(default_factory=dict)  # the training record and the owner's RNG


def ring_peers(nodes: Sequence[str], rank: int) -> tuple[int, int]:
    """(receiver, sender) of ``rank``: the ranks at the same index on the next and the
    previous node, nodes in order of first appearance; ``rank`` itself when it is alone
    (a single node: nothing is mirrored off it)."""
    order = list(dict.fromkeys(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    node = nodes[rank]
    index = members[node].index(rank)
    k = order.index(node)

    def at(j: int) -> int:
        ranks = members[order[j % len(order)]]
        return ranks[index % len(ranks)]

    if len(order) == 1:
        return rank, rank
    receiver = at(k + 1)
    # The sender is whoever has this rank as receiver (nodes of unequal sizes: maybe several).
    senders = [r for r in range(len(nodes)) if r != rank and _receiver(nodes, members, order, r) == rank]
    return receiver, (senders[0] if senders else rank)


def _receiver(nodes: Sequence[str], members: dict, order: list, r: int) -> int:
    node = nodes[r]
    index = members[node].index(r)
    ranks = members[order[(order.index(node) + 1) % len(order)]]
    return ranks[index % len(ranks)]


def _meta_bytes(meta: dict[str, Any]) -> torch.Tensor:
    buf = io.BytesIO()
    pickle.dump(meta, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


class Mirror:
    """This rank's own snapshots and its sender's mirrors in one epoch (``rank`` of the
    epoch, ``nodes``: the node of each rank). ``group`` is a gloo group of the epoch used
    only by the refresh thread."""

    def __init__(self, group: dist.ProcessGroup, rank: int, nodes: Sequence[str], every: int,
                 pin: bool = False) -> None:  # fmt: skip
        self.group, self.rank, self.every = group, rank, every
        self.receiver, self.sender = ring_peers(nodes, rank)
        self._pin = pin
        self.own: list[Snapshot] = []  # newest last, at most two complete
        self.mirrored: list[Snapshot] = []
        self._spare: list[PackedState] = []  # buffers of failed refreshes, for reuse
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_refresh_s = 0.0

    @property
    def off_node(self) -> bool:
        return self.receiver != self.rank

    def host_bytes(self) -> int:
        return sum(s.state.nbytes for s in self.own + self.mirrored) + sum(p.nbytes for p in self._spare)

    def _buffer(self, pieces: Sequence[Piece], ring: list[Snapshot]) -> PackedState:
        """A buffer for ``pieces``: the older of two complete snapshots' (never the newest)."""
        size = max((p.offset + p.nbytes for p in pieces), default=0)
        reusable = [ring.pop(0).state] if len(ring) >= 2 else []
        reusable += self._spare
        for k, old in enumerate(reusable):
            if old.nbytes == size:
                self._spare = [b for j, b in enumerate(reusable) if j != k][-2:]
                return PackedState(pieces, old.buffer)
        self._spare = reusable[-2:]
        return PackedState.empty(pieces, pin=self._pin)

    def due(self, step: int) -> bool:
        """Whether the state after ``step`` is snapshotted (every ``every`` steps)."""
        return self.every > 0 and step % self.every == 0

    def refresh(self, step: int, slices: list[tuple[Span, torch.Tensor]], meta: dict[str, Any]) -> None:
        """Start snapshotting ``slices`` (this rank's state after ``step``) and swapping it
        with the peers, in the background (:meth:`due` steps only)."""
        assert self.due(step), step
        self.wait()
        own = self._buffer(PackedState.layout(slices), self.own)
        # Not a daemon: the interpreter's exit waits for the refresh in flight (bounded by the
        # collective timeout), as a daemon thread inside gloo at finalization aborts the process.
        self._thread = threading.Thread(target=self._run, args=(step, slices, meta, own), name="terascale-mirror")
        self._thread.start()

    def _run(self, step: int, slices: list, meta: dict, own: PackedState) -> None:
        import time

        t0 = time.perf_counter()
        mirror = None
        try:
            own.fill(slices)
            if self.off_node:
                # The pieces travel with the record: optimizer state appears after the first step.
                payload = _meta_bytes({**meta, "pieces": own.pieces})
                their = torch.zeros(1, dtype=torch.int64)
                self._swap(torch.tensor([payload.numel()], dtype=torch.int64), their)
                their_meta = torch.empty(int(their.item()), dtype=torch.uint8)
                self._swap(payload, their_meta)
                received = pickle.loads(their_meta.numpy().tobytes())
                mirror = self._buffer(received.pop("pieces"), self.mirrored)
                self._swap(own.buffer, mirror.buffer)
                self.mirrored.append(Snapshot(self.sender, step, mirror, received))
            self.own.append(Snapshot(self.rank, step, own, meta))
        except BaseException as err:  # noqa: BLE001 - a peer died mid-refresh: the older snapshots stand
            if self._error is None:
                logger.warning("elastic: the mirror refresh of step %d failed (%s: %s); the older snapshots stand",
                               step, type(err).__name__, str(err).splitlines()[0][:200])  # fmt: skip
            self._error = err
            self._spare += [own] + ([mirror] if mirror is not None else [])
        self.last_refresh_s = time.perf_counter() - t0

    def _swap(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send ``send`` to the receiver while ``recv`` comes from the sender."""
        works = [ops.isend(send, self._global(self.receiver), group=self.group),
                 ops.irecv(recv, self._global(self.sender), group=self.group)]  # fmt: skip
        for w in works:
            w.wait(collective_timeout())  # a point-to-point wait has no timeout of its own

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def wait(self) -> None:
        """Finish the refresh in flight (a failed one only leaves the older snapshots)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def before_update(self) -> None:
        """The optimizer step is about to change the state the refresh reads: let it finish."""
        self.wait()

    def holdings(self) -> list[Snapshot]:
        """Every complete snapshot this rank holds (its own and its sender's)."""
        self.wait()
        return [*self.own, *self.mirrored]
