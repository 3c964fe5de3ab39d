"""Which parameters form a group: the wrap policy and the group plan.

[Note: group plan]
A group is the parameters one wrapped module owns. A module is wrapped when the policy
picks it (its class is listed, or, by default, it is one of the repeated elements of a
``ModuleList``/``Sequential`` - the transformer blocks - and holds at least
``min_params`` elements); every tile of a :class:`~terascale.zero.TiledLinear` is a
group of its own ([Note: tiled linear layers]); the root module is always wrapped and
takes the leftovers.
A parameter belongs to the innermost wrapped module that contains every place it is
registered, so a weight tied between the embedding and the output head lands in their
common ancestor and is gathered for the whole forward that uses it. At stage 3,
parameters smaller than ``persistence_threshold`` elements leave their groups for one
persistent group that stays gathered (DeepSpeed's ``stage3_param_persistence_threshold``).

A module holding both trainable and frozen parameters (an adapter beside frozen base
weights, as PEFT makes them) owns two groups, the trainable ones and the frozen ones: each
group's flat buffer is split evenly over the ranks, so were they one group the few
trainable elements would fall into one or two ranks' shards, and those ranks alone would
hold the optimizer state. Inside a group parameters are ordered by optimizer param group,
then module order: each optimizer group's parameters are then one contiguous run of the
flat buffer and of every rank's shard, so one fused update covers them.

[Note: parameter classes]
Model parallelism asks more of a group than ZeRO does: every parameter in it must be
treated alike by the steps that act on whole groups. A tied layer's copies on two
pipeline stages must lie in groups of the same layout on both stages, so that their
gradient shards can be summed element for element over the tie's group; and a
parameter every tensor-parallel rank holds in full (a norm weight) is counted in the
global gradient norm by one rank only, which is decided per group. The engine therefore
gives ``plan_groups`` a class per parameter (``classes``), and a module's parameters of
different classes form different groups, as trainable and frozen ones do.

[Note: modules that never run]
A group is gathered when its module's forward runs, so a module is wrapped only where
its forward can run and nothing else reads its parameters in its stead:

- a container without a forward of its own (``ModuleList``, ``ModuleDict``,
  ``ParameterList``/``ParameterDict``) is never wrapped. When such containers are what
  repeats (ViT's ``ModuleList([ModuleList([attn, ff])])``, Funnel's block lists), their
  elements are the blocks;
- the children of ``nn.MultiheadAttention`` are never wrapped: it reads
  ``out_proj.weight`` without calling ``out_proj``;
- a leaf module ([Note: leaf modules]) is wrapped and nothing inside it is.

Code that reads parameters some other way (a block called as ``block.forward(x)``, one
module reading another's weight) is covered at run time: see [Note: parameters read
outside their owner] in :mod:`terascale.zero.schedule`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from terascale.zero.gather import full_numel
from terascale.zero.leaf import DEFAULT_LEAF_MODULE_CLASSES, is_leaf
from terascale.zero.tiling import TiledLinear, tiles_of


@dataclass(frozen=True)
class WrapPolicy:
    """Which modules become groups.

    ``module_classes``: wrap every instance of these classes (e.g. the transformer block).
    None picks the classes that repeat inside a ``ModuleList``/``Sequential`` (where what
    repeats is a container without a forward, the classes of its elements). Leaf modules
    are always wrapped; containers, modules inside a leaf and ``nn.MultiheadAttention``'s
    children never are ([Note: modules that never run]).
    ``min_params``: modules with fewer parameter elements stay in their parent's group.
    ``leaf_classes``: classes (or class names) that are leaf modules without being marked
    (DeepSpeed's ``zero_optimization.leaf_module.classes``; its default list by default).
    """

    module_classes: tuple[type[nn.Module], ...] | None = None
    min_params: int = 0
    leaf_classes: tuple[type[nn.Module] | str, ...] = DEFAULT_LEAF_MODULE_CLASSES


@dataclass(frozen=True)
class GroupPlan:
    """One group: the module whose forward uses it, and its parameters in flat order.

    ``opt_group[i]`` is the optimizer param-group index of ``params[i]`` (-1: frozen).
    ``persistent`` groups stay gathered between uses (all groups below stage 3).
    """

    module: nn.Module
    module_name: str
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    opt_group: tuple[int, ...]
    persistent: bool

    @property
    def numel(self) -> int:
        return sum(full_numel(p) for p in self.params)


def runs_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward of its own (containers have none)."""
    return type(module).forward is not nn.Module.forward


def _block_classes(module: nn.Module) -> list[type[nn.Module]]:
    """The class of ``module``, or for a container without a forward the classes of its
    elements, recursively ([Note: modules that never run])."""
    if runs_forward(module):
        return [type(module)]
    return [cls for c in module.children() for cls in _block_classes(c)]


def _repeated_block_classes(root: nn.Module) -> tuple[type[nn.Module], ...]:
    # A TiledLinear's grid of tiles repeats nn.Linear by construction; it says nothing
    # about the model's blocks (its tiles are groups anyway).
    grids = {id(c) for m in root.modules() if isinstance(m, TiledLinear) for c in m.linears.modules()}
    found: list[type[nn.Module]] = []
    for m in root.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and id(m) not in grids:
            counts = Counter(type(c) for c in m.children())
            repeated = [c for c in m.children() if counts[type(c)] >= 2]
            found += [cls for c in repeated for cls in _block_classes(c) if cls not in found]
    return tuple(found)


def wrapped_modules(root: nn.Module, policy: WrapPolicy) -> dict[str, nn.Module]:
    """Name -> module for every module that owns a group (the root is ``""``); see
    [Note: group plan] and [Note: modules that never run]."""
    classes = policy.module_classes if policy.module_classes is not None else _repeated_block_classes(root)
    out: dict[str, nn.Module] = {"": root}

    def leaf(m: nn.Module) -> bool:
        return is_leaf(m, policy.leaf_classes)

    if leaf(root):
        return out
    seen = {id(root)}
    tiles = {id(t) for t in tiles_of(root)}
    # Read by their parent without being called, or inside a leaf: never wrapped.
    readers = [m for m in root.modules() if isinstance(m, nn.MultiheadAttention)]
    leaves = [m for m in root.modules() if m is not root and leaf(m)]
    excluded = {id(c) for m in readers + leaves for c in m.modules() if c is not m}
    for name, m in root.named_modules():
        if id(m) in seen or id(m) in excluded or not runs_forward(m):
            continue
        if not (leaf(m) or isinstance(m, classes) or id(m) in tiles):
            continue
        if sum(full_numel(p) for p in m.parameters()) < max(policy.min_params, 1):
            continue
        seen.add(id(m))
        out[name] = m
    return out


def _owner(names: list[str], wrapped: dict[str, nn.Module]) -> str:
    """The innermost wrapped module name that is a prefix of every occurrence in ``names``."""
    parts = [n.split(".")[:-1] for n in names]
    common = parts[0]
    for p in parts[1:]:
        i = 0
        while i < min(len(common), len(p)) and common[i] == p[i]:
            i += 1
        common = common[:i]
    while common and ".".join(common) not in wrapped:
        common = common[:-1]
    return ".".join(common)


def plan_groups(
    root: nn.Module,
    policy: WrapPolicy,
    opt_group_of: dict[int, int],
    *,
    persistence_threshold: int = 0,
    shard_params: bool = False,
    classes: Mapping[int, Hashable] | None = None,
) -> list[GroupPlan]:
    """Split ``root``'s parameters into groups (see ``[Note: group plan]``).

    ``opt_group_of`` maps ``id(param)`` to its optimizer group index; parameters missing
    from it are frozen. ``shard_params`` (stage 3) makes wrapped groups non-persistent and
    moves parameters below ``persistence_threshold`` elements into a persistent group.
    Groups come in module order (root first, the persistent group last); every rank
    computes the same plan from the same model. ``classes`` maps ``id(param)`` to a key;
    parameters with different keys never share a group (see [Note: parameter classes]).
    """
    wrapped = wrapped_modules(root, policy)
    occurrences: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        occurrences.setdefault(id(p), []).append(name)
        params[id(p)] = p
    order = {pid: i for i, pid in enumerate(occurrences)}

    members: dict[str, list[int]] = {name: [] for name in wrapped}
    small: list[int] = []
    for pid, names in occurrences.items():
        if shard_params and full_numel(params[pid]) < persistence_threshold:
            small.append(pid)
        else:
            members[_owner(names, wrapped)].append(pid)

    def plan(module: nn.Module, module_name: str, pids: Sequence[int], persistent: bool) -> GroupPlan:
        def key(pid: int) -> tuple[int, int]:
            k = opt_group_of.get(pid, -1)
            return (k if k >= 0 else 1 << 30, order[pid])

        pids = sorted(pids, key=key)
        return GroupPlan(
            module=module,
            module_name=module_name,
            names=tuple(occurrences[pid][0] for pid in pids),
            params=tuple(params[pid] for pid in pids),
            opt_group=tuple(opt_group_of.get(pid, -1) for pid in pids),
            persistent=persistent,
        )

    def split(pids: list[int]) -> list[list[int]]:
        """Trainable and frozen parameters apart (each shards evenly on its own), and
        parameters of different classes apart."""
        parts: dict[tuple[bool, Hashable], list[int]] = {}
        for pid in pids:
            parts.setdefault((pid not in opt_group_of, (classes or {}).get(pid)), []).append(pid)
        return [parts[k] for k in sorted(parts, key=lambda k: (k[0], str(k[1])))]

    groups = [plan(wrapped[n], n, part, not shard_params) for n, pids in members.items() for part in split(pids)]
    groups += [plan(root, "<persistent>", part, True) for part in split(small)]
    return groups
