"""Activations and gradients between pipeline stages: point-to-point over the pp group.

[Note: shape negotiation]
A stage's output travels as its tensors alone; the receiver allocates buffers from a
*signature* it learnt once: for each item of the output (a tensor, or a tuple of items)
its dtype and shape, or, for a non-tensor item (None, a number, a string), its value.
The first time a chunk's output goes out in a run (one ``train_batch``/``eval_batch``),
the sender sends a one-element flag first: 0 when the signature is the one the receiver
already has, else the byte length of the new signature, which follows as JSON. Later
micro-batches of the run send no flag; their signature must not change within a run (a
ValueError says so). So shapes are negotiated on the first micro-batch of the first step
and again only when they change, at the price of one one-element message per boundary
per step. Gradients need no negotiation: a chunk's output gradients have the shapes and
dtypes of its floating-point outputs, which the sender of the activations knows.

Floating-point tensors that arrive are leaves with ``requires_grad`` when gradients are
enabled (integer tensors - masks, labels passed along - never); their gradients go back,
zeros where autograd gave none, so every message has a fixed layout.

[Note: in-place first layers]
The chunk does not get those leaves: autograd refuses an in-place op on a leaf that
requires grad, and a stage may well start with one (``ReLU(inplace=True)`` starts stage 1
of DeepSpeed's AlexNet pipeline example; in a plain model that layer's input is an
intermediate). DeepSpeed hands the chunk a clone of its received buffer; :func:`handoff`
hands it instead an alias made by an identity autograd function (:class:`_Handoff`):
a non-leaf over the same storage, whose gradient the function passes on to the leaf, so
an in-place first layer works and no copy of each activation is made or kept. The leaf's
values may then change under that layer; nothing reads them again, only its ``.grad``.

[Note: partitioned boundaries]
With tensor parallelism every tensor-parallel rank of a stage holds the same activation
at a stage boundary (a row-parallel output is all-reduced; a vocabulary-parallel
embedding too), and each sends it to its peer of the next stage, the rank with the same
tensor-parallel coordinate: tp copies of every message. With ``pipe_partitioned`` (and
``grad_partitioned`` for the gradients going back; DeepSpeed's keys, on by default) each
tensor-parallel rank r sends only part r of each floating-point tensor: the tensor
flattened, zero-padded to a multiple of tp, split in tp equal parts. The receiver puts
the part into its place in a padded flat buffer, all-gathers the buffer over its own
tensor-parallel group (once every transfer of the batch has arrived, in the batch's
order, the same on every tensor-parallel rank of the stage) and views the first
``numel`` elements in the tensor's shape. Integer tensors and constants go whole; the
signature (shapes, dtypes) describes the whole tensors and is negotiated whole.

So each boundary moves 1/tp of the bytes over the pipeline links (``sent_act_bytes`` and
``sent_grad_bytes`` of ``engine.pipeline_stats()`` count them), and the all-gather moves
(tp - 1)/tp of the tensor once more over the tensor-parallel links, the fastest ones
(see [Note: topology]). The gather is no part of autograd: the received activation is still a leaf
whose ``.grad`` is the whole gradient, which goes back partitioned the same way. This
relies on the tensors at a boundary being equal on every tensor-parallel rank of a stage
(as they are when the stage ends in a reduced row-parallel layer or a replicated one);
a stage whose output is a tensor-parallel slice must turn partitioning off. With tp = 1
(no group given) nothing is partitioned.

Transfers of one batch are posted with ``batch_isend_irecv`` (gloo runs it on CPU
tensors, NCCL as one group) and its receives waited for before the batch returns; a first activation
of a run is received in two steps (flag and signature, then the tensors), after the
batch's earlier transfers are posted. Every message on a pair of ranks is matched by
order (tag 0), as NCCL does, so the CPU tests exercise the order rules GPUs need.

[Note: sends in flight]
A stage needs what it receives at once, but nothing waits for what it sends: where the
backend gives one work per operation (gloo), a batch returns as soon as its receives are
in, and its sends finish under the next compute, waited for (and their buffers let go) at
the next batch or at the end of the run. Each send's peer posted the matching receive in
the same round of the schedule, so a send always completes without this stage's help;
waiting for it at once only added a transfer time to every round of the critical path
(measured: about 3 ms a round for a 1.5 MB activation on gloo, which on two stages cost
the interleaved schedule most of its smaller bubble). NCCL's coalesced batches are one
work, ordered on the stream: waited for as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops as comm_ops
from terascale.comm.collectives import all_gather_flat
from terascale.pipe.schedule import Instr, Op, StageGrid

Payload = Any  # a tensor, a non-tensor value, or a tuple of those (one level)
_CONSTANTS = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Signature:
    """What a receiver needs to rebuild a payload: ``tuple_`` (a tuple or one item) and
    per item ``("t", dtype, shape)`` or ``("c", value)``."""

    tuple_: bool
    items: tuple[tuple, ...]

    @classmethod
    def of(cls, payload: Payload) -> Signature:
        is_tuple = isinstance(payload, (tuple, list))
        items = []
        for item in payload if is_tuple else (payload,):
            if isinstance(item, torch.Tensor):
                items.append(("t", str(item.dtype).removeprefix("torch."), tuple(item.shape)))
            elif isinstance(item, _CONSTANTS):
                items.append(("c", item))
            else:
                raise ValueError(
                    f"a pipeline stage's output must be a tensor, a number/None/string or a tuple of those; "
                    f"got an item of type {type(item).__name__}"
                )
        return cls(is_tuple, tuple(items))

    def encode(self) -> bytes:
        return json.dumps([self.tuple_, [list(i) for i in self.items]]).encode()

    @classmethod
    def decode(cls, data: bytes) -> Signature:
        is_tuple, items = json.loads(data.decode())
        return cls(is_tuple, tuple(("t", i[1], tuple(i[2])) if i[0] == "t" else ("c", i[1]) for i in items))

    def float_shapes(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of each floating-point tensor item (the ones with gradients)."""
        out = []
        for item in self.items:
            if item[0] == "t" and getattr(torch, item[1]).is_floating_point:
                out.append((getattr(torch, item[1]), item[2]))
        return out


def tensors_of(payload: Payload) -> list[torch.Tensor]:
    items = payload if isinstance(payload, (tuple, list)) else (payload,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def float_tensors(payload: Payload) -> list[torch.Tensor]:
    """The floating-point tensors of ``payload``, in order (the ones gradients flow through)."""
    return [t for t in tensors_of(payload) if t.is_floating_point()]


@dataclass(frozen=True)
class Partitioning:
    """Which floating-point tensors cross a stage boundary as 1/tp parts over
    ``tp_group`` (see [Note: partitioned boundaries]); no group: none do."""

    tp_group: ProcessGroup | None = None
    activations: bool = False
    gradients: bool = False


def _part_numel(numel: int, parts: int) -> int:
    return -(-numel // parts)


def _own_part(t: torch.Tensor, parts: int, rank: int) -> torch.Tensor:
    """Part ``rank`` of ``t`` flattened and zero-padded to ``parts`` equal parts (a view when
    it needs no padding)."""
    n = _part_numel(t.numel(), parts)
    flat = t.detach().reshape(-1)
    lo, hi = min(rank * n, t.numel()), min((rank + 1) * n, t.numel())
    if hi - lo == n:
        return flat[lo:hi]
    out = torch.zeros(n, dtype=t.dtype, device=t.device)
    out[: hi - lo].copy_(flat[lo:hi])
    return out


class StageComm:
    """This stage's transfers (see [Note: shape negotiation]).

    ``group`` is the pipeline group (ranks in stage order); ``grid`` and ``stage`` place
    this rank; transfers use ``device`` tensors; ``partitioning`` says which tensors go as
    tensor-parallel parts ([Note: partitioned boundaries]). :meth:`exchange` runs one
    batch of a schedule: it takes the payloads to send, keyed by the instruction, and
    returns the received ones. :attr:`sent_bytes` counts the activation (``"act"``) and
    gradient (``"grad"``) bytes this rank sent in the current run.
    """

    def __init__(
        self,
        group: ProcessGroup,
        grid: StageGrid,
        stage: int,
        device: torch.device,
        partitioning: Partitioning | None = None,
    ) -> None:
        self.group = group
        self.grid = grid
        self.stage = stage
        self.device = device
        self.ranks = dist.get_process_group_ranks(group)
        part = partitioning or Partitioning()
        self.tp_group = part.tp_group
        self.tp = dist.get_world_size(part.tp_group) if part.tp_group is not None else 1
        self.tp_rank = dist.get_rank(part.tp_group) if part.tp_group is not None else 0
        self.split_acts = part.activations and self.tp > 1
        self.split_grads = part.gradients and self.tp > 1
        self.sent_bytes = {"act": 0, "grad": 0}
        self._sends: list[tuple[Any, torch.Tensor]] = []  # (work, buffer) of sends not yet waited for
        self._sent_sig: dict[int, Signature] = {}  # chunk -> signature its receiver holds
        self._recv_sig: dict[int, Signature] = {}  # chunk -> signature of its incoming activations
        self._out_sig: dict[tuple[int, int], Signature] = {}  # (mb, chunk) -> signature of what it sent
        self._run_sent: set[int] = set()  # chunks whose output went out in this run
        self._run_received: set[int] = set()
        if len(self.ranks) > 1:
            # NCCL creates a group's communicator on its first collective, which every rank
            # must join: do that here, where they all are, not inside a batch of sends.
            probe = torch.zeros(1, device=device)
            comm_ops.all_reduce(probe, group=group)

    def begin_run(self) -> None:
        """A new schedule run: the first activation of each chunk carries the flag again."""
        self._run_sent.clear()
        self._run_received.clear()
        self._out_sig.clear()
        self.sent_bytes = {"act": 0, "grad": 0}

    def _peer(self, ins: Instr) -> int:
        v = self.grid.virtual(self.stage, ins.chunk)
        target = v + 1 if ins.op in (Op.SEND_ACT, Op.RECV_GRAD) else v - 1
        return self.ranks[self.grid.place(target)[0]]

    def exchange(self, batch: Sequence[Instr], outgoing: dict[Instr, Any], requires_grad: bool) -> dict[Instr, Any]:
        """Post the transfers of ``batch`` in order and wait for them all.

        ``outgoing[ins]`` is the payload of a send (``SEND_ACT``: a stage output;
        ``SEND_GRAD``: the list of input gradients). Returns, per receive, the payload
        (``RECV_ACT``) or the list of output gradients (``RECV_GRAD``).
        """
        # The previous batch's sends had a compute phase to finish: their buffers may go now.
        self.finish_sends()
        ops: list[dist.P2POp] = []
        works: list[Any] = []  # what must finish before this returns: receives (and coalesced batches)
        received: dict[Instr, Any] = {}
        fill: list[tuple[Instr, Signature, list[torch.Tensor]]] = []
        gathers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (padded buffer, this rank's part of it)

        def flush() -> None:
            if not ops:
                return
            posted = comm_ops.batch_isend_irecv(list(ops))
            if len(posted) == len(ops):  # one work per operation (gloo): sends may finish later
                for op, work in zip(ops, posted):
                    if op.op is dist.isend:
                        self._sends.append((work, op.tensor))
                    else:
                        works.append(work)
            else:  # one work for the coalesced batch (NCCL): stream-ordered, waited as a whole
                works.extend(posted)
            ops.clear()

        for ins in batch:
            peer = self._peer(ins)
            if ins.op is Op.SEND_ACT:
                ops.extend(self._act_sends(ins, outgoing[ins], peer))
            elif ins.op is Op.SEND_GRAD:
                ops.extend(self._send(g, peer, "grad", self.split_grads) for g in outgoing[ins])
            elif ins.op is Op.RECV_ACT:
                if ins.chunk not in self._run_received:
                    flush()
                    self._negotiate(ins.chunk, peer)
                sig = self._recv_sig[ins.chunk]
                shapes = [(getattr(torch, item[1]), item[2]) for item in sig.items if item[0] == "t"]
                buffers = [self._recv(dtype, shape, peer, self.split_acts, ops, gathers) for dtype, shape in shapes]
                fill.append((ins, sig, buffers))
            else:
                assert ins.op is Op.RECV_GRAD, ins
                sig = self._out_sig.pop((ins.mb, ins.chunk))
                split = self.split_grads
                received[ins] = [self._recv(dtype, shape, peer, split, ops, gathers) for dtype, shape in sig.float_shapes()]
        flush()
        for work in works:
            work.wait()
        # Every part is in; the tensor-parallel ranks of this stage gather in the same order.
        assert self.tp_group is not None or not gathers
        pending = [all_gather_flat(full, own, self.tp_group, async_op=True) for full, own in gathers]
        for work in pending:
            work.wait()
        for ins, sig, buffers in fill:
            received[ins] = _rebuild(sig, buffers, requires_grad)
        return received

    def finish_sends(self) -> None:
        """Wait for the sends still in flight (see [Note: sends in flight]); the runner calls
        it at the end of every run."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _act_sends(self, ins: Instr, payload: Payload, peer: int) -> list[dist.P2POp]:
        sig = Signature.of(payload)
        self._out_sig[(ins.mb, ins.chunk)] = sig
        ops = []
        if ins.chunk not in self._run_sent:
            self._run_sent.add(ins.chunk)
            header = b"" if self._sent_sig.get(ins.chunk) == sig else sig.encode()
            self._sent_sig[ins.chunk] = sig
            flag = torch.tensor([len(header)], dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.isend, flag, peer, self.group))
            if header:
                data = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)
                ops.append(dist.P2POp(dist.isend, data, peer, self.group))
        elif self._sent_sig[ins.chunk] != sig:
            raise ValueError(
                f"pipeline stage {self.stage}: the output of chunk {ins.chunk} changed its shapes within one batch "
                f"(micro-batch {ins.mb}: {sig.items}, before: {self._sent_sig[ins.chunk].items}); give every "
                "micro-batch of a batch the same shapes (they may change from one batch to the next)"
            )
        ops += [self._send(t, peer, "act", self.split_acts) for t in tensors_of(payload)]
        return ops

    def _send(self, t: torch.Tensor, peer: int, kind: str, split: bool) -> dist.P2POp:
        """The send of ``t`` to ``peer``: whole, or this tensor-parallel rank's part of it
        when ``split`` and ``t`` is floating-point."""
        data = _own_part(t, self.tp, self.tp_rank) if split and t.is_floating_point() else t.detach()
        data = data.contiguous()
        self.sent_bytes[kind] += data.numel() * data.element_size()
        return dist.P2POp(dist.isend, data, peer, self.group)

    def _recv(
        self,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        peer: int,
        split: bool,
        ops: list[dist.P2POp],
        gathers: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """A ``dtype``/``shape`` tensor to be received from ``peer`` (its receive appended to
        ``ops``). With ``split`` and a floating-point ``dtype`` only this rank's part
        arrives, into its place in a padded buffer that ``gathers`` completes later; the
        tensor returned is a view of that buffer."""
        numel = math.prod(shape)
        if not (split and dtype.is_floating_point) or numel == 0:  # an empty part is an empty tensor
            out = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, out, peer, self.group))
            return out
        n = _part_numel(numel, self.tp)
        full = torch.empty(n * self.tp, dtype=dtype, device=self.device)
        own = full[self.tp_rank * n : (self.tp_rank + 1) * n]
        ops.append(dist.P2POp(dist.irecv, own, peer, self.group))
        gathers.append((full, own))
        return full[:numel].view(shape)

    def _negotiate(self, chunk: int, peer: int) -> None:
        """Receive the flag (and a new signature) of ``chunk``'s first activation in this run."""
        self._run_received.add(chunk)
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        comm_ops.recv(flag, peer, group=self.group)
        length = int(flag.item())
        if length:
            data = torch.empty(length, dtype=torch.uint8, device=self.device)
            comm_ops.recv(data, peer, group=self.group)
            self._recv_sig[chunk] = Signature.decode(bytes(data.cpu().tolist()))
        assert chunk in self._recv_sig, "the first activation of a chunk came without its signature"


class _Handoff(torch.autograd.Function):
    """Identity from a received leaf to the chunk's input (see [Note: in-place first layers])."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        # Not ``leaf`` itself nor a view of it: autograd would make the output a view of the
        # leaf, and an in-place op on a view of a leaf is refused just the same.
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def handoff(payload: Payload) -> Payload:
    """``payload`` (as :meth:`StageComm.exchange` received it) for the chunk: each tensor
    that requires grad replaced by an alias an in-place op may modify, whose gradient
    reaches the received leaf (see [Note: in-place first layers])."""

    def alias(item: Any) -> Any:
        return _Handoff.apply(item) if isinstance(item, torch.Tensor) and item.requires_grad else item

    if isinstance(payload, tuple):
        return tuple(alias(item) for item in payload)
    return alias(payload)


def _rebuild(sig: Signature, buffers: list[torch.Tensor], requires_grad: bool) -> Payload:
    it = iter(buffers)
    items = []
    for item in sig.items:
        if item[0] == "t":
            t = next(it)
            if requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            items.append(t)
        else:
            items.append(item[1])
    return tuple(items) if sig.tuple_ else items[0]
