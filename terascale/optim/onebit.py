"""1-bit Adam (DeepSpeed's ``OnebitAdam``) and what the three 1-bit optimizers share.

[Note: optimizers that reduce their own gradients]
The 1-bit optimizers (this module's :class:`OneBitAdam`, :class:`terascale.optim.zoadam.
ZeroOneAdam`, :class:`terascale.optim.onebit_lamb.OneBitLamb`; arXiv 2102.02888,
2202.06009, 2104.06069) average *their own* state over the data-parallel group with the
1-bit compressed all-reduce ([Note: 1-bit compressed all-reduce]) instead of letting the
engine all-reduce the gradients. Such an optimizer implements :class:`ReducesOwnGradients`:

- ``reduces_gradients()``: whether the next optimizer step wants the window's gradients
  averaged over the group (warm-up steps, 0/1 Adam's variance steps) or each rank's own
  (every other step). The stage-0 model state asks it before each backward and then
  either all-reduces the buckets or leaves them local ([Note: windows without a
  reduction]). The answer depends only on the optimizer's step counters, so every rank
  gives the same one, and a skipped (fp16 overflow) step leaves it unchanged.
- ``rank_local_state(for_load)``: the tensors that differ between ranks (error feedback,
  and 0/1 Adam's local-step state) by a stable name, which checkpoints save per rank
  ([Note: rank-local checkpoint state] in ``terascale/engine/model_state.py``).

The engine connects the two in ``terascale.engine.optimizer.engine_optimizer`` and has no
branch of its own. Only ZeRO stage 0 (whole parameters, replicated optimizer state) with
plain data parallelism can run them, as in DeepSpeed; the engine refuses the rest.

What the engine does differently in a window without a reduction, as DeepSpeed does: the
gradient norm (clipping, fp16 overflow) is this rank's own, and the overflow verdict is
agreed over the group (any rank's overflow skips the step everywhere).

Common rules of the three, from DeepSpeed: no bias correction whatever ``bias_correction``
says (accepted and unused, as ``eps_inside_sqrt`` is); decoupled weight decay added to the
update (``p -= lr * (update + weight_decay * p)``); ``amsgrad`` refused; ``cuda_aware`` and
``comm_backend_name`` accepted and unused (the group's own backend runs the collectives:
gloo on CPU, NCCL on CUDA). A param group may carry ``exp_avg_mask``, a tensor shaped like
its parameters that multiplies the communicated momentum (1-bit signs cannot say 0:
momenta that must stay zero, such as unused embedding rows, need it).

Three differences from DeepSpeed, all deliberate:

- DeepSpeed's first ``step()`` only sets up its communication buffers: it updates nothing
  but counts as step 1, so it trains ``freeze_step - 1`` warm-up steps. Here every step
  updates: steps ``1..freeze_step`` are warm-up, the first compressed step is
  ``freeze_step + 1`` in both.
- In a compressed step every parameter takes part, a rank without a gradient for one
  counting it as zero: the compressed all-reduce is collective, and which parameters
  have a local gradient may differ between ranks. DeepSpeed skips a parameter with no
  gradient there, which would leave the ranks in different collectives.
- Checkpoints keep the error feedback per rank and restore it on the same number of
  ranks, so a resume is exact; DeepSpeed drops it on every load (here: only on a load at
  another world size, with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from terascale.comm.compressed import CompressedStats, compressed_allreduce_many, padded_numel
from terascale.optim.closure import evaluate

__all__ = ["OneBitAdam", "OneBitOptimizer", "ReducesOwnGradients"]

logger = logging.getLogger("terascale")

_BACKENDS = ("nccl", "mpi", "hccl", "compressed")  # DeepSpeed's comm_backend_name values


@runtime_checkable
class ReducesOwnGradients(Protocol):
    """An optimizer that averages its state over the data-parallel group itself
    (``[Note: optimizers that reduce their own gradients]``)."""

    def reduces_gradients(self) -> bool:
        """Whether the next step wants the window's gradients averaged over the group."""
        ...

    def rank_local_state(self, for_load: bool) -> dict[str, torch.Tensor]:
        """This rank's tensors that differ between ranks, by stable name (``for_load``:
        the ones a checkpoint of the current step would hold, reset as a load without
        them must leave them, to be filled in place)."""
        ...


class OneBitOptimizer(Optimizer):
    """What the 1-bit optimizers share: DeepSpeed's common arguments, the group, the error
    feedback buffers (one pair per communicated tensor, named), the byte count
    (``comm_stats``) and the schedule counters kept as 0-d tensors in each parameter's
    state (so checkpoints carry them like Adam's step)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        name: str,
        group: ProcessGroup | None,
        amsgrad: bool,
        max_grad_norm: float,
        cuda_aware: bool,
        comm_backend_name: str,
    ) -> None:
        if amsgrad:
            raise ValueError(f"{name} does not support amsgrad (neither does DeepSpeed's); remove it or set it to false")
        if max_grad_norm:
            raise ValueError(
                f"{name}: max_grad_norm is not used by DeepSpeed's {name} (it would be ignored); "
                "set the config's top-level gradient_clipping instead"
            )
        if comm_backend_name not in _BACKENDS:
            raise ValueError(f"{name}: comm_backend_name must be one of {', '.join(_BACKENDS)}, got {comm_backend_name!r}")
        super().__init__(params, defaults)
        if cuda_aware or comm_backend_name != "nccl":
            logger.debug("%s: cuda_aware/comm_backend_name %r are unused: the process group's backend communicates",
                         name, comm_backend_name)  # fmt: skip
        self._name = name
        self._group = group
        self.comm_stats = CompressedStats()  # bytes this rank sent compressing (for benchmarks)
        self._errors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (worker, server)

    # -- the group ---------------------------------------------------------------------------

    @property
    def group(self) -> ProcessGroup | None:
        """The data-parallel group averaged over (None: the default group)."""
        return self._group

    def world_size(self) -> int:
        """Ranks of the group (1 without a process group: nothing to compress)."""
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(self._group)

    # -- parameters and their state ------------------------------------------------------------

    def _keyed_params(self) -> list[tuple[str, dict[str, Any], torch.Tensor]]:
        """``(stable name, group, parameter)`` for every parameter, in group order: the
        same on every rank and in every run over the same param groups."""
        return [(f"{g}.{i}", group, p) for g, group in enumerate(self.param_groups) for i, p in enumerate(group["params"])]

    def _counter(self, key: str, default: int = 0) -> int:
        """Schedule counter ``key`` (kept alike in every parameter's state): the first's."""
        for group in self.param_groups:
            for p in group["params"]:
                value = self.state[p].get(key)
                if isinstance(value, torch.Tensor):
                    return int(value)
        return default

    def steps_done(self) -> int:
        """Optimizer steps taken so far (0 before the first)."""
        return self._counter("step")

    @staticmethod
    def _scalar(value: float | int, dtype: torch.dtype) -> torch.Tensor:
        """A 0-d CPU tensor: how per-parameter scalars live in the state (checkpoints save 0-d tensors)."""
        return torch.tensor(value, dtype=dtype)

    @staticmethod
    def _local_grad(p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient, zeros where this rank has none (a compressed step counts every parameter)."""
        return torch.zeros_like(p) if p.grad is None else p.grad

    @staticmethod
    def _masked(group: dict[str, Any], t: torch.Tensor) -> torch.Tensor:
        """``t`` times the group's ``exp_avg_mask`` when it has one (in place)."""
        mask = group.get("exp_avg_mask")
        if mask is not None:
            t.mul_(mask.to(t.device))
        return t

    # -- error feedback -----------------------------------------------------------------------

    def _error_pair(self, name: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (worker, server) error buffers of tensor ``name`` of ``numel`` elements,
        zeros when first asked for (sized for this group's world)."""
        pair = self._errors.get(name)
        if pair is None:
            world = self.world_size()
            padded = padded_numel(numel, world)
            device = self.param_groups[0]["params"][0].device
            pair = self._errors[name] = (
                torch.zeros(padded, dtype=torch.float32, device=device),
                torch.zeros(padded // world, dtype=torch.float32, device=device),
            )
        return pair

    def _compress(self, named: list[tuple[str, torch.Tensor]], in_place: bool = False) -> list[torch.Tensor]:
        """The 1-bit averages of ``named`` tensors over the group, each with its own error
        feedback, in one exchange (collective); ``in_place``: written into the tensors. On
        one rank: the tensors themselves, as DeepSpeed skips the compression there."""
        if self.world_size() == 1:
            return [t for _, t in named]
        pairs = [self._error_pair(name, t.numel()) for name, t in named]
        return compressed_allreduce_many(
            [t for _, t in named], [w for w, _ in pairs], [s for _, s in pairs], self._group, self.comm_stats,
            in_place=in_place,
        )

    def zero_errors(self) -> None:
        """Reset every error feedback buffer to zero."""
        for worker, server in self._errors.values():
            worker.zero_()
            server.zero_()

    def _expected_errors(self) -> list[tuple[str, int]]:
        """``(name, numel)`` of the error buffers a run at the current step holds (created
        before a load so that a checkpoint's values land in them)."""
        return []

    def _local_extras(self) -> dict[str, torch.Tensor]:
        """Other tensors that differ between ranks at the current step (0/1 Adam's)."""
        return {}

    def rank_local_state(self, for_load: bool) -> dict[str, torch.Tensor]:
        """See :class:`ReducesOwnGradients`: ``<name>/worker_error``, ``<name>/server_error``
        (none on one rank), plus the optimizer's own."""
        if for_load:
            self.zero_errors()  # what a load without this rank's errors leaves: DeepSpeed's reset
            if self.world_size() > 1:
                for name, numel in self._expected_errors():
                    self._error_pair(name, numel)
        out: dict[str, torch.Tensor] = {}
        for name, (worker, server) in sorted(self._errors.items()):
            out[f"{name}/worker_error"] = worker
            out[f"{name}/server_error"] = server
        out.update(self._local_extras())
        return out

    def reduces_gradients(self) -> bool:  # pragma: no cover - each optimizer says
        raise NotImplementedError


class OneBitAdam(OneBitOptimizer):
    r"""1-bit Adam: Adam whose momentum, after ``freeze_step`` warm-up steps, is averaged
    with the 1-bit compressed all-reduce while the variance stays frozen.

    For each parameter ``p`` at step ``t`` (1-based), with ``lr``, ``(b1, b2)``, ``eps`` and
    ``wd`` of its group:

    .. code-block:: text

        t <= freeze_step (warm-up; g averaged over the group by the engine):
            m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        t >  freeze_step (g this rank's own; v frozen):
            m = compressed_allreduce(b1 m + (1 - b1) g)      # times exp_avg_mask if given
        p = p - lr * (m / (sqrt(v) + eps) + wd * p)

    No bias correction (DeepSpeed's rule; see ``[Note: optimizers that reduce their own
    gradients]`` for that and the other shared rules and differences). On one rank the
    compressed phase is the same update without compression.

    Args are DeepSpeed's (defaults included); ``deepspeed`` (DeepSpeed passes its engine)
    is accepted and unused: terascale's engine asks the optimizer instead. ``group``: the
    data-parallel process group (None: the default group).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        deepspeed: Any = None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        *,
        group: ProcessGroup | None = None,
    ) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, name="OneBitAdam", group=group, amsgrad=amsgrad,
                         max_grad_norm=max_grad_norm, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name)  # fmt: skip
        if freeze_step < 0:
            raise ValueError(f"OneBitAdam freeze_step must be >= 0, got {freeze_step}")
        self.freeze_step = int(freeze_step)

    def compressing(self) -> bool:
        """Whether the next step is a compressed one (its gradients stay local)."""
        return self.steps_done() >= self.freeze_step

    def reduces_gradients(self) -> bool:
        return not self.compressing()

    def _expected_errors(self) -> list[tuple[str, int]]:
        return [(key, p.numel()) for key, _, p in self._keyed_params()] if self.compressing() else []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter (see the class docstring); collective over the
        group in a compressed step."""
        loss = evaluate(closure)
        done = self.steps_done()
        compressing = done >= self.freeze_step
        keyed = self._keyed_params()
        states = [self._init_state(p, done) for _, _, p in keyed]
        if compressing:
            for (_, group, p), state in zip(keyed, states):
                b1 = group["betas"][0]
                state["exp_avg"].mul_(b1).add_(self._local_grad(p), alpha=1 - b1)
            averaged = self._compress([(key, state["exp_avg"]) for (key, _, _), state in zip(keyed, states)], in_place=True)
            for (_, group, _), state, avg in zip(keyed, states, averaged):
                if avg is not state["exp_avg"]:
                    state["exp_avg"].copy_(avg)
                self._masked(group, state["exp_avg"])
        for (_, group, p), state in zip(keyed, states):
            state["step"].fill_(done + 1)  # every parameter's counter alike, gradient or not
            if not compressing:
                if p.grad is None:
                    continue  # no rank had a gradient: untouched, as torch's Adam leaves it
                b1, b2 = group["betas"]
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
            if group["weight_decay"] > 0.0:
                update = state["exp_avg"] / denom
                update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
            else:  # p - lr * (m / denom), one pass fewer
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"])
        return loss

    def _init_state(self, p: torch.Tensor, done: int) -> dict[str, Any]:
        """``p``'s state, created (zero moments, ``done`` steps) where missing."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = self._scalar(done, torch.int64)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
