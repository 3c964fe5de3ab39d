"""``engine.offload_states()`` / ``reload_states()``: lend the device memory of model states
to other work between training phases (an RLHF loop generating with the same GPUs).

[Note: offloading states by storage]
The states are moved storage by storage, not tensor by tensor: each device storage the
chosen tensors live in is copied to host memory and resized to zero bytes, and on reload
resized back and refilled. Every tensor object and every view stays what it was (masters
that are views into a flat shard, optimizer moments the optimizer holds by identity,
parameters that are views into a group's buffer), so nothing has to be re-pointed, the
same way ZeRO-3 frees a gathered group (DESIGN.md, "Groups of flat shards"). Between the two
calls the states must not be used: the engine refuses
a forward, backward or step until ``reload_states()``.

What moves, by DeepSpeed's names: ``optim_states`` (the optimizer's state tensors),
``hp_params`` (the fp32 masters), ``lp_params`` (the module's parameters and, at stage 3,
their shards), ``lp_grads`` (gradients held in ``.grad``; none between steps). The model
state's own gradient buffers stay (``contiguous_grad_buffer`` is accepted and moves
nothing). States already in host memory (the CPU, offload tiers) are left where they are.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

import torch

from terascale.engine.deepspeed_api import OffloadStateTypeEnum

if TYPE_CHECKING:
    from terascale.engine.engine import Engine


class OffloadedStates:
    """Device storages emptied by :func:`offload_engine_states`, with their host copies."""

    def __init__(self, storages: list[tuple[torch.UntypedStorage, torch.Tensor]]) -> None:
        self._storages = storages

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self._storages)

    def reload(self, non_blocking: bool = False) -> None:
        """Give every storage its bytes back (``non_blocking``: the copies run on the current
        stream, so later device work sees them)."""
        for storage, host in self._storages:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=non_blocking)
        self._storages = []


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _tensors(engine: Engine, kinds: set[str]) -> Iterable[torch.Tensor]:
    optimizer = engine.optimizer
    if "optim_states" in kinds:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    if "hp_params" in kinds:
        for group in optimizer.param_groups:
            yield from group["params"]
    if "lp_params" in kinds:
        yield from engine.module.parameters()
        # ZeRO-3 parameter shards (the parameters themselves are empty views between uses).
        yield from (fg.shard for fg in getattr(engine.model_state, "groups", ()))
    if "lp_grads" in kinds:
        for p in [*engine.module.parameters(), *(m for g in optimizer.param_groups for m in g["params"])]:
            if p.grad is not None:
                yield p.grad


def offload_engine_states(
    engine: Engine, include: Container[Any] | None, pin_memory: bool, non_blocking: bool
) -> OffloadedStates | None:
    """Move ``engine``'s device states of the kinds ``include`` (default: all) to host
    memory; returns what :meth:`OffloadedStates.reload` restores (None: nothing on a device)."""
    names = {k.value for k in OffloadStateTypeEnum}
    if include is None:
        kinds = names
    else:
        kinds = {str(getattr(k, "value", k)) for k in include}  # type: ignore[union-attr]
        unknown = kinds - names
        if unknown:
            raise ValueError(
                f"offload_states(include=...): unknown state types {sorted(unknown)}; known: {sorted(names)}"
            )
    seen: set[int] = set()
    storages: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
    for t in _tensors(engine, kinds):
        storage = t.untyped_storage()
        if t.device.type == "cpu" or storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin_memory)
        host.copy_(_bytes_of(storage), non_blocking=non_blocking)
        storages.append((storage, host))
    if not storages:
        return None
    # The copies must have read the device memory before it is given up.
    for device in {s.device for s, _ in storages}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for storage, _ in storages:
        storage.resize_(0)
    return OffloadedStates(storages)
