"""Random number streams that a recompute replays exactly, and the model-parallel tracker.

[Note: RNG replay]
A checkpointed function runs twice: in forward, and again inside backward to rebuild
what it saved. Dropout masks drawn the second time must equal the first ones, so the
forward snapshots every stream the function may draw from - the CPU generator, the
accelerator generator of the training device, and each named stream of the
:class:`RNGStatesTracker` - and the recompute runs with those snapshots restored, then
puts back whatever state the streams had before it (backward must not disturb the draws
the next forward makes).

The tracker is Megatron's: tensor-parallel ranks hold slices of one layer, so dropout
inside a sliced region must differ across them (the ``model-parallel-rng`` stream, seeded
per tensor-parallel rank), while dropout on replicated activations must agree (the
default stream, seeded the same on every tensor-parallel rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718  # Megatron's: keeps the tensor-parallel streams apart from the default


def _device_module(device: torch.device):
    """The ``torch.cuda``-like module of ``device``, or None for the CPU."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type, None)


def default_device() -> torch.device:
    """The accelerator this process trains on, or the CPU."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device("cpu") if acc is None else torch.device(acc.type, torch.accelerator.current_device_index())


def get_state(device: torch.device) -> torch.Tensor:
    """The generator state of ``device`` (the CPU generator for ``cpu``)."""
    mod = _device_module(device)
    return torch.get_rng_state() if mod is None else mod.get_rng_state(device)


def set_state(device: torch.device, state: torch.Tensor) -> None:
    mod = _device_module(device)
    if mod is None:
        torch.set_rng_state(state)
    else:
        mod.set_rng_state(state, device)


class RNGStatesTracker:
    """Named generator states of one device, forked into for a region of code.

    ``add(name, seed)`` creates a stream; ``with fork(name):`` draws from it and leaves the
    device's default stream where it was. ``get_states``/``set_states`` snapshot and
    restore every stream (activation checkpointing and checkpoint files use them).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def _device(self) -> torch.device:
        return self.device if self.device is not None else default_device()

    def reset(self) -> None:
        self._states = {}
        self._seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already seeds another stream of the RNG tracker")
        if name in self._states:
            raise ValueError(f"the RNG tracker already has a stream named '{name}'")
        self._seeds.add(seed)
        device = self._device()
        saved = get_state(device)
        try:
            if device.type == "cpu":
                torch.manual_seed(seed)
            else:
                _device_module(device).manual_seed(seed)
            self._states[name] = get_state(device)
        finally:
            set_state(device, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is untouched."""
        if name not in self._states:
            raise ValueError(
                f"the RNG tracker has no stream '{name}'; call model_parallel_manual_seed(seed) "
                "(or get_rng_tracker().add(name, seed)) first"
            )
        device = self._device()
        saved = get_state(device)
        set_state(device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = get_state(device)
            set_state(device, saved)


@dataclass
class RNGSnapshot:
    """Every stream a checkpointed function may draw from (see [Note: RNG replay])."""

    cpu: torch.Tensor
    device: torch.device
    device_state: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def take(cls, device: torch.device, tracker: RNGStatesTracker | None) -> RNGSnapshot:
        accelerated = device.type != "cpu"
        return cls(
            cpu=torch.get_rng_state(),
            device=device,
            device_state=get_state(device) if accelerated else None,
            tracker=tracker.get_states() if tracker is not None else {},
        )

    def restore(self, tracker: RNGStatesTracker | None) -> None:
        torch.set_rng_state(self.cpu)
        if self.device_state is not None:
            set_state(self.device, self.device_state)
        if tracker is not None:
            tracker.set_states(self.tracker)


@contextlib.contextmanager
def replaying(snapshot: RNGSnapshot, tracker: RNGStatesTracker | None) -> Iterator[None]:
    """Run the block with ``snapshot``'s streams, then restore the streams as they were."""
    current = RNGSnapshot.take(snapshot.device, tracker)
    snapshot.restore(tracker)
    try:
        yield
    finally:
        current.restore(tracker)


def model_parallel_seeds(seed: int, tp_rank: int) -> tuple[int, int]:
    """(default-stream seed, tensor-parallel stream seed) of tensor-parallel rank ``tp_rank``:
    the default stream is shared by the tensor-parallel ranks, the other differs per rank."""
    return seed, seed + _SEED_OFFSET + tp_rank


def seed_model_parallel(tracker: RNGStatesTracker, seed: int, tp_rank: int) -> None:
    """Seed the device's default stream with ``seed`` and give ``tracker`` a fresh
    ``model-parallel-rng`` stream seeded per tensor-parallel rank."""
    shared, own = model_parallel_seeds(seed, tp_rank)
    device = tracker._device()
    if device.type == "cpu":
        torch.manual_seed(shared)
    else:
        _device_module(device).manual_seed(shared)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, own)
