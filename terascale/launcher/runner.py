"""Build and run ``torch.distributed.run`` (torchrun) commands for ``terascale run``.

terascale does not manage worker processes itself: on each machine one torchrun
agent starts the ranks, restarts them (``--max_restarts``) and runs the
rendezvous. This module only decides *which* torchrun command runs *where*:

* one machine, no master given: ``torchrun --standalone`` (private c10d store
  on a free local port);
* ``--nnodes N --node_rank R``: torchrun's static rendezvous at
  ``master_addr:master_port``, node R taking global ranks R*nproc..;
* otherwise: c10d rendezvous at ``master_addr:master_port``;
* with a hostfile: one agent per host, started over ``ssh`` concurrently, with
  the environment (``PYTHONPATH``, ``NCCL_*``, ``.terascale_env`` entries:
  :mod:`terascale.launcher.environment`) and the working directory carried over; or,
  with ``--launcher pdsh|mpi|slurm``, one command of that tool for every host
  (:mod:`terascale.launcher.backends`); or, with ``--no_ssh --node_rank R``, this
  machine's agent only, as host R of the hostfile;
* with ``--local_rank=N`` for the script or core binding: torchrun starts the rank
  shim, which does the per-rank part and execs the script ([Note: the rank shim]).

Command construction is pure (:func:`torchrun_args`, :func:`ssh_commands`,
...) so it is testable without ssh; :func:`launch` ties it to processes. This module is
also ``deepspeed.launcher.runner`` under the stand-in, with DeepSpeed's names of it from
:mod:`terascale.launcher.deepspeed_cli` (``python -m`` runs DeepSpeed's command line).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from terascale.launcher import backends
from terascale.launcher.cores import parse_core_list, rank_cores, usable_cores, worker_args
# deepspeed.launcher.runner is this module: DeepSpeed's names of it ([Note: DeepSpeed's launcher flags]).
from terascale.launcher.deepspeed_cli import (  # noqa: F401
    DEEPSPEED_ENVIRONMENT_PATHS,
    DLTS_HOSTFILE,
    EXPORT_ENVS,
    PDSH_MAX_FAN_OUT,
    _parse_hostfile,
    fetch_hostfile,
    main,
    parse_args,
    parse_inclusion_exclusion,
    parse_resource_filter,
)
from terascale.launcher.environment import (  # noqa: F401
    DEEPSPEED_ENVIRONMENT_NAME,
    ENV_FILE_NAMES,
    env_file_names,
    load_env_files,
    parse_env_file,
    remote_exports,
    restart_safe_environment,
)
from terascale.launcher.hostfile import filter_hosts, read_hostfile
from terascale.launcher.processes import run_local, run_remote
from terascale.launcher.rendezvous import rendezvous_conf

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_SSH_OPTIONS",
    "ENV_FILE_NAMES",
    "LaunchOptions",
    "default_nproc",
    "launch",
    "launcher_command",
    "load_env_files",
    "node_options",
    "parse_env_file",
    "parse_nnodes",
    "remote_exports",
    "run_local",
    "run_remote",
    "select_resources",
    "ssh_commands",
    "torchrun_args",
]

DEFAULT_MASTER_PORT = 29500
# BatchMode: fail instead of prompting for a password nobody can type.
# -tt: a remote pty, so closing the connection (when we terminate the ssh client)
# hangs up the remote torchrun agent instead of leaving it orphaned.
DEFAULT_SSH_OPTIONS = ("-tt", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30")
_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def parse_nnodes(spec: str) -> tuple[int, int]:
    """Parse ``"N"`` or ``"MIN:MAX"`` into ``(min_nodes, max_nodes)``.

    Raises ``ValueError`` unless ``1 <= MIN <= MAX``.
    """
    parts = spec.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--nnodes {spec!r}: write a node count N or a range MIN:MAX") from None
    if not 1 <= low <= high:
        raise ValueError(f"--nnodes {spec!r}: need 1 <= MIN <= MAX")
    return low, high


def _format_nnodes(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}:{high}"


@dataclass(frozen=True)
class LaunchOptions:
    """What the user asked ``terascale run`` for; ``None`` means "choose for me".

    ``nproc`` is ranks per node (default: visible CUDA devices, else 1, or the
    hostfile's slots); ``nnodes`` is ``"N"`` or ``"MIN:MAX"`` (default: 1, or
    every host of the hostfile). ``node_rank`` with a fixed ``nnodes`` N > 1 selects
    torchrun's static rendezvous, where node R gets global ranks R*nproc.. whatever order
    the nodes start in; with an elastic range it is refused (the c10d rendezvous assigns
    node ranks in order of arrival).

    ``local_rank_arg`` passes ``--local_rank=N`` to the script (``terascale run`` does
    unless ``--no_local_rank``, as DeepSpeed's launcher does); ``bind_cores`` pins each
    rank to its share of the cores (of ``bind_core_list``, which implies it) and sets
    ``OMP_NUM_THREADS`` to match; ``rank_log`` (a path prefix) sends each rank's output to
    ``<rank_log>_rank<N>.log``. Any of these runs the script through the rank shim ([Note:
    the rank shim] in :mod:`terascale.launcher.worker`). ``no_python`` runs the script as an
    executable. The fields from ``no_ssh`` on are DeepSpeed's launcher flags ([Note:
    DeepSpeed's launcher flags]); ``save_pid`` is the pid naming ``/tmp/<pid>.deepspeed``.
    """

    script: str
    script_args: tuple[str, ...] = ()
    nproc: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None  # torchrun's --rdzv_conf, over terascale's defaults ([Note: rendezvous settings])
    max_restarts: int = 0
    module: bool = False
    local_rank_arg: bool = False
    bind_cores: bool = False
    bind_core_list: str | None = None  # DeepSpeed's syntax, e.g. "0-7,16-23"
    no_python: bool = False
    rank_log: str | None = None
    no_ssh: bool = False
    force_multi: bool = False
    save_pid: int | None = None
    ssh_port: int | None = None
    venv_script: str | None = None
    log_level: str = "info"  # terascale run's own messages: debug, info, or quieter
    # An elastic MIN:MAX job: "live" keeps the rank processes through membership changes
    # ([Note: the live elastic agent]); "restart" is torchrun's (every change restarts them).
    elastic: str = "live"
    elastic_timeout: float | None = None  # seconds a collective waits for a silent peer (live)
    elastic_expiry: float | None = None  # seconds without a heartbeat before a member is gone (live)

    def __post_init__(self) -> None:
        if not self.script:
            raise ValueError("no training script given; write `terascale run [options] script.py args...`")
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc {self.nproc}: need at least one process per node")
        if self.nnodes is not None:
            _, high = parse_nnodes(self.nnodes)
            if self.node_rank is not None and not 0 <= self.node_rank < high:
                raise ValueError(f"--node_rank {self.node_rank}: must be in [0, {high}) for --nnodes {self.nnodes}")
            if self.node_rank is not None and ":" in self.nnodes and not self.no_ssh:
                raise ValueError(f"--node_rank with an elastic --nnodes {self.nnodes}: the rendezvous gives nodes "
                                 "their ranks as they join; drop --node_rank, or give a fixed node count")
        elif self.node_rank not in (None, 0) and not self.no_ssh:
            raise ValueError(f"--node_rank {self.node_rank} needs --nnodes greater than 1")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master_port {self.master_port}: must be in 1..65535")
        if self.max_restarts < 0:
            raise ValueError(f"--max_restarts {self.max_restarts}: must be >= 0")
        if self.master_addr is not None and not self.master_addr.strip():
            raise ValueError("--master_addr is empty; give a hostname or IP address")
        if self.bind_core_list is not None:
            parse_core_list(self.bind_core_list)  # a malformed list fails here, not in every rank
        if self.rdzv_conf is not None:
            rendezvous_conf(self.rdzv_conf)  # settings that could split the job fail before any node starts
        if self.module and self.no_python:
            raise ValueError("--module and --no_python: a module runs with python -m; give one of them")
        if self.ssh_port is not None and not 0 < self.ssh_port < 65536:
            raise ValueError(f"--ssh_port {self.ssh_port}: must be in 1..65535")
        if self.elastic not in ("live", "restart"):
            raise ValueError(f"--elastic {self.elastic!r}: choose live (keep the processes) or restart (torchrun's)")
        for flag, value in (("--elastic_timeout", self.elastic_timeout), ("--elastic_expiry", self.elastic_expiry)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag} {value}: must be a positive number of seconds")

    @property
    def binds_cores(self) -> bool:
        return self.bind_cores or self.bind_core_list is not None

    def shim_args(self) -> list[str] | None:
        """The rank shim's arguments for these options, or None when the script needs no shim."""
        if not (self.local_rank_arg or self.binds_cores or self.rank_log is not None):
            return None
        return worker_args(self.script, self.script_args, module=self.module, local_rank_arg=self.local_rank_arg,
                           bind=self.binds_cores, core_list=self.bind_core_list, no_python=self.no_python,
                           rank_log=self.rank_log)  # fmt: skip

    def says(self, level: str = "info") -> bool:
        """Whether terascale run prints a message of ``level`` (``"info"`` or ``"debug"``)."""
        return self.log_level == "debug" or (level == "info" and self.log_level == "info")


def default_nproc() -> int:
    """Number of visible CUDA devices, or 1 when there are none (CPU runs)."""
    import torch  # deferred: `terascale --help` must not pay for importing torch

    return max(torch.cuda.device_count(), 1)


def _endpoint(addr: str, port: int) -> str:
    # IPv6 literals need brackets so torchrun can split off the port.
    if ":" in addr and not addr.startswith("["):
        addr = f"[{addr}]"
    return f"{addr}:{port}"


def _static_rendezvous(opts: LaunchOptions) -> list[str]:
    """torchrun's flags for node ``opts.node_rank`` of a fixed ``opts.nnodes``: node 0's agent
    hosts the store at ``master_addr:master_port`` and every node's ranks follow from its
    node rank, so a node that starts first still waits for its place."""
    if opts.master_addr is None:
        raise ValueError(f"--nnodes {opts.nnodes} --node_rank {opts.node_rank} needs --master_addr (node 0's "
                         "address, which every node can reach)")  # fmt: skip
    if opts.rdzv_conf is not None:
        raise ValueError("--rdzv_conf configures the c10d rendezvous; --node_rank uses the static one, which "
                         "takes no settings: drop one of them")  # fmt: skip
    return [f"--nnodes={opts.nnodes}", "--rdzv_backend=static", f"--node_rank={opts.node_rank}",
            f"--master_addr={opts.master_addr}", f"--master_port={opts.master_port or DEFAULT_MASTER_PORT}"]


def torchrun_args(opts: LaunchOptions, nproc_per_node: int, python: str = sys.executable) -> list[str]:
    """The argv that starts one torchrun agent for ``opts`` on this machine.

    One node and no master address/port: ``--standalone``. A ``node_rank`` with a
    fixed node count above one: the static rendezvous, rank 0's agent hosting the store
    at ``master_addr:master_port``. Otherwise c10d rendezvous at
    ``master_addr:master_port`` (address 127.0.0.1 and port 29500 when only the other
    one is given on one node). Raises ``ValueError`` when more than one node is
    requested without ``master_addr``, and for ``rdzv_conf`` with the static rendezvous
    (it configures only c10d's).
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node {nproc_per_node}: need at least one process per node")
    low, high = parse_nnodes(opts.nnodes or "1")
    if low < high and opts.elastic == "live":
        return live_agent_args(opts, nproc_per_node, python)
    args = [python, "-m", "torch.distributed.run"]
    if high == 1 and opts.master_addr is None and opts.master_port is None:
        args += ["--standalone", "--nnodes=1"]
    elif high > 1 and opts.node_rank is not None:
        args += _static_rendezvous(opts)
    else:
        if opts.master_addr is None and high > 1:
            raise ValueError(
                f"--nnodes {opts.nnodes} needs --master_addr (the address every node can reach "
                "for rendezvous), or a --hostfile to start all nodes from here"
            )
        addr = opts.master_addr or "127.0.0.1"
        port = opts.master_port or DEFAULT_MASTER_PORT
        args += [
            f"--nnodes={_format_nnodes(low, high)}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={_endpoint(addr, port)}",
        ]
        if opts.rdzv_id is not None:
            args.append(f"--rdzv_id={opts.rdzv_id}")
        # Always given: torch's own defaults take ~45 s to re-form after a node loss.
        args.append(f"--rdzv_conf={rendezvous_conf(opts.rdzv_conf)}")
        # No --node_rank: c10d gives node ranks in order of arrival, and torchrun would
        # only log that it ignores the flag.
    args += [f"--nproc_per_node={nproc_per_node}", f"--max_restarts={opts.max_restarts}"]
    shim = opts.shim_args()
    if shim is not None:
        # What differs per rank is done in the rank's process ([Note: the rank shim]).
        return [*args, "--module", "terascale.launcher.worker", *shim]
    if opts.module:
        args.append("--module")
    if opts.no_python:
        args.append("--no-python")
    args += [opts.script, *opts.script_args]
    return args


def live_agent_args(opts: LaunchOptions, nproc_per_node: int, python: str = sys.executable) -> list[str]:
    """The argv of one live elastic agent ([Note: the live elastic agent]) for ``opts``,
    whose ``nnodes`` is a range: its store at ``master_addr:master_port``."""
    if opts.master_addr is None:
        raise ValueError(f"--nnodes {opts.nnodes} needs --master_addr (the address every node can reach for the "
                         "job's store), or a --hostfile to start all nodes from here")  # fmt: skip
    if opts.rdzv_conf is not None:
        raise ValueError("--rdzv_conf configures torchrun's rendezvous; a live elastic job (--elastic live, the "
                         "default) takes --elastic_expiry and --elastic_timeout: drop it, or add --elastic restart")
    args = [python, "-m", "terascale.elastic.agent", f"--endpoint={_endpoint(opts.master_addr, opts.master_port or DEFAULT_MASTER_PORT)}",
            f"--run-id={opts.rdzv_id or 'terascale'}", f"--nnodes={opts.nnodes}", f"--nproc={nproc_per_node}",
            f"--max-restarts={opts.max_restarts}"]  # fmt: skip
    if opts.elastic_timeout is not None:
        args.append(f"--timeout={opts.elastic_timeout}")
    if opts.elastic_expiry is not None:
        args.append(f"--expiry={opts.elastic_expiry}")
    shim = opts.shim_args()
    if shim is not None:
        return [*args, "--", python, "-m", "terascale.launcher.worker", *shim]
    if opts.no_python:
        return [*args, "--", opts.script, *opts.script_args]
    if opts.module:
        return [*args, "--", python, "-u", "-m", opts.script, *opts.script_args]
    return [*args, "--", python, "-u", opts.script, *opts.script_args]


# ---------------------------------------------------------------------------
# multi-host planning


def select_resources(
    pool: Mapping[str, int],
    *,
    include: str = "",
    exclude: str = "",
    nnodes: str | None = None,
    nproc: int | None = None,
) -> dict[str, list[int]]:
    """Pick ``{host: slots}`` from a hostfile pool.

    Applies ``include``/``exclude`` (see :func:`filter_hosts`), then keeps the
    first MAX hosts for ``nnodes`` (``"N"`` or ``"MIN:MAX"``) and slots
    ``0..nproc-1`` on each host for ``nproc``, like DeepSpeed's ``--num_nodes``
    and ``--num_gpus``. Raises ``ValueError`` for too few hosts, a host with
    fewer than ``nproc`` slots, or ``nproc`` combined with a filter.
    """
    if nproc is not None and (include or exclude):
        raise ValueError("--nproc cannot be combined with --include/--exclude; list the slots in the filter instead")
    hosts = filter_hosts(pool, include, exclude)
    if nnodes is not None:
        low, high = parse_nnodes(nnodes)
        if len(hosts) < low:
            raise ValueError(f"--nnodes {nnodes} needs at least {low} hosts but only {len(hosts)} are available")
        hosts = dict(list(hosts.items())[:high])
    if nproc is not None:
        for host in hosts:
            if nproc > pool[host]:
                raise ValueError(f"--nproc {nproc}: host {host!r} has only {pool[host]} slots in the hostfile")
        hosts = {host: list(range(nproc)) for host in hosts}
    return hosts


def ssh_commands(
    opts: LaunchOptions,
    hosts: Mapping[str, Sequence[int]],
    *,
    slots_per_host: Mapping[str, int],
    exports: Mapping[str, str],
    cwd: str,
    rdzv_id: str,
    python: str = sys.executable,
    ssh_options: Sequence[str] = DEFAULT_SSH_OPTIONS,
) -> list[list[str]]:
    """One ``ssh`` argv per host, in ``hosts`` order.

    Each runs ``cd CWD && export VARS && exec torchrun ...`` remotely, every
    piece shell-quoted (after :func:`~terascale.launcher.backends.remote_prelude`). Global ranks come from
    the c10d rendezvous, so ``--node_rank`` is not passed. The rendezvous is c10d at
    ``opts.master_addr`` (default: the first host) and ``opts.master_port`` (default
    29500); a host using a subset of its ``slots_per_host`` also gets ``CUDA_VISIBLE_DEVICES``.
    """
    if not hosts:
        raise ValueError("no hosts to launch on")
    host_opts = _agent_options(opts, list(hosts), rdzv_id)
    port = [] if opts.ssh_port is None else ["-p", str(opts.ssh_port)]
    commands = []
    for host in hosts:
        slots = list(hosts[host])
        argv = torchrun_args(host_opts, nproc_per_node=len(slots), python=python)
        host_env = dict(exports)
        if slots != list(range(slots_per_host[host])):
            host_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        remote = backends.shell_command(cwd, host_env, argv, prelude=backends.remote_prelude(opts))
        commands.append(["ssh", *ssh_options, *port, host, remote])
    return commands


def launcher_command(
    launcher: str,
    opts: LaunchOptions,
    hosts: Mapping[str, Sequence[int]],
    *,
    slots_per_host: Mapping[str, int],
    exports: Mapping[str, str],
    cwd: str,
    rdzv_id: str,
    launcher_args: str = "",
    python: str = sys.executable,
) -> tuple[list[str], dict[str, str]]:
    """The one command that starts ``opts`` on every host of ``hosts`` with ``launcher``
    (``pdsh``, ``mpi`` or ``slurm``; see :mod:`terascale.launcher.backends`), and the
    variables to set in that command's own environment. ``launcher_args`` (one string,
    split as a shell would) go to the tool before the program. The master is
    ``opts.master_addr`` or the first host, at ``opts.master_port`` or 29500; under
    slurm only a master the user gave is passed (srun orders the hosts itself, and the
    ranks take the first of its node list). Raises ``ValueError`` for what the tool
    cannot do.
    """
    backends.check_fixed_world(opts, launcher)
    if launcher in ("mpi", "slurm") and opts.venv_script is not None:
        raise ValueError(f"--venv_script is sourced by the remote shell of --launcher torchrun (ssh) or pdsh; "
                         f"--launcher {launcher} starts the ranks without a shell: activate the environment "
                         "before terascale run (its PATH and variables are passed on)")  # fmt: skip
    if launcher == "slurm" and opts.ssh_port is not None:
        raise ValueError("--ssh_port: srun starts the tasks through SLURM's daemons, not ssh; drop --ssh_port")
    extra = shlex.split(launcher_args)
    env = dict(exports)
    devices = backends.shared_visible_devices(launcher, hosts, slots_per_host)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    names = list(hosts)
    master, port = opts.master_addr or names[0], opts.master_port or DEFAULT_MASTER_PORT
    if launcher == "pdsh":
        agent = torchrun_args(_agent_options(opts, names, rdzv_id), backends.processes_per_host(launcher, hosts),
                              python=python)  # fmt: skip
        remote = backends.shell_command(cwd, env, agent, prelude=backends.remote_prelude(opts))
        # pdsh reaches the hosts over ssh, as the torchrun launcher does.
        tool_env = {"PDSH_RCMD_TYPE": "ssh"}
        if opts.ssh_port is not None:
            tool_env["PDSH_SSH_ARGS_APPEND"] = f"-p {opts.ssh_port}"
        return backends.pdsh_command(names, remote, launcher_args=extra), tool_env
    program = backends.rank_program(opts, python)
    if launcher == "mpi":
        env.update(MASTER_ADDR=master, MASTER_PORT=str(port))
        counts = {host: len(slots) for host, slots in hosts.items()}
        return backends.mpirun_command(counts, program, exports=env, cwd=cwd, launcher_args=extra,
                                       ssh_port=opts.ssh_port), {}  # fmt: skip
    if launcher == "slurm":
        if opts.master_addr is not None:
            env["MASTER_ADDR"] = opts.master_addr
        if opts.master_port is not None:
            env["MASTER_PORT"] = str(opts.master_port)
        return backends.srun_command(hosts, program, launcher_args=extra), env
    raise ValueError(f"--launcher {launcher!r}: choose one of {', '.join(backends.LAUNCHERS)}")


def _agent_options(opts: LaunchOptions, names: list[str], rdzv_id: str) -> LaunchOptions:
    """``opts`` for each host's torchrun agent of a launch over the hosts ``names``: c10d
    rendezvous ``rdzv_id`` at ``opts.master_addr`` (default: the first host) and
    ``opts.master_port`` (default 29500). No ``--node_rank``: the rendezvous assigns node
    ranks itself, and torchrun would only warn that it ignores the flag."""
    return dataclasses.replace(opts, nnodes=_nnodes_for(opts, len(names)), node_rank=None,
                               master_addr=opts.master_addr or names[0],
                               master_port=opts.master_port or DEFAULT_MASTER_PORT, rdzv_id=rdzv_id)  # fmt: skip


def node_options(opts: LaunchOptions, hosts: Mapping[str, Sequence[int]]) -> LaunchOptions:
    """``--no_ssh``: ``opts`` for this machine as node ``opts.node_rank`` of the selected
    ``hosts``, every node started by hand with the same command: the static rendezvous at
    ``opts.master_addr`` (default: the first host) for a fixed count, c10d for an elastic
    range (whose nodes take their ranks as they join)."""
    names = list(hosts)
    if opts.node_rank is None or not 0 <= opts.node_rank < len(names):
        raise ValueError(f"--no_ssh starts this machine's ranks only, as one of the {len(names)} selected hosts "
                         f"({', '.join(names)}): give --node_rank R in [0, {len(names)})")  # fmt: skip
    nnodes = _nnodes_for(opts, len(names))
    return dataclasses.replace(opts, nnodes=nnodes, node_rank=None if ":" in nnodes else opts.node_rank,
                               master_addr=opts.master_addr or names[0],
                               master_port=opts.master_port or DEFAULT_MASTER_PORT, no_ssh=False)  # fmt: skip


def _nnodes_for(opts: LaunchOptions, selected: int) -> str:
    """``opts.nnodes`` for the ``selected`` hosts: their count, or the elastic range up to it."""
    if opts.nnodes is None:
        return str(selected)
    low, high = parse_nnodes(opts.nnodes)
    if not low <= selected <= high:
        raise ValueError(f"--nnodes {opts.nnodes} does not fit the {selected} selected hosts")
    return _format_nnodes(low, selected)


def _is_local_host(host: str) -> bool:
    return host in _LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def _check_local_cores(opts: LaunchOptions, nproc: int) -> None:
    """Refuse core binding that cannot work on this machine before any rank starts (each
    rank checks again, on whichever host it runs)."""
    if not opts.binds_cores:
        return
    cores = parse_core_list(opts.bind_core_list) if opts.bind_core_list is not None else usable_cores()
    missing = sorted(set(cores) - os.sched_getaffinity(0))
    if missing:
        raise ValueError(f"--bind_core_list {opts.bind_core_list}: core(s) {missing} are not available on this machine")
    rank_cores(cores, nproc, 0)


def _run_here(opts: LaunchOptions, argv: Sequence[str], env: Mapping[str, str], *, pid_file: bool = True) -> int:
    """Run ``argv`` on this machine (``--save_pid``: its pid in DeepSpeed's file)."""
    if opts.says("debug"):
        print(f"terascale: {shlex.join(argv)}", file=sys.stderr, flush=True)
    return run_local(argv, env=env, pid_file=backends.pid_file(opts.save_pid) if opts.save_pid and pid_file else None)


def _local_devices(env: Mapping[str, str], slots: Sequence[int], count: int) -> dict[str, str]:
    """``env``, with ``CUDA_VISIBLE_DEVICES`` for a host using some of its ``count`` slots."""
    env = dict(env)
    if list(slots) != list(range(count)):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    return env


def launch(
    opts: LaunchOptions,
    *,
    hostfile: str | None = None,
    include: str = "",
    exclude: str = "",
    environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
    launcher: str = "torchrun",
    launcher_args: str = "",
) -> int:
    """Start the job described by ``opts`` and return its exit code.

    Without ``hostfile``: one torchrun agent on this machine. With one: one
    agent per selected host over ssh (or locally, if the only host is this
    machine and not ``opts.force_multi``; only this machine's, as node
    ``opts.node_rank``, with ``opts.no_ssh``), or with ``launcher`` ``pdsh``, ``mpi`` or
    ``slurm`` one command of that tool for every selected host, this machine included
    (:func:`launcher_command`). Raises ``ValueError`` for inconsistent options.
    """
    if launcher not in backends.LAUNCHERS:
        raise ValueError(f"--launcher {launcher!r}: choose one of {', '.join(backends.LAUNCHERS)}")
    if launcher == "torchrun" and launcher_args:
        raise ValueError("--launcher_args go to --launcher pdsh, mpi or slurm; torchrun's settings are "
                         "terascale run's own options")  # fmt: skip
    environ = restart_safe_environment(os.environ if environ is None else environ)
    cwd = os.getcwd() if cwd is None else cwd
    if hostfile is None:
        if launcher != "torchrun" or opts.force_multi:
            flag = "--force_multi" if launcher == "torchrun" else f"--launcher {launcher}"
            raise ValueError(f"{flag} starts the hosts of a --hostfile; give one (one machine: "
                             "terascale run --nproc N)")  # fmt: skip
        count = opts.nproc or default_nproc()
        slots = list(range(count))
        if include or exclude:  # DeepSpeed's one-machine pool: `--include localhost:1` picks this machine's devices
            try:
                slots = select_resources({"localhost": count}, include=include, exclude=exclude,
                                         nproc=opts.nproc)["localhost"]  # fmt: skip
            except ValueError as exc:
                raise ValueError(f"{exc} (without a --hostfile, the one host is localhost with this machine's "
                                 f"{count} device(s))") from None  # fmt: skip
        _check_local_cores(opts, len(slots))
        argv = torchrun_args(opts, nproc_per_node=len(slots))
        return _run_here(opts, argv, _local_devices(environ, slots, count))

    if opts.node_rank is not None and not opts.no_ssh:
        raise ValueError("--node_rank is assigned per host when --hostfile is given; drop --node_rank (or start "
                         "each host by hand with --no_ssh --node_rank R)")  # fmt: skip
    pool = read_hostfile(hostfile)
    hosts = select_resources(pool, include=include, exclude=exclude, nnodes=opts.nnodes, nproc=opts.nproc)
    if opts.no_ssh:
        if launcher != "torchrun":
            raise ValueError(f"--no_ssh starts this machine's ranks only; --launcher {launcher} starts every host: "
                             "drop one of them")  # fmt: skip
        here = node_options(opts, hosts)
        host = list(hosts)[opts.node_rank]
        _check_local_cores(here, len(hosts[host]))
        return _run_here(here, torchrun_args(here, len(hosts[host])), _local_devices(environ, hosts[host], pool[host]))
    if launcher != "torchrun":
        exports = remote_exports(environ, load_env_files([Path.home(), cwd], env_file_names(environ)))
        argv, extra_env = launcher_command(launcher, opts, hosts, slots_per_host=pool, exports=exports, cwd=cwd,
                                           rdzv_id=opts.rdzv_id or uuid.uuid4().hex[:16], launcher_args=launcher_args)
        if shutil.which(argv[0]) is None:
            raise ValueError(f"--launcher {launcher}: {argv[0]} was not found on PATH; install it, or use "
                             "--launcher torchrun (ssh)")  # fmt: skip
        if environ.get("PDSH_SSH_ARGS_APPEND") and "PDSH_SSH_ARGS_APPEND" in extra_env:
            extra_env["PDSH_SSH_ARGS_APPEND"] = f"{environ['PDSH_SSH_ARGS_APPEND']} {extra_env['PDSH_SSH_ARGS_APPEND']}"
        for host, slots in hosts.items() if opts.says() else ():
            print(f"terascale: starting {len(slots)} processes on {host} with {argv[0]}", file=sys.stderr, flush=True)
        # pdsh: each host's shell writes the --save_pid file; mpirun and srun start every rank themselves.
        return _run_here(opts, argv, {**environ, **extra_env}, pid_file=launcher != "pdsh")
    if len(hosts) == 1 and _is_local_host(next(iter(hosts))) and not opts.force_multi:
        host, slots = next(iter(hosts.items()))
        _check_local_cores(opts, len(slots))
        argv = torchrun_args(dataclasses.replace(opts, nnodes=None), nproc_per_node=len(slots))
        return _run_here(opts, argv, _local_devices(environ, slots, pool[host]))

    if shutil.which("ssh") is None:
        raise ValueError(
            "ssh was not found on PATH; install an OpenSSH client, or start "
            "`terascale run --nnodes N --master_addr A ...` on every node by hand"
        )
    exports = remote_exports(environ, load_env_files([Path.home(), cwd], env_file_names(environ)))
    commands = ssh_commands(
        opts,
        hosts,
        slots_per_host=pool,
        exports=exports,
        cwd=cwd,
        rdzv_id=opts.rdzv_id or uuid.uuid4().hex[:16],
    )
    for (host, slots), command in zip(hosts.items(), commands):
        if opts.says():
            print(f"terascale: starting {len(slots)} processes on {host}", file=sys.stderr, flush=True)
        if opts.says("debug"):
            print(f"terascale: {shlex.join(command)}", file=sys.stderr, flush=True)
    return run_remote(list(zip(hosts, commands)))


if __name__ == "__main__":  # python -m deepspeed.launcher.runner: DeepSpeed's command line on terascale run
    from terascale.launcher.deepspeed_cli import script_main

    raise SystemExit(script_main())
