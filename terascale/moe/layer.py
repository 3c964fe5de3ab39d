"""DeepSpeed's mixture-of-experts layer: ``MoE(hidden_size, expert, num_experts, ep_size, k, ...)``.

A DeepSpeed program builds its MoE layers before ``initialize``; the engine then hands
each layer its expert-parallel group (DeepSpeed's ``set_deepspeed_parallelism``). The
layer routes with :func:`terascale.moe.gating.route`, moves tokens with
:mod:`terascale.moe.dispatch` and returns DeepSpeed's triple ``(output, l_aux,
exp_counts)``. Parameter names are DeepSpeed's (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.deepspeed_experts.<i>.*``, and with ``use_residual`` ``mlp.*``
and ``coefficient.*``), so its checkpoints' keys line up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from terascale.moe.dispatch import combine, dispatch, run_experts
from terascale.moe.experts import Experts, expert_group_name
from terascale.moe.gating import NOISE_POLICIES, Routes, jitter, route
from terascale.moe.groups import ExpertGroups


class TopKGate(nn.Module):
    """The router: ``wg`` (fp32 ``Linear(model_dim, num_experts)``, no bias) scores each
    token against every expert in fp32; :func:`route` picks ``k``. Capacity applies when
    ``drop_tokens`` (``capacity_factor`` in training, ``eval_capacity_factor`` in eval);
    otherwise the layer is dropless."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: ProcessGroup | None = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in (None, "None", *NOISE_POLICIES):
            raise ValueError(f"noisy_gate_policy must be None, 'None', 'Jitter' or 'RSample', got {noisy_gate_policy!r}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.ep_group = ep_group

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
        """Routes for the tokens ``x`` ([S, model_dim])."""
        x = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return route(
            logits,
            self.k,
            capacity_factor=factor if self.drop_tokens else None,
            min_capacity=self.min_capacity,
            use_rts=self.use_rts,
            noisy_gate_policy=self.noisy_gate_policy if self.training else None,
            second_expert_sampling=self.top2_2nd_expert_sampling,
            used_token=used_token,
        )


class MOELayer(nn.Module):
    """Gate, local experts and the exchange between them (DeepSpeed's ``deepspeed_moe``).

    After a forward, ``l_aux`` holds the load-balancing loss (plus ``z_loss_coef`` times
    the router z-loss) and ``exp_counts`` the routes per expert ([E], before any drop) of
    this rank's tokens."""

    def __init__(
        self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
        z_loss_coef: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.gate = gate
        self.z_loss_coef = z_loss_coef
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.ep_group: ProcessGroup | None = None
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def _set_ep_group(self, ep_group: ProcessGroup | None) -> None:
        self.ep_group = ep_group
        self.gate.ep_group = ep_group

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., M] -> [..., M]: each token's kept routes through their experts, on
        whichever rank of the expert-parallel group holds them; collective over that group."""
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"this MoE layer splits its experts over {self.ep_size} ranks (ep_size={self.ep_size}): it runs "
                "inside terascale.initialize, which gives it its expert-parallel group"
            )
        tokens = x.reshape(-1, x.shape[-1])
        routes = self.gate(tokens, used_token)
        num_experts = self.num_local_experts * self.ep_size
        rows, per_expert, record = dispatch(tokens, routes.expert, num_experts, self.ep_group, routes.kept)
        out = combine(run_experts(rows, per_expert, list(self.experts)), routes.weight, record)
        self.l_aux, self.exp_counts = routes.aux_loss, routes.counts.detach()
        if self.z_loss_coef:
            self.l_aux = self.l_aux + self.z_loss_coef * routes.z_loss
        return out.reshape(x.shape)


class MoE(nn.Module):
    """A mixture-of-experts layer with DeepSpeed's constructor and results.

    ``num_experts`` copies of ``expert`` split over expert-parallel groups of ``ep_size``
    ranks (this rank builds its ``num_experts / ep_size``), a top-``k`` router, and with
    ``use_residual`` a dense ``expert`` beside them mixed by a learned coefficient
    (Residual MoE). ``drop_tokens=False`` is dropless; otherwise each expert takes at most
    its capacity of tokens (see [Note: routing]). Forward returns ``(output, l_aux,
    exp_counts)``. ``use_tutel`` is accepted and has no effect (the exchange is already
    sparse); ``enable_expert_tensor_parallelism`` is kept for the engine to check.
    ``z_loss_coef`` (beyond DeepSpeed) adds that multiple of the router z-loss (ST-MoE's
    ``mean(logsumexp(logits)^2)``, which keeps router logits small) to ``l_aux``.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        z_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE: ep_size {ep_size} does not divide num_experts {num_experts}: each rank of an "
                "expert-parallel group holds num_experts / ep_size experts"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(
            hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
            noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling,
        )  # fmt: skip
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts, z_loss_coef)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_expert_groups(self, groups: ExpertGroups) -> None:
        """Take this rank's expert-parallel group (the engine calls it at ``initialize``)."""
        assert groups.ep_size == self.ep_size, (groups.ep_size, self.ep_size)
        self.deepspeed_moe._set_ep_group(groups.ep_group)

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, l_aux, exp_counts)``: ``output`` has ``hidden_states``' shape."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        assert self.deepspeed_moe.l_aux is not None and self.deepspeed_moe.exp_counts is not None
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
