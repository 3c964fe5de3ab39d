"""Which launcher started this process, and where the process sits in the job.

torch's ``env://`` initialisation reads what torchrun sets: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` (and terascale reads ``LOCAL_RANK``). ``mpirun`` and
``srun`` start the same processes with variables of their own, and a process that reads
only torchrun's would run as a world of one, as many times as it was started. This module
reads the launchers' variables from an environment mapping and says what torchrun would
have set; :func:`terascale.comm.groups.init_distributed` exports that before it joins the
group. Everything here is a pure function of the mapping except :func:`mpi4py_layout`
(a collective over MPI, called only where the variables cannot say where rank 0 is), and
nothing calls ``torch.distributed``.

Variables read (the first launcher whose rank and size variables are both set wins;
torchrun's ``RANK`` and ``WORLD_SIZE`` win over all of them):

- OpenMPI: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
- MVAPICH: ``MV2_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
- MPICH / Intel MPI (Hydra), Cray PALS: ``PMI_RANK``, ``PMI_SIZE``, local rank from
  ``MPI_LOCALRANKID``, ``PMI_LOCAL_RANK`` or ``PALS_LOCAL_RANKID``, local size from
  ``MPI_LOCALNRANKS``, ``PMI_LOCAL_SIZE`` or ``PALS_LOCAL_SIZE``;
- SLURM's ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``,
  ``SLURM_NPROCS``), ``SLURM_LOCALID``, tasks per node from ``SLURM_STEP_TASKS_PER_NODE``
  / ``SLURM_TASKS_PER_NODE`` and ``SLURM_NODEID`` (else ``SLURM_NTASKS_PER_NODE``), hosts
  from ``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST`` or ``SLURM_NODELIST``.

MPI launchers come before SLURM because ``mpirun`` inside a SLURM allocation starts its
per-node daemons with ``srun``: its ranks then carry SLURM variables that count daemons,
not ranks.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MASTER_PORT",
    "Launch",
    "MpiLayout",
    "Started",
    "discover",
    "local_placement",
    "mpi4py_layout",
    "parse_hostlist",
    "parse_tasks_per_node",
    "slurm_port",
    "started_by",
]

DEFAULT_MASTER_PORT = 29500
# SLURM jobs without MASTER_PORT get a port derived from their job id, so two jobs sharing
# a node do not both listen on 29500. The range sits below Linux's ephemeral ports
# (32768-60999), which the kernel hands to outgoing connections and could have taken.
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class _Scheme:
    """One MPI launcher's variable names, each field in order of preference."""

    name: str
    rank: str
    size: str
    local_rank: tuple[str, ...]
    local_size: tuple[str, ...]


_MPI_SCHEMES = (
    _Scheme("OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
            ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    _Scheme("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
            ("MV2_COMM_WORLD_LOCAL_RANK",), ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    _Scheme("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID"),
            ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE")),
)  # fmt: skip
_SLURM_SIZE = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


@dataclass(frozen=True)
class Started:
    """What a launcher's variables say about this process (``None``: they do not say)."""

    launcher: str  # "OpenMPI", "MVAPICH", "MPICH/Intel MPI" or "SLURM"
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    variables: tuple[tuple[str, str], ...]  # the launcher variables that were read, for messages

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.variables)


@dataclass(frozen=True)
class Launch:
    """Where this process sits, as torchrun would have told it."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int

    def torch_environment(self) -> dict[str, str]:
        """The variables torchrun sets, for ``env://`` and everything reading them."""
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}  # fmt: skip
        if self.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        return env


@dataclass(frozen=True)
class MpiLayout:
    """What the MPI library itself says: rank 0's host and this rank's place on its node."""

    master_addr: str
    local_rank: int
    local_world_size: int


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} is not an integer") from None


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in environ), None)


def started_by(environ: Mapping[str, str]) -> Started | None:
    """The launcher that started this process and what it said, without resolving a master.

    ``None`` when torchrun's ``RANK`` and ``WORLD_SIZE`` are set (they win), when no
    launcher variables are present, and in the batch script of a SLURM job (``SLURM_JOB_ID``
    without ``SLURM_STEP_ID``): that script is one process whatever ``SLURM_NTASKS`` says;
    the tasks that ``srun`` starts carry a step id. Raises ``ValueError`` for values that
    are not integers or are out of range.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return None
    for scheme in _MPI_SCHEMES:
        if scheme.rank in environ and scheme.size in environ:
            local_rank, local_size = _first(environ, scheme.local_rank), _first(environ, scheme.local_size)
            started = _started(environ, scheme.name, scheme.rank, scheme.size, local_rank, local_size)
            if started.local_rank is None:
                started = _with_slurm_locals(environ, started)
            return started
    return _slurm(environ)


def _started(environ: Mapping[str, str], launcher: str, rank: str, size: str, local_rank: str | None,
             local_size: str | None) -> Started:  # fmt: skip
    names = [n for n in (rank, size, local_rank, local_size) if n is not None]
    started = Started(
        launcher=launcher,
        rank=_int(environ, rank),
        world_size=_int(environ, size),
        local_rank=None if local_rank is None else _int(environ, local_rank),
        local_world_size=None if local_size is None else _int(environ, local_size),
        variables=tuple((n, environ[n]) for n in names),
    )
    if not 0 <= started.rank < started.world_size:
        raise ValueError(f"{launcher}: rank {rank}={started.rank} is not in [0, {size}={started.world_size})")
    if started.local_world_size is not None and not 1 <= started.local_world_size <= started.world_size:
        raise ValueError(f"{launcher}: {local_size}={started.local_world_size} is not in [1, {started.world_size}]")
    if started.local_rank is not None and not 0 <= started.local_rank < (started.local_world_size or started.world_size):
        raise ValueError(f"{launcher}: {local_rank}={started.local_rank} is out of range ({started.describe()})")
    return started


def _with_slurm_locals(environ: Mapping[str, str], started: Started) -> Started:
    """An MPI started by ``srun`` through PMI sets no local rank; SLURM's says it when it
    describes the same processes (same rank and size)."""
    slurm = _slurm(environ)
    if slurm is None or (slurm.rank, slurm.world_size) != (started.rank, started.world_size):
        return started
    return Started(started.launcher, started.rank, started.world_size, slurm.local_rank, slurm.local_world_size,
                   started.variables + slurm.variables)  # fmt: skip


def _slurm(environ: Mapping[str, str]) -> Started | None:
    size = _first(environ, _SLURM_SIZE)
    if "SLURM_PROCID" not in environ or size is None:
        return None
    if "SLURM_JOB_ID" in environ and not ("SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ):
        return None  # the batch script itself (see started_by)
    local = "SLURM_LOCALID" if "SLURM_LOCALID" in environ else None
    started = _started(environ, "SLURM", "SLURM_PROCID", size, local, None)
    local_size, read = _slurm_local_size(environ)
    return Started(started.launcher, started.rank, started.world_size, started.local_rank, local_size,
                   started.variables + read)  # fmt: skip


def _slurm_local_size(environ: Mapping[str, str]) -> tuple[int | None, tuple[tuple[str, str], ...]]:
    """This node's task count: from the tasks-per-node list (at ``SLURM_NODEID``, or the one
    count every node has), else ``SLURM_NTASKS_PER_NODE``; ``None`` when neither says."""
    name = _first(environ, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if name is not None:
        counts = parse_tasks_per_node(environ[name])
        read = ((name, environ[name]),)
        if len(set(counts)) == 1:
            return counts[0], read
        if "SLURM_NODEID" in environ and 0 <= _int(environ, "SLURM_NODEID") < len(counts):
            return counts[_int(environ, "SLURM_NODEID")], (*read, ("SLURM_NODEID", environ["SLURM_NODEID"]))
    if "SLURM_NTASKS_PER_NODE" in environ:
        return _int(environ, "SLURM_NTASKS_PER_NODE"), (("SLURM_NTASKS_PER_NODE", environ["SLURM_NTASKS_PER_NODE"]),)
    return None, ()


def discover(environ: Mapping[str, str], *, mpi_layout: Callable[[], MpiLayout | None] | None = None) -> Launch | None:
    """Rank, world size, local rank and master of a process an MPI launcher or ``srun`` started.

    ``None`` when there is nothing to discover: torchrun's variables are set, no launcher's
    are, or the launcher started one process. The master is ``MASTER_ADDR`` when set; else
    for SLURM the first host of the step's (or job's) node list, where task 0 runs; for MPI
    127.0.0.1 when every rank is on this node (local size = world size), else rank 0's host
    as the MPI library tells it (``mpi_layout``, default :func:`mpi4py_layout`, which also
    fills in a local rank no variable gives). The port is ``MASTER_PORT``, else
    :func:`slurm_port` of ``SLURM_JOB_ID`` under SLURM, else 29500.

    Raises ``ValueError`` naming the variables seen and what to set when the launcher
    started several processes but where rank 0 listens cannot be found: never a silent
    world of one.
    """
    started = started_by(environ)
    if started is None or started.world_size == 1:
        return None
    master = environ.get("MASTER_ADDR") or None
    local_rank, local_size = started.local_rank, started.local_world_size
    if local_rank is None and "LOCAL_RANK" in environ:  # exported by the user for a launcher without one
        local_rank = _int(environ, "LOCAL_RANK")
        local_size = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else local_size
    if started.launcher == "SLURM":
        if local_rank is None:
            raise ValueError(f"srun started {started.world_size} processes ({started.describe()}) but "
                             "SLURM_LOCALID is not set: export LOCAL_RANK to every task")  # fmt: skip
        if master is None:
            nodelist = _first(environ, _SLURM_NODELIST)
            if nodelist is None:
                raise ValueError(f"srun started {started.world_size} processes ({started.describe()}) but neither "
                                 f"{', '.join(_SLURM_NODELIST)} nor MASTER_ADDR says where rank 0 runs: "
                                 "export MASTER_ADDR=<rank 0's host> to every task")  # fmt: skip
            master = parse_hostlist(environ[nodelist])[0]
    else:
        if master is None and local_size == started.world_size:
            master = "127.0.0.1"  # every rank is on this node
        if master is None or local_rank is None:
            # The same decision on every rank (their variables agree), so all of them or
            # none enter this collective.
            layout = (mpi4py_layout if mpi_layout is None else mpi_layout)()
            if layout is None:
                raise ValueError(_mpi_help(started, master is None))
            master = master or layout.master_addr
            if local_rank is None:
                local_rank, local_size = layout.local_rank, layout.local_world_size
    return Launch(started.launcher, started.rank, started.world_size, local_rank, local_size, master,
                  _port(environ))  # fmt: skip


def _mpi_help(started: Started, no_master: bool) -> str:
    if no_master:
        where = ("on more than one node" if started.local_world_size is not None
                 else "without saying how many run on each node")  # fmt: skip
        missing = f"{where} ({started.describe()}) but MASTER_ADDR is not set"
        fix = ("export MASTER_ADDR=<rank 0's host> to every rank (OpenMPI: mpirun -x MASTER_ADDR=host ...; "
               "MPICH/Intel MPI: mpirun -genv MASTER_ADDR host ...)")  # fmt: skip
    else:
        missing = f"({started.describe()}) but no variable gives this rank's local rank"
        fix = "export LOCAL_RANK (and LOCAL_WORLD_SIZE) to every rank"
    return (f"{started.launcher} started {started.world_size} processes {missing} and mpi4py, which could ask "
            f"MPI, is not installed: {fix}, or pip install mpi4py")


def _port(environ: Mapping[str, str]) -> int:
    if environ.get("MASTER_PORT"):
        port = _int(environ, "MASTER_PORT")
    elif "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ:
        port = slurm_port(_int(environ, "SLURM_JOB_ID"))
    else:
        port = DEFAULT_MASTER_PORT
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a port (1..65535)")
    return port


def slurm_port(job_id: int) -> int:
    """The rendezvous port of SLURM job ``job_id`` without ``MASTER_PORT``: 20000-29999."""
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN


def local_placement(environ: Mapping[str, str]) -> tuple[int, int | None] | None:
    """``(local rank, local world size or None)`` of this process, read from torchrun's
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` or else a launcher's variables; ``None`` when
    neither says. Needs no master and calls nothing (``terascale run``'s rank shim uses it)."""
    started = None if "RANK" in environ and "WORLD_SIZE" in environ else started_by(environ)
    if started is not None and started.local_rank is not None:
        return started.local_rank, started.local_world_size
    if "LOCAL_RANK" in environ:
        size = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else None
        return _int(environ, "LOCAL_RANK"), size
    return None


_RANGE = re.compile(r"\[([^\]]*)\]")


def parse_hostlist(spec: str) -> list[str]:
    """Expand SLURM's compressed host list: ``node[01-03,07],gpu-a[1-2]`` is node01, node02,
    node03, node07, gpu-a1, gpu-a2 (zero padding kept; several brackets in one name expand
    to every combination, in order). Raises ``ValueError`` for malformed lists."""
    hosts: list[str] = []
    for item in _split_top_level(spec.strip()):
        if not item:
            raise ValueError(f"host list {spec!r} has an empty entry")
        names = [""]
        pos = 0
        for match in _RANGE.finditer(item):
            prefix = item[pos : match.start()]
            names = [n + prefix + s for n in names for s in _expand_range(match.group(1), spec)]
            pos = match.end()
        tail = item[pos:]
        if "[" in tail or "]" in tail:
            raise ValueError(f"host list {spec!r}: unbalanced brackets in {item!r}")
        hosts += [n + tail for n in names]
    if not hosts:
        raise ValueError("empty host list")
    return hosts


def _split_top_level(spec: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"host list {spec!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"host list {spec!r}: unbalanced brackets")
    items.append(spec[start:])
    return items


def _expand_range(body: str, spec: str) -> list[str]:
    out = []
    for part in body.split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"host list {spec!r}: {part!r} is not a number or a range N-M")
        if not sep:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"host list {spec!r}: range {part!r} runs backwards")
        out += [str(i).zfill(len(low)) for i in range(int(low), int(high) + 1)]
    return out


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's tasks-per-node list: ``2(x3),1`` is [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        match = _TASKS.match(part.strip())
        if match is None:
            raise ValueError(f"tasks per node {spec!r}: {part!r} is not N or N(xM)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def mpi4py_layout() -> MpiLayout | None:
    """Rank 0's host and this rank's local rank and count, by asking MPI through mpi4py;
    ``None`` when mpi4py is not installed.

    Collective over MPI's world: every rank calls it or none does (:func:`discover` decides
    from variables every rank shares). The address is rank 0's processor name, its host
    name, which the other nodes resolve as MPI itself did (the first of ``hostname -I``,
    DeepSpeed's choice, can be a container bridge's address); ranks count as local when
    their processor names match.
    """
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    name = MPI.Get_processor_name() or socket.gethostname()
    names = comm.allgather(name)
    return MpiLayout(master_addr=names[0], local_rank=names[: comm.Get_rank()].count(name),
                     local_world_size=names.count(name))  # fmt: skip
