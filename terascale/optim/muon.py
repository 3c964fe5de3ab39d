"""Muon (Jordan et al., 2024, "Muon: an optimizer for hidden layers") with AdamW beside it.

Muon keeps one momentum buffer per matrix and steps each hidden weight matrix by the
orthogonalized momentum: ``U ≈ orth(nesterov(m))``, the nearest semi-orthogonal matrix,
found with a few Newton–Schulz iterations. Everything else (embeddings, the output head,
norms, biases) is stepped by AdamW in the same call, as DeepSpeed's ``MuonWithAuxAdam``:
the optimizer's param groups say which with ``use_muon``.

The orthogonalization needs the whole matrix. :meth:`Muon.step` steps whole tensors (no
ZeRO sharding, stage 0), optionally splitting the matrices between the ranks of a group;
at ZeRO stages 1-3 each rank holds flat pieces of its shard, and the engine steps them
through :meth:`Muon.directions` / :meth:`Muon.apply_directions` around an exchange that
gives each matrix one owner ([Note: whole matrices on shards], ``terascale/zero/
whole_matrices.py``).

DeepSpeed's config names: ``"type": "Muon"``, params ``lr`` (both kinds), ``muon_lr`` and
``adam_lr`` (each kind's own, over ``lr``), ``momentum``, ``weight_decay``, ``ns_method``
(``"gram"``, the default, or ``"standard"``), ``betas`` and ``eps`` (Adam's), and
terascale's ``nesterov`` and ``ns_steps``. Which parameters are Muon's: DeepSpeed's rule
(:func:`uses_muon`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from terascale.comm import ops
from terascale.optim.closure import evaluate

NS_METHODS = ("gram", "standard")
# The quintic's coefficients (Jordan et al.): the slope at zero is pushed up so that five
# iterations bring every singular value near 1 (into about [0.7, 1.2]), not exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram", "nesterov": True,
                 "ns_steps": 5}  # fmt: skip
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
_NOT_MUON = ("embed", "lm_head")
MOMENTUM_KEY = "momentum_buffer"  # a Muon tensor's state


def uses_muon(name: str, param: torch.Tensor, shape: Sequence[int] | None = None) -> bool:
    """DeepSpeed's rule: Muon steps the parameters of two or more dimensions whose names
    contain neither ``embed`` nor ``lm_head``; AdamW the rest. ``shape``: the parameter's
    full shape where its own is not (partitioned by a ``zero.Init``)."""
    ndim = param.ndim if shape is None else len(shape)
    return ndim >= 2 and not any(word in name.lower() for word in _NOT_MUON)


# ``shape_of(param)``: a parameter's full shape (ZeRO's ``full_shape`` where a zero.Init may
# hold it partitioned); default its own.
ShapeOf = Callable[[torch.Tensor], Sequence[int]]


def muon_param_groups(module: nn.Module, groups: Sequence[dict], shape_of: ShapeOf | None = None) -> list[dict]:
    """Split each of ``groups`` (dicts over ``module``'s parameters) into its Muon part and
    its AdamW part, each marked ``use_muon`` (a group that already says is kept whole).

    DeepSpeed's name rule (:func:`uses_muon`), and beyond it: the weights of every
    ``nn.Embedding`` go to AdamW whatever their names (GPT-2's ``wte``/``wpe``, and a head
    tied to them), as Muon is meant for hidden layers only."""
    names = {id(p): n for n, p in module.named_parameters()}
    tables = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}

    def muon(p: torch.Tensor) -> bool:
        return id(p) not in tables and uses_muon(names.get(id(p), ""), p, None if shape_of is None else shape_of(p))

    out = []
    for group in groups:
        if "use_muon" in group:
            out.append(dict(group))
            continue
        muon_params = [p for p in group["params"] if muon(p)]
        other = [p for p in group["params"] if not muon(p)]
        for use, params in ((True, muon_params), (False, other)):
            if params:
                out.append({**group, "params": params, "use_muon": use})
    return out


def muon_share(module: nn.Module, shape_of: ShapeOf | None = None) -> float:
    """The share of ``module``'s trained elements that Muon steps (:func:`muon_param_groups`'
    rule); the rest are AdamW's. Sizes Muon's state: one buffer on this share, two on the rest."""
    shape_of = shape_of or (lambda p: p.shape)
    groups = muon_param_groups(module, [{"params": [p for p in module.parameters() if p.requires_grad]}], shape_of)
    numel = {use: sum(math.prod(shape_of(p)) for g in groups if g["use_muon"] == use for p in g["params"])
             for use in (True, False)}  # fmt: skip
    total = numel[True] + numel[False]
    return numel[True] / total if total else 0.0


def newton_schulz(g: torch.Tensor, steps: int = 5, method: str = "gram") -> torch.Tensor:
    """The orthogonalization of matrix ``g`` (``U Vᵀ`` of its SVD, approximately) by
    ``steps`` quintic Newton–Schulz iterations, computed in ``g``'s dtype.

    ``"standard"`` iterates on ``X`` (the short side first): ``X ← aX + (bA + cA²)X`` with
    ``A = XXᵀ``. ``"gram"`` computes the same polynomial on the small Gram matrix only:
    with ``R = XXᵀ`` every iterate is ``X_k = Q_k X_0`` where ``Q`` is a polynomial in
    ``R``, so each iteration multiplies square matrices of the short side instead of
    rectangular ones, and ``X`` is formed once at the end (and once midway, where the
    accumulated ``Q`` is folded back in so that rounding does not build up)."""
    if method not in NS_METHODS:
        raise ValueError(f"Muon ns_method must be one of {', '.join(NS_METHODS)}, got {method!r}")
    a, b, c = NS_COEFFICIENTS
    tall = g.size(0) > g.size(1)
    x = g.mT if tall else g
    x = x / (x.norm() + 1e-7)  # every singular value at most 1
    n, m = x.shape
    if method == "standard" or m <= n:
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.mT if tall else x
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    fold_at = 2  # fold Q into X here: R's rounding would otherwise compound over all steps
    r, q = x @ x.mT, eye
    for k in range(steps):
        if k == fold_at:
            x, q = q @ x, eye
            r = x @ x.mT
        p = a * eye + b * r + c * r @ r  # this iteration's polynomial in R
        q = p @ q
        if k < steps - 1:
            r = p @ r @ p  # X_{k+1} X_{k+1}ᵀ = p(R) R p(R) (all of them commute)
    x = q @ x
    return x.mT if tall else x


def orthogonalized(update: torch.Tensor, shape: torch.Size, steps: int, method: str) -> torch.Tensor:
    """Muon's step direction for a matrix of ``shape`` whose update is ``update`` (any
    layout of its elements): orthogonalized in fp32 and scaled by ``√max(1, rows/cols)``,
    so a tall matrix moves as much per element as a square one. Returned flat. A 4-d
    convolution filter is a matrix of its output channels by the rest."""
    matrix = update.reshape(shape[0], -1).to(torch.float32)
    rows, cols = matrix.shape
    return (newton_schulz(matrix, steps, method) * max(1.0, rows / cols) ** 0.5).reshape(-1)


@dataclass(frozen=True, eq=False)
class MatrixTask:
    """One matrix to orthogonalize: the model parameter it steps (under tensor parallelism
    this rank's slice of it, which stands for the whole), this rank's shape of it, its
    direction (flat, fp32) and its Newton–Schulz options."""

    param: torch.Tensor
    shape: torch.Size
    direction: torch.Tensor
    steps: int
    method: str


# The orthogonalized direction of each task, flat and of the task's shape: one matrix at a
# time here (orthogonalize_each), or whole matrices gathered from their tensor-parallel
# slices (terascale.parallel.sliced_matrices). Collective where the latter.
Orthogonalize = Callable[[Sequence[MatrixTask]], list[torch.Tensor]]


def orthogonalize_each(tasks: Sequence[MatrixTask]) -> list[torch.Tensor]:
    """Every task's matrix as it is (no tensor parallelism): :func:`orthogonalized`."""
    return [orthogonalized(t.direction, t.shape, t.steps, t.method) for t in tasks]


def matrix_cost(shape: torch.Size) -> int:
    """The multiply-adds of orthogonalizing a matrix of ``shape``, up to a constant: what
    balances owners between ranks."""
    rows, cols = shape[0], max(1, int(torch.Size(shape[1:]).numel()))
    return rows * cols * min(rows, cols)


def balanced_owners(costs: Sequence[int], ranks: int) -> list[int]:
    """An owner rank for each of ``costs`` so that every rank's sum is about even: the
    largest first, each to the least loaded rank (the same answer on every rank)."""
    load = [0] * ranks
    owners = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[k] = r
        load[r] += costs[k]
    return owners


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked ``use_muon``, AdamW (bias-corrected, decoupled decay) on
    the others; a group's missing options take :data:`MUON_DEFAULTS` or
    :data:`ADAM_DEFAULTS`. State: ``momentum_buffer`` per Muon tensor, ``exp_avg``,
    ``exp_avg_sq`` and ``step`` per AdamW tensor.

    ``group``: the data-parallel group whose ranks hold the same whole tensors (stage 0);
    :meth:`step` then orthogonalizes each matrix on one rank and shares the results, so no
    rank does more than its share (None: every rank does all of them)."""

    def __init__(self, params: Iterable[Any], *, group: dist.ProcessGroup | None = None, **defaults: Any) -> None:
        groups = [dict(g) for g in params] if not isinstance(params, torch.Tensor) else [{"params": [params]}]
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": [g["params"] if isinstance(g, dict) else g for g in groups]}]
        for g in groups:
            if "use_muon" not in g:
                raise ValueError("Muon's param groups say which are Muon's with use_muon=True/False "
                                 "(muon_param_groups splits a model's parameters by DeepSpeed's rule)")  # fmt: skip
            base = MUON_DEFAULTS if g["use_muon"] else ADAM_DEFAULTS
            for key, value in {**base, **{k: v for k, v in defaults.items() if k in base}}.items():
                g.setdefault(key, value)
            if g["use_muon"] and g["ns_method"] not in NS_METHODS:
                raise ValueError(f"Muon ns_method must be one of {', '.join(NS_METHODS)}, got {g['ns_method']!r}")
            if g["use_muon"] and not 0.0 <= g["momentum"] < 1.0:
                raise ValueError(f"Muon momentum must lie in [0, 1), got {g['momentum']}")
        super().__init__(groups, {})
        self.group = group

    # -- the parts every layout shares --------------------------------------------------

    def group_of(self) -> dict[int, dict]:
        """Each parameter's group, by ``id`` (a caller stepping many runs makes it once)."""
        return {id(p): g for g in self.param_groups for p in g["params"]}

    @torch.no_grad()
    def directions(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None = None,
        group_of: Mapping[int, dict] | None = None,
    ) -> list[torch.Tensor | None]:
        """For each of ``params`` and its gradient (``grads``, default each ``.grad``): a
        Muon tensor's momentum is updated and its update direction before
        orthogonalization returned (Nesterov's, by default); an AdamW tensor is stepped
        whole, and None returned for it. A Muon tensor's own values are not read (they
        may be swapped out: [Note: whole matrices on shards]). ``group_of``: :meth:`group_of`."""
        group_of = group_of or self.group_of()
        out: list[torch.Tensor | None] = []
        for k, p in enumerate(params):
            group = group_of[id(p)]
            given = p.grad if grads is None else grads[k]
            if given is None:
                out.append(None)
                continue
            grad = given.to(p.dtype)
            if not group["use_muon"]:
                self._adam(group, p, grad)
                out.append(None)
                continue
            state = self.state[p]
            if not state:
                state[MOMENTUM_KEY] = torch.zeros_like(grad)
            m = state[MOMENTUM_KEY]
            m.lerp_(grad, 1.0 - group["momentum"])
            out.append(grad.lerp(m, group["momentum"]) if group["nesterov"] else m.clone())
        return out

    @torch.no_grad()
    def apply_directions(self, params: Sequence[torch.Tensor], directions: Sequence[torch.Tensor | None],
                         group_of: Mapping[int, dict] | None = None) -> None:  # fmt: skip
        """``p ← p·(1 - lr·wd) - lr·d`` for each Muon tensor of ``params`` and its
        orthogonalized direction ``d`` (None: nothing to do). ``group_of``: :meth:`group_of`."""
        group_of = group_of or self.group_of()
        for p, d in zip(params, directions):
            if d is None:
                continue
            group = group_of[id(p)]
            p.mul_(1.0 - group["lr"] * group["weight_decay"])
            p.add_(d.reshape(p.shape).to(device=p.device, dtype=p.dtype), alpha=-group["lr"])

    def matrix_options(self) -> tuple[int, str]:
        """``(ns_steps, ns_method)`` of the Muon groups (at ZeRO stages every Muon group
        must agree, as in DeepSpeed)."""
        muon = [g for g in self.param_groups if g["use_muon"]]
        found = {_options(g) for g in muon}
        if len(found) > 1:
            raise ValueError(f"Muon's groups at ZeRO stages 1-3 share ns_steps and ns_method; got {sorted(found)}")
        return found.pop() if found else (MUON_DEFAULTS["ns_steps"], MUON_DEFAULTS["ns_method"])

    def _adam(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # a host tensor, as torch's Adam keeps it
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1.0 - beta1)
        v.lerp_(grad.square(), 1.0 - beta2)
        denom = (v / (1.0 - beta2**t)).sqrt_().add_(group["eps"])
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.addcdiv_(m, denom, value=-group["lr"] / (1.0 - beta1**t))

    # -- whole tensors ----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None, orthogonalize: Orthogonalize | None = None) -> Any:
        """One step on whole tensors: every Muon tensor must be a matrix (or a filter).
        ``orthogonalize``: how its matrices are orthogonalized, given each one's parameter
        of the model (default: each as it is; the engine passes the tensor-parallel
        gathering one, [Note: whole matrices across tensor-parallel slices])."""
        loss = evaluate(closure)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        directions = self.directions(params)
        todo = [(p, d) for p, d in zip(params, directions) if d is not None]
        for p, _ in todo:
            if p.ndim < 2:
                raise ValueError(
                    f"Muon got a {p.ndim}-d tensor of {p.numel()} elements in a use_muon group: it orthogonalizes "
                    "matrices; at ZeRO stages the engine gives it whole matrices itself (use its config 'optimizer' "
                    "section, or mark 1-d parameters use_muon=False)"
                )
        group_of = self.group_of()
        tasks = [MatrixTask(p, p.shape, d, *_options(group_of[id(p)])) for p, d in todo]
        run = orthogonalize or orthogonalize_each
        world = 1 if self.group is None or not dist.is_initialized() else dist.get_world_size(self.group)
        done = run(tasks) if world == 1 else self._shared(tasks, world, run)
        self.apply_directions([p for p, _ in todo], done)
        return loss

    def _shared(self, tasks: list[MatrixTask], world: int, run: Orthogonalize) -> list[torch.Tensor]:
        """Each matrix orthogonalized by its owner rank; one all-gather gives everyone all
        (every rank of the group holds the same matrices, so has the same ``tasks``)."""
        if not tasks:
            return []
        owners = balanced_owners([matrix_cost(t.shape) for t in tasks], world)
        rank = dist.get_rank(self.group)
        share = [sum(t.shape.numel() for t, o in zip(tasks, owners) if o == r) for r in range(world)]
        mine = run([t for t, o in zip(tasks, owners) if o == rank])
        device = tasks[0].direction.device
        send = torch.zeros(max(share), dtype=torch.float32, device=device)
        if mine:
            torch.cat(mine, out=send[: share[rank]])
        every = torch.empty(world * max(share), dtype=torch.float32, device=device)
        ops.all_gather_into_tensor(every, send, group=self.group)
        offsets = [r * max(share) for r in range(world)]
        out = []
        for t, o in zip(tasks, owners):
            out.append(every[offsets[o] : offsets[o] + t.shape.numel()])
            offsets[o] += t.shape.numel()
        return out


def _options(group: dict) -> tuple[int, str]:
    """``(ns_steps, ns_method)`` of a Muon param group."""
    return int(group["ns_steps"]), str(group["ns_method"])
