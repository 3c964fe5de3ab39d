"""Which ranks of a group share a node, as process groups (for ZeRO++'s hpZ and qgZ).

[Note: what a node is]
A node is what launched the ranks together: torchrun's ``GROUP_RANK`` (the elastic agent's
number; ``terascale run`` sets it too), else the host name. Two agents on one host are two
nodes, which is how several "nodes" are tested and benchmarked on one machine. DeepSpeed
counts ``world / device_count()`` instead, which is wrong on the CPU and when
``CUDA_VISIBLE_DEVICES`` hides devices.

The groups split one process group (the ZeRO group) by node: ``intra`` holds this node's
ranks of it, ``inter`` the ranks with this rank's local index on every node (one per node).
Every node must hold the same number of the group's ranks; ranks need not be contiguous.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from terascale.comm import ops
from terascale.comm.groups import split_group


def node_key() -> str:
    """This process's node ([Note: what a node is])."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


@dataclass(frozen=True)
class NodeGroups:
    """A process group split by node ([Note: what a node is]).

    ``ranks[m][l]`` is the group rank of node m's l-th rank; this rank is
    ``ranks[node][local]``.
    """

    intra: ProcessGroup
    inter: ProcessGroup
    ranks: tuple[tuple[int, ...], ...]
    node: int
    local: int

    @property
    def num_nodes(self) -> int:
        return len(self.ranks)

    @property
    def local_size(self) -> int:
        return len(self.ranks[0])

    @property
    def inter_nodes(self) -> tuple[int, ...]:
        """The nodes in the order of their ranks in ``inter`` (by group rank)."""
        return tuple(sorted(range(self.num_nodes), key=lambda m: self.ranks[m][self.local]))


def node_groups(group: ProcessGroup) -> NodeGroups:
    """Split ``group`` by node. Collective over the default group (every rank calls it at
    the same point with its own group). Raises ``ValueError`` if the nodes hold different
    numbers of ``group``'s ranks."""
    keys: list[str | None] = [None] * dist.get_world_size(group)
    ops.all_gather_object(keys, node_key(), group=group)
    nodes: dict[str, list[int]] = {}
    for r, key in enumerate(keys):
        nodes.setdefault(str(key), []).append(r)
    ranks = tuple(tuple(members) for members in nodes.values())  # nodes in order of their first rank
    if len({len(m) for m in ranks}) != 1:
        sizes = ", ".join(f"{k}: {len(m)}" for k, m in nodes.items())
        raise ValueError(f"nodes hold different numbers of ranks ({sizes}); hierarchical communication needs equal nodes")
    me = dist.get_rank(group)
    node = next(m for m, members in enumerate(ranks) if me in members)
    local = ranks[node].index(me)
    intra = split_group(group, ("node", node))
    inter = split_group(group, ("local", local))
    return NodeGroups(intra, inter, ranks, node, local)


def block_group(group: ProcessGroup, size: int) -> ProcessGroup:
    """Consecutive blocks of ``size`` ranks of ``group`` ([0..size-1], [size..2size-1], ...)
    as process groups; returns this rank's. Collective over the default group. Raises
    ``ValueError`` if ``size`` does not divide the group."""
    world = dist.get_world_size(group)
    if size < 1 or world % size:
        raise ValueError(f"a block of {size} ranks does not divide the {world} ranks of the group")
    return split_group(group, dist.get_rank(group) // size)
