"""The commands of ``terascale run --launcher {pdsh,mpi,slurm}``: one command starts every host.

``--launcher torchrun`` (the default) starts one torchrun agent per host over ssh
(:func:`terascale.launcher.runner.ssh_commands`). The others hand the hosts to a tool the
cluster already has, as DeepSpeed's ``--launcher`` does:

* ``pdsh``: ``pdsh -w HOSTS 'cd CWD && export ... && exec torchrun ...'``; every host runs
  the same torchrun agent, and the agents form the job in a c10d rendezvous;
* ``mpi``: OpenMPI's ``mpirun -np TOTAL -H host:n,... -x VAR=... python -u SCRIPT``; the
  ranks find each other from ``OMPI_COMM_WORLD_*`` (:mod:`terascale.comm.discovery`),
  with ``MASTER_ADDR`` (the first host) and ``MASTER_PORT`` passed with ``-x``;
* ``slurm``: ``srun -n TOTAL --ntasks-per-node N --nodelist HOSTS python -u SCRIPT``,
  run inside an allocation; the ranks find each other from ``SLURM_*``.

One command for every host means one environment and one slot list for every host: a
selection that uses different slots on different hosts is refused, as is a different
process count per host where the tool cannot express it (pdsh, slurm). Without torchrun
the world is fixed: no ``--max_restarts``, no elastic ``--nnodes MIN:MAX``. All functions
here are pure and need no tool installed.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from terascale.launcher.runner import LaunchOptions

__all__ = [
    "LAUNCHERS",
    "PDSH_MAX_FAN_OUT",
    "check_fixed_world",
    "mpirun_command",
    "pdsh_command",
    "pid_file",
    "processes_per_host",
    "rank_program",
    "remote_prelude",
    "shared_visible_devices",
    "shell_command",
    "srun_command",
]

LAUNCHERS = ("torchrun", "pdsh", "mpi", "slurm")
# pdsh's default fan-out is 32 concurrent connections; a job's hosts all start at once.
PDSH_MAX_FAN_OUT = 1024


def shell_command(cwd: str, env: Mapping[str, str], argv: Sequence[str], prelude: Sequence[str] = ()) -> str:
    """``[PRELUDE && ]cd CWD && export K=V ... && exec ARGV`` for a remote shell, every piece
    quoted but the ``prelude`` commands, which are shell text.

    ``exec``: the program replaces the shell, so a hang-up on disconnect reaches it directly.
    """
    command = " && ".join([*prelude, f"cd {shlex.quote(cwd)}"])
    if env:
        command += " && export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return command + " && exec " + shlex.join(argv)


def pid_file(pid: int) -> str:
    """DeepSpeed's ``--save_pid`` file, named by the pid of the launcher the user started."""
    return f"/tmp/{pid}.deepspeed"


def remote_prelude(opts: LaunchOptions) -> list[str]:
    """What a remote shell runs before the agent: ``--venv_script``, and ``--save_pid``'s file."""
    prelude = []
    if opts.venv_script is not None:
        prelude.append(f". {shlex.quote(opts.venv_script)}")
    if opts.save_pid is not None:
        # The shell execs the agent, which keeps its pid: $$ is the agent's.
        prelude.append(f"echo $$ > {shlex.quote(pid_file(opts.save_pid))}")
    return prelude


def shared_visible_devices(launcher: str, hosts: Mapping[str, Sequence[int]],
                           slots_per_host: Mapping[str, int]) -> str | None:  # fmt: skip
    """The ``CUDA_VISIBLE_DEVICES`` every host gets from one command: ``None`` when each
    host uses all its slots, the common list when all use the same subset; else
    ``ValueError`` (one command cannot give hosts different devices)."""
    if all(list(slots) == list(range(slots_per_host[host])) for host, slots in hosts.items()):
        return None
    lists = {tuple(slots) for slots in hosts.values()}
    if len(lists) > 1:
        chosen = ", ".join(f"{host}: {list(slots)}" for host, slots in hosts.items())
        raise ValueError(f"--launcher {launcher} starts every host with one command, so every host must use the "
                         f"same slots; the selection gives {chosen} (use --launcher torchrun, or select the same "
                         "slots everywhere)")  # fmt: skip
    return ",".join(map(str, lists.pop()))


def processes_per_host(launcher: str, hosts: Mapping[str, Sequence[int]]) -> int:
    """The one process count of every host in ``hosts``; ``ValueError`` when they differ."""
    counts = {len(slots) for slots in hosts.values()}
    if len(counts) > 1:
        raise ValueError(f"--launcher {launcher} starts the same number of processes on every host, but the "
                         f"selection has {dict((h, len(s)) for h, s in hosts.items())}; use --nproc N or "
                         "--launcher torchrun")  # fmt: skip
    return counts.pop()


def check_fixed_world(opts: LaunchOptions, launcher: str) -> None:
    """Refuse what only a torchrun agent can do: restarts and elastic node ranges."""
    if launcher not in ("mpi", "slurm"):
        return
    if opts.max_restarts:
        raise ValueError(f"--max_restarts needs torchrun's agent, which --launcher {launcher} does not run; "
                         "use --launcher torchrun or pdsh")  # fmt: skip
    if opts.nnodes is not None and ":" in opts.nnodes:
        raise ValueError(f"--nnodes {opts.nnodes}: --launcher {launcher} starts a fixed world; give a node count")
    if opts.rdzv_conf is not None:
        raise ValueError(f"--rdzv_conf configures torchrun's rendezvous, which --launcher {launcher} does not use")


def pdsh_command(hosts: Sequence[str], remote: str, *, launcher_args: Sequence[str] = ()) -> list[str]:
    """``pdsh -S -f N -w HOSTS [launcher_args] REMOTE``: run the shell command ``remote``
    on every host at once (``-S``: exit with the largest remote exit code)."""
    if not hosts:
        raise ValueError("no hosts to launch on")
    fan_out = min(len(hosts), PDSH_MAX_FAN_OUT)
    return ["pdsh", "-S", "-f", str(fan_out), "-w", ",".join(hosts), *launcher_args, remote]


def rank_program(opts: LaunchOptions, python: str) -> list[str]:
    """What each rank runs when a launcher other than torchrun starts it: ``python -u
    SCRIPT ARGS`` (``-m`` for a module), through the rank shim for ``--local_rank`` and
    core binding ([Note: the rank shim]), which reads the launcher's local rank."""
    shim = opts.shim_args()
    if shim is not None:
        return [python, "-u", "-m", "terascale.launcher.worker", *shim]
    if opts.no_python:
        return [opts.script, *opts.script_args]
    return [python, "-u", *(["-m"] if opts.module else []), opts.script, *opts.script_args]


def mpirun_command(hosts: Mapping[str, int], program: Sequence[str], *, exports: Mapping[str, str], cwd: str,
                   launcher_args: Sequence[str] = (), ssh_port: int | None = None) -> list[str]:  # fmt: skip
    """OpenMPI's ``mpirun`` starting ``hosts[h]`` copies of ``program`` on each host ``h``.

    ``--map-by slot`` fills each host's slots in the hostfile's order, so ranks 0..n-1 are
    on the first host, where ``MASTER_ADDR`` points. ``--bind-to none`` unless the
    launcher arguments bind: OpenMPI binds each rank to one core by default for small
    jobs, which would leave torch's intra-op threads one core (terascale's own
    ``--bind_cores_to_rank`` binds to a share of the cores instead). ``exports`` are
    passed with ``-x``; ``ssh_port`` reaches OpenMPI's ssh as ``--mca plm_rsh_args "-p PORT"``
    unless the launcher arguments set those.
    """
    if not hosts:
        raise ValueError("no hosts to launch on")
    argv = ["mpirun", "-np", str(sum(hosts.values())), "-H", ",".join(f"{h}:{n}" for h, n in hosts.items())]
    if not any(a.lstrip("-") == "map-by" for a in launcher_args):
        argv += ["--map-by", "slot"]
    if not any(a.lstrip("-") == "bind-to" for a in launcher_args):
        argv += ["--bind-to", "none"]
    if ssh_port is not None and "plm_rsh_args" not in launcher_args:
        argv += ["--mca", "plm_rsh_args", f"-p {ssh_port}"]
    argv += ["-wdir", cwd, *launcher_args]
    for key, value in exports.items():
        argv += ["-x", f"{key}={value}"]
    return [*argv, *program]


def srun_command(hosts: Mapping[str, Sequence[int]], program: Sequence[str], *,
                 launcher_args: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """``srun`` starting the same number of copies of ``program`` on each of ``hosts``.

    srun passes its own environment to the tasks (``--export=ALL``, its default), so the
    caller runs it with the variables to export rather than listing them here.
    """
    if not hosts:
        raise ValueError("no hosts to launch on")
    per_host = processes_per_host("slurm", hosts)
    return ["srun", "--ntasks", str(per_host * len(hosts)), "--ntasks-per-node", str(per_host),
            "--nodes", str(len(hosts)), "--nodelist", ",".join(hosts), *launcher_args, *program]  # fmt: skip
