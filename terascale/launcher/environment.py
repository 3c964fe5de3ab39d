"""What environment ``terascale run`` gives the ranks on other hosts: env files and exported variables.

Ranks on this machine inherit ``terascale run``'s environment. On other hosts (ssh, pdsh,
mpirun, srun) they get only what is exported: the variables of :data:`EXPORT_PREFIXES` and
:data:`EXPORT_NAMES` from this environment, then the ``KEY=VALUE`` lines of the env files
(``.deepspeed_env``, or ``$DS_ENV_FILE`` as DeepSpeed reads it, and ``.terascale_env``) in the
home directory and the working directory. Pure functions; nothing here imports torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "ENV_FILE_NAMES",
    "EXPORT_NAMES",
    "EXPORT_PREFIXES",
    "env_file_names",
    "load_env_files",
    "parse_env_file",
    "remote_exports",
    "restart_safe_environment",
]

# DeepSpeed's prefixes (its EXPORT_ENVS and the CUDA accelerator's NCCL), so a job moved from
# `deepspeed` to `terascale run` carries the same variables to its hosts.
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX")
# The stand-in switch ([Note: the stand-in switch]): every rank, on every host, sees the same `deepspeed`.
EXPORT_NAMES = ("TERASCALE_AS_DEEPSPEED",)
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# torchrun's c10d rendezvous shares its TCPStore with the workers by default, and after a
# restart the new workers can read the previous attempt's keys (gloo/NCCL addresses) from
# it: connections refused or hangs at init (pytorch/pytorch#135712, #167288; seen here with
# gloo on torch 2.13). A store per rendezvous round avoids that.
_RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def env_file_names(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The env files' names: DeepSpeed's (``$DS_ENV_FILE``, default ``.deepspeed_env``) and
    terascale's ``.terascale_env``, which wins where both set a variable."""
    environ = os.environ if environ is None else environ
    return environ.get("DS_ENV_FILE") or ".deepspeed_env", ".terascale_env"


ENV_FILE_NAMES = env_file_names()
# DeepSpeed's name for its env file, read when the launcher starts as DeepSpeed's is
# (accelerate's DeepSpeed launcher imports it from deepspeed.launcher.runner and writes to it).
DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]


def restart_safe_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus the settings that make torchrun's worker restarts reliable
    (values the user set win)."""
    return {**_RESTART_SAFE_ENV, **environ}


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def parse_env_file(text: str, source: str = ".terascale_env") -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines (blank lines and ``#`` comments skipped).

    One pair of surrounding quotes around VALUE is removed; nothing is
    expanded. Raises ``ValueError`` naming ``source`` and the line for a line
    without ``=`` or a KEY that is not a valid variable name.
    """
    result: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _ENV_KEY.match(key):
            raise ValueError(f"{source}, line {lineno}: expected KEY=VALUE, got {line!r}")
        result[key] = _unquote(value.strip())
    return result


def load_env_files(directories: Sequence[str | Path], names: Sequence[str] | None = None) -> dict[str, str]:
    """Merge the env files (``names``, default :func:`env_file_names`) found in ``directories``.

    Later directories and later names override earlier ones, so with
    ``[home, cwd]`` the current directory wins. Missing files are skipped, and a
    file reached twice (an absolute ``$DS_ENV_FILE``) is read once.
    """
    merged: dict[str, str] = {}
    seen: set[Path] = set()
    for directory in directories:
        for name in env_file_names() if names is None else names:
            path = Path(directory, name)
            if not path.is_file():
                continue
            resolved = path.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            merged.update(parse_env_file(path.read_text(), source=str(path)))
    return merged


def remote_exports(environ: Mapping[str, str], env_file_vars: Mapping[str, str]) -> dict[str, str]:
    """Variables to export on every remote host: those of :data:`EXPORT_PREFIXES` (PYTHONPATH,
    NCCL_*, ...) and :data:`EXPORT_NAMES`, torchrun's restart settings, then the env files."""
    exports = {
        key: environ[key]
        for key in sorted(environ)
        if key in EXPORT_NAMES or key in _RESTART_SAFE_ENV or key.startswith(EXPORT_PREFIXES)
    }
    exports.update(env_file_vars)
    return exports
