"""DeepSpeed's launcher command line on ``terascale run``, and the names of ``deepspeed.launcher.runner``.

[Note: DeepSpeed's launcher flags]
``deepspeed [flags] train.py args`` becomes ``terascale run --as-deepspeed [the same flags]
train.py args``. The flags both launchers have are ``terascale run``'s own (``--num_gpus``,
``--num_nodes``, ``--include/--exclude``, ``--hostfile``, ``--master_addr/--master_port``,
``--launcher``, ``--launcher_args``, ``--module``, ``--no_local_rank``, ``--bind_cores_to_rank``,
``--bind_core_list``, ``--node_rank``); this module adds the rest with DeepSpeed's meaning:

- ``--elastic_training`` with ``--min_elastic_nodes``/``--max_elastic_nodes``: the elastic node
  range ``--nnodes MIN:MAX`` (defaults 1 and ``--num_nodes``, or the hostfile's host count);
  without ``--elastic_training`` DeepSpeed ignores the two, and so does terascale, saying so;
- ``--no_python`` (run the script as an executable), ``--no_ssh`` (with a hostfile: start only
  this machine's ranks, as node ``--node_rank`` of the hostfile's hosts), ``--force_multi``
  (start the hosts over ssh even when the hostfile names only this machine), ``--save_pid``
  (``/tmp/<pid of terascale run>.deepspeed`` holds the pid of the process that starts this
  node's ranks), ``--enable_each_rank_log DIR`` (each rank's output in
  ``DIR/<timestamp>_rank<N>.log``), ``--ssh_port``, ``--venv_script`` (sourced before the
  ranks start on each remote host), ``--log_level`` and ``-q/--quiet`` (terascale run's own
  messages); ``--no_ssh_check`` is accepted: terascale's ssh runs in batch mode, so a host
  that wants a password fails at once instead;
- DeepSpeed's launcher names: ``openmpi`` is terascale's ``mpi`` (OpenMPI's mpirun); ``mpich``,
  ``impi``, ``mvapich`` and ``jsrun`` are refused by name (their commands are not built);
- ``--autotuning`` is refused by name (DeepSpeed's autotuner is not built).

DeepSpeed's "unset" values (``-1`` for the counts, ``None`` for the rank logs) mean unset here
too. ``TERASCALE_AS_DEEPSPEED=1`` (``--as-deepspeed``) reaches every rank on every host
(:data:`terascale.launcher.environment.EXPORT_NAMES`), and a real DeepSpeed importable here
stops the launch before any rank starts ([Note: the stand-in switch]).

``deepspeed.launcher.runner`` is ``terascale.launcher.runner``, which takes DeepSpeed's module
names from here: the env-file names, :data:`EXPORT_ENVS`, :func:`fetch_hostfile`, the resource
filters, :func:`parse_args` and :func:`main`, so ``python -m deepspeed.launcher.runner ...``
runs DeepSpeed's command line on ``terascale run``. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from terascale.launcher import backends
from terascale.launcher.environment import DEEPSPEED_ENVIRONMENT_NAME, EXPORT_NAMES, EXPORT_PREFIXES
from terascale.launcher.hostfile import parse_hostfile, read_hostfile

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "EXPORT_ENVS",
    "PDSH_MAX_FAN_OUT",
    "add_deepspeed_arguments",
    "fetch_hostfile",
    "launch_fields",
    "launcher_name",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
    "script_main",
    "stand_in_environment",
]

# DeepSpeed's default hostfile (its DLTS clusters): its command line (main) uses it when it exists.
DLTS_HOSTFILE = "/job/hostfile"
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
EXPORT_ENVS = [*EXPORT_PREFIXES, *EXPORT_NAMES]
PDSH_MAX_FAN_OUT = backends.PDSH_MAX_FAN_OUT

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# DeepSpeed's launcher names that terascale has under another name, and those it does not build.
_LAUNCHER_ALIASES = {"openmpi": "mpi"}
_OWN_MPIRUN = ("start the ranks with that MPI's own launcher and `python -u train.py`: each rank finds its place "
               "from the launcher's variables ({}; see terascale.comm.discovery), with MASTER_ADDR exported")
_REFUSED_LAUNCHERS = {
    "mpich": _OWN_MPIRUN.format("PMI_RANK, PMI_SIZE, MPI_LOCALRANKID"),
    "impi": _OWN_MPIRUN.format("PMI_RANK, PMI_SIZE, MPI_LOCALRANKID"),
    "mvapich": _OWN_MPIRUN.format("MV2_COMM_WORLD_RANK, MV2_COMM_WORLD_LOCAL_RANK"),
    "jsrun": "LSF's jsrun is not built as a terascale launcher; use --launcher openmpi, pdsh or torchrun (ssh)",
}


def launcher_name(name: str) -> str:
    """``--launcher NAME`` as terascale's launcher (argparse type): DeepSpeed's names, any case.
    Raises ArgumentTypeError naming what is not built."""
    key = name.strip().lower()
    if key == "jsrun":
        raise argparse.ArgumentTypeError(f"{name}: {_REFUSED_LAUNCHERS[key]}")
    if key in _REFUSED_LAUNCHERS:
        raise argparse.ArgumentTypeError(f"{name}: terascale builds OpenMPI's mpirun command only (--launcher "
                                         f"openmpi, the same as mpi); {_REFUSED_LAUNCHERS[key]}")  # fmt: skip
    return _LAUNCHER_ALIASES.get(key, key)


def add_deepspeed_arguments(p: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher flags that ``terascale run`` has in no form of its own ([Note:
    DeepSpeed's launcher flags])."""
    g = p.add_argument_group("DeepSpeed's launcher flags (as `deepspeed ...` takes them)")
    g.add_argument("--as-deepspeed", "--as_deepspeed", dest="as_deepspeed", action="store_true",
                   help="every rank sees terascale as `deepspeed` (sets TERASCALE_AS_DEEPSPEED=1 on every host), so "
                   "tools that import deepspeed themselves run on terascale; refused where a real DeepSpeed is "
                   "installed")  # fmt: skip
    g.add_argument("--elastic_training", action="store_true",
                   help="elastic node count: --min_elastic_nodes..--max_elastic_nodes (the same as --nnodes MIN:MAX)")
    g.add_argument("--min_elastic_nodes", type=int, default=-1, metavar="N", help="with --elastic_training (default 1)")
    g.add_argument("--max_elastic_nodes", type=int, default=-1, metavar="N",
                   help="with --elastic_training (default: --num_nodes, or the hostfile's hosts)")
    g.add_argument("--no_python", action="store_true", help="run SCRIPT as an executable, not with python")
    g.add_argument("--no_ssh", action="store_true",
                   help="with --hostfile: start only this machine's ranks, as node --node_rank of the hostfile's "
                   "selected hosts (run the same command on every host)")  # fmt: skip
    g.add_argument("--no_ssh_check", action="store_true",
                   help="accepted for DeepSpeed's command lines: terascale's ssh runs in batch mode, so a host "
                   "that wants a password fails at once")  # fmt: skip
    g.add_argument("--force_multi", action="store_true",
                   help="start the hostfile's hosts with --launcher even when it names only this machine")
    g.add_argument("--save_pid", action="store_true",
                   help="write /tmp/<pid of terascale run>.deepspeed holding the pid of the process that starts "
                   "this node's ranks (torchrun's agent; mpirun or srun)")  # fmt: skip
    g.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                   help="each rank's stdout and stderr in DIR/<timestamp>_rank<N>.log (the directory is made)")
    g.add_argument("--ssh_port", type=int, default=None, metavar="PORT", help="ssh port of the hosts (ssh, pdsh, mpi)")
    g.add_argument("--venv_script", default=None, metavar="FILE",
                   help="a script sourced on each remote host before its ranks start (ssh, pdsh), e.g. a "
                   "virtualenv's bin/activate")  # fmt: skip
    g.add_argument("--log_level", type=str.lower, choices=_LOG_LEVELS, default="info",
                   help="terascale run's own messages: debug also prints the commands; warning and above "
                   "leave out the progress lines")  # fmt: skip
    g.add_argument("-q", "--quiet", action="store_true", help="the same as --log_level error")
    g.add_argument("--autotuning", choices=("tune", "run"), default=None,
                   help="DeepSpeed's autotuner: not built in terascale (refused)")


def _elastic_nnodes(args: argparse.Namespace) -> str | None:
    """``--nnodes`` after DeepSpeed's elastic flags: ``MIN:MAX``, or ``args.nnodes`` unchanged."""
    given = args.min_elastic_nodes > 0 or args.max_elastic_nodes > 0
    nnodes = None if args.nnodes is None or args.nnodes.startswith("-") else args.nnodes
    if not args.elastic_training:
        if given and _level(args) <= _LOG_LEVELS.index("warning"):
            print("terascale run: --min_elastic_nodes/--max_elastic_nodes take effect with --elastic_training only "
                  "(as in DeepSpeed); ignored", file=sys.stderr)  # fmt: skip
        return nnodes
    if nnodes is not None and ":" in nnodes:
        if given:
            raise ValueError(f"--num_nodes {nnodes} and --min/--max_elastic_nodes both give the node range; "
                             "give it once")  # fmt: skip
        return nnodes
    low = args.min_elastic_nodes if args.min_elastic_nodes > 0 else 1
    if args.max_elastic_nodes > 0:
        high = args.max_elastic_nodes
    elif nnodes is not None:
        high = int(nnodes)
    else:
        high = len(read_hostfile(args.hostfile)) if args.hostfile else 1
    if low > high:
        raise ValueError(f"--elastic_training: --min_elastic_nodes {low} is above the most nodes, {high}")
    return f"{low}:{high}"


def _unset(value: int | None) -> int | None:
    return None if value is None or value < 0 else value  # DeepSpeed's -1: "not given"


def _level(args: argparse.Namespace) -> int:
    return _LOG_LEVELS.index("error" if args.quiet else args.log_level)


def launch_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~terascale.launcher.runner.LaunchOptions` fields of DeepSpeed's flags on
    ``terascale run`` (and its ``--nnodes`` after the elastic ones). Raises ValueError for
    ``--autotuning``."""
    if args.autotuning is not None:
        raise ValueError(f"--autotuning {args.autotuning}: DeepSpeed's autotuner is not built in terascale. "
                         "`terascale plan --model ... --config ds.json` weighs the choices a config leaves \"auto\" "
                         "(ZeRO stage, offload, micro batch size) for a model on this machine, and "
                         "terascale.initialize makes the same choice when the job starts")  # fmt: skip
    if args.as_deepspeed and args.nnodes is not None and (args.include or args.exclude):
        # DeepSpeed's rule; terascale's own `run` keeps the first hosts of a filtered pool.
        raise ValueError("--num_nodes cannot be combined with --include/--exclude (as in DeepSpeed); "
                         "name the hosts in the filter instead")  # fmt: skip
    rank_log = args.enable_each_rank_log
    if rank_log in (None, "None"):  # DeepSpeed's default is the string "None"
        rank_log = None
    else:
        # One timestamp for the job, as DeepSpeed names its files (<timestamp>_rank<N>.log).
        rank_log = os.path.join(os.path.abspath(rank_log), time.strftime("%Y%m%d%H%M%S", time.localtime()))
    return {
        "nproc": _unset(args.nproc),
        "node_rank": _unset(args.node_rank),
        "nnodes": _elastic_nnodes(args),
        "no_python": args.no_python,
        "rank_log": rank_log,
        "no_ssh": args.no_ssh,
        "force_multi": args.force_multi,
        "save_pid": os.getpid() if args.save_pid else None,
        "ssh_port": args.ssh_port,
        "venv_script": args.venv_script,
        "log_level": _LOG_LEVELS[_level(args)],
    }


def stand_in_environment(as_deepspeed: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ranks' environment: ``environ`` (default ``os.environ``) with the stand-in switch
    on for ``as_deepspeed``. Where the switch is on (by the flag or already in the
    environment) and a real DeepSpeed is importable here, ValueError with the message
    naming both: the ranks could not import ``deepspeed``."""
    from terascale.integrations.deepspeed import standin

    env = dict(os.environ if environ is None else environ)
    if as_deepspeed:
        env[standin.ENV_VAR] = "1"
    if standin.enabled(env):
        where = standin.real_deepspeed()
        if where is not None:
            raise ValueError(standin.conflict_message(where))
    return env


# -- deepspeed.launcher.runner's functions ---------------------------------------------------------


def fetch_hostfile(hostfile_path: str) -> collections.OrderedDict[str, int] | None:
    """``{host: slots}`` of the hostfile at ``hostfile_path`` in file order; None (with a
    warning) when there is no such file, as DeepSpeed's. ValueError for a malformed one."""
    if not os.path.isfile(hostfile_path):
        print(f"terascale: no hostfile at {hostfile_path}; the job runs on this machine only", file=sys.stderr)
        return None
    return collections.OrderedDict(read_hostfile(hostfile_path))


def _parse_hostfile(hostfile_lines: Sequence[str]) -> collections.OrderedDict[str, int]:
    """DeepSpeed's private parser of hostfile lines (its unit tests call it)."""
    return collections.OrderedDict(parse_hostfile("\n".join(hostfile_lines)))


def _node_specs(spec: str, host_info: Mapping[str, Sequence[int]], flag: str) -> dict[str, list[int] | None]:
    """``NAME[:SLOT,...]@...`` as ``{host: slots}`` (None: the whole host), checked against ``host_info``."""
    named: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        # A name that is itself a host (an IPv6 address has colons) is the whole host.
        host, sep, slot_text = part.rpartition(":") if part not in host_info and ":" in part else (part, "", "")
        if host not in host_info:
            raise ValueError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(host_info)})")
        if not sep:
            named[host] = None
            continue
        try:
            slots = [int(s) for s in slot_text.split(",")]
        except ValueError:
            raise ValueError(f"{flag}: {part!r}: write slots as HOST:0,1,2") from None
        missing = [s for s in slots if s not in host_info[host]]
        if missing:
            raise ValueError(f"{flag}: host {host!r} has no slot {missing[0]} (its slots: {list(host_info[host])})")
        if named.get(host, []) is not None:  # a whole host stays whole
            named[host] = sorted({*(named.get(host) or []), *slots})
    return named


def parse_resource_filter(host_info: Mapping[str, Sequence[int]], include_str: str = "",
                          exclude_str: str = "") -> Mapping[str, list[int]]:  # fmt: skip
    """DeepSpeed's ``--include``/``--exclude`` over ``{host: [slots]}``: the selected
    ``{host: [slots]}`` in ``host_info``'s order, hosts left with no slot dropped (``{}`` when
    nothing is left). Raises ValueError for both filters at once, or a host or slot not in
    ``host_info``."""
    if include_str and exclude_str:
        raise ValueError("--include and --exclude are mutually exclusive; give only one")
    if not include_str and not exclude_str:
        return host_info
    named = _node_specs(include_str or exclude_str, host_info, "--include" if include_str else "--exclude")
    if include_str:
        chosen = {h: list(host_info[h]) if slots is None else slots for h, slots in named.items()}
    else:
        chosen = {h: [s for s in host_info[h] if h not in named or (named[h] is not None and s not in named[h])]
                  for h in host_info}  # fmt: skip
    return collections.OrderedDict((h, list(dict.fromkeys(chosen[h]))) for h in host_info if chosen.get(h))


def parse_inclusion_exclusion(resource_pool: Mapping[str, int], inclusion: str,
                              exclusion: str) -> Mapping[str, list[int]]:  # fmt: skip
    """The ``{host: [slots]}`` of a ``{host: slot count}`` pool that the filters select."""
    return parse_resource_filter({h: list(range(n)) for h, n in resource_pool.items()}, inclusion, exclusion)


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's command line (default ``sys.argv[1:]``) parsed as ``terascale run
    --as-deepspeed ...``; ``user_script`` and ``user_args`` are DeepSpeed's names of the script
    and its arguments."""
    from terascale.launcher.cli import build_parser

    ns = build_parser().parse_args(["run", "--as-deepspeed", *(sys.argv[1:] if args is None else args)])
    ns.user_script, ns.user_args = ns.script, ns.script_args
    if ns.hostfile is None and os.path.isfile(DLTS_HOSTFILE):
        ns.hostfile = DLTS_HOSTFILE
    return ns


def main(args: Sequence[str] | None = None) -> None:
    """Run DeepSpeed's command line (default ``sys.argv[1:]``) on ``terascale run
    --as-deepspeed``, as DeepSpeed's ``main``: ValueError for bad options, SystemExit with the
    job's exit code when it fails."""
    ns = parse_args(args)
    rc = ns.handler(ns)
    if rc:
        raise SystemExit(rc)


def script_main() -> int:
    """``python -m deepspeed.launcher.runner ...``: :func:`main` with terascale's usage errors."""
    try:
        main()
    except ValueError as exc:
        print(f"terascale run: error: {exc}", file=sys.stderr)
        return 2
    return 0
