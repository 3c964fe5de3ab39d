"""``terascale run`` / ``terascale env``: a launcher over torchrun and an environment report.

The command construction helpers are pure functions, re-exported here for
scripting and tests; none of them imports torch.
"""

from terascale.launcher.hostfile import filter_hosts, parse_hostfile, read_hostfile
from terascale.launcher.runner import (
    LaunchOptions,
    launch,
    load_env_files,
    parse_env_file,
    parse_nnodes,
    remote_exports,
    select_resources,
    ssh_commands,
    torchrun_args,
)

__all__ = [
    "LaunchOptions",
    "filter_hosts",
    "launch",
    "load_env_files",
    "parse_env_file",
    "parse_hostfile",
    "parse_nnodes",
    "read_hostfile",
    "remote_exports",
    "select_resources",
    "ssh_commands",
    "torchrun_args",
]
