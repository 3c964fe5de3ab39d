"""Tests for terascale.launcher: hostfiles, resource filters, command construction, real runs.

Command construction is checked against torchrun's own argument parser (the
reference for what the flags mean); real runs start `python -m terascale` as
users do, with gloo on CPU, and bound every process with a timeout.
"""

from __future__ import annotations

import dataclasses

import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from terascale.launcher.cli import build_parser, main
from terascale.launcher.env_report import collect_env, format_table, odirect_status
from terascale.launcher.hostfile import filter_hosts, parse_hostfile, read_hostfile
from terascale.launcher.runner import (
    LaunchOptions,
    launcher_command,
    load_env_files,
    parse_env_file,
    parse_nnodes,
    remote_exports,
    run_local,
    run_remote,
    select_resources,
    ssh_commands,
    torchrun_args,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 180

# ---------------------------------------------------------------------------
# hostfile


def test_parse_hostfile_valid_with_comments_and_blank_lines():
    text = "# cluster\n\nworker-0 slots=4\n  worker-1   slots=2  # two GPUs broken\n\n10.0.0.7 slots=8\n"
    hosts = parse_hostfile(text)
    assert hosts == {"worker-0": 4, "worker-1": 2, "10.0.0.7": 8}
    assert list(hosts) == ["worker-0", "worker-1", "10.0.0.7"]


def test_parse_hostfile_malformed_line_names_line_number():
    with pytest.raises(ValueError, match=r"line 3.*worker-1 slot=2"):
        parse_hostfile("worker-0 slots=4\n# ok\nworker-1 slot=2\n")
    with pytest.raises(ValueError, match="line 1"):
        parse_hostfile("worker-0\n")
    with pytest.raises(ValueError, match="line 2"):
        parse_hostfile("a slots=1\nb slots=x\n")


def test_parse_hostfile_duplicate_zero_and_empty():
    with pytest.raises(ValueError, match=r"line 3.*'a'.*more than once"):
        parse_hostfile("a slots=1\nb slots=1\na slots=2\n")
    with pytest.raises(ValueError, match="slots=0"):
        parse_hostfile("a slots=0\n")
    with pytest.raises(ValueError, match="no hosts"):
        parse_hostfile("# nothing\n\n")


def test_read_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb oops\n")
    with pytest.raises(ValueError, match=rf"{path}, line 2"):
        read_hostfile(path)
    with pytest.raises(ValueError, match="cannot read hostfile"):
        read_hostfile(tmp_path / "missing")


# ---------------------------------------------------------------------------
# include / exclude (DeepSpeed semantics, expected values written out by hand)

POOL = {"w0": 4, "w1": 4, "w2": 2}


def test_filter_without_filters_uses_everything():
    assert filter_hosts(POOL) == {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3], "w2": [0, 1]}


def test_include_builds_from_nothing_in_hostfile_order():
    got = filter_hosts(POOL, include="w2@w0:2,0")
    assert got == {"w0": [2, 0], "w2": [0, 1]}
    assert list(got) == ["w0", "w2"]
    assert filter_hosts(POOL, include="w1:1,1,3") == {"w1": [1, 3]}
    # a host named twice accumulates its slots (DeepSpeed would keep only the last mention)
    assert filter_hosts(POOL, include="w1:3@w1:0,3") == {"w1": [3, 0]}


def test_exclude_removes_hosts_and_slots():
    assert filter_hosts(POOL, exclude="w1:0,3@w2") == {"w0": [0, 1, 2, 3], "w1": [1, 2]}
    assert filter_hosts(POOL, exclude="w2:0@w2:1") == {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}


@pytest.mark.parametrize(
    "include, exclude, message",
    [
        ("w0", "w1", "mutually exclusive"),
        ("w9", "", "'w9' is not in the hostfile"),
        ("w9:0", "", "'w9' is not in the hostfile"),
        ("w2:2", "", "no slot 2"),
        ("", "w0:x", "not an integer"),
        ("w0@@w1", "", "empty host entry"),
        ("", "w0@w1@w2", "leaves no slots"),
    ],
)
def test_filter_errors(include, exclude, message):
    with pytest.raises(ValueError, match=message):
        filter_hosts(POOL, include=include, exclude=exclude)


def test_select_resources_nnodes_and_nproc():
    assert select_resources(POOL, nnodes="2") == {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}
    assert select_resources(POOL, nnodes="1:2", nproc=2) == {"w0": [0, 1], "w1": [0, 1]}
    assert select_resources(POOL, exclude="w0", nnodes="2") == {"w1": [0, 1, 2, 3], "w2": [0, 1]}
    with pytest.raises(ValueError, match="at least 4 hosts"):
        select_resources(POOL, nnodes="4")
    with pytest.raises(ValueError, match="only 2 slots"):
        select_resources(POOL, nproc=3)
    with pytest.raises(ValueError, match="cannot be combined"):
        select_resources(POOL, include="w0", nproc=1)


# ---------------------------------------------------------------------------
# torchrun argv, checked with torchrun's own parser


def _torchrun_parse(argv: list[str]):
    from torch.distributed.run import get_args_parser

    assert argv[1:3] == ["-m", "torch.distributed.run"]
    return get_args_parser().parse_args(argv[3:])


def test_parse_nnodes():
    assert parse_nnodes("3") == (3, 3)
    assert parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "4:2", "a", "1:2:3", ""):
        with pytest.raises(ValueError, match="--nnodes"):
            parse_nnodes(bad)


def test_torchrun_args_single_node_is_standalone():
    opts = LaunchOptions(script="train.py", script_args=("--config", "my cfg.json"))
    argv = torchrun_args(opts, nproc_per_node=2, python="/py")
    assert argv == [
        "/py", "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
        "--nproc_per_node=2", "--max_restarts=0", "train.py", "--config", "my cfg.json",
    ]
    ns = _torchrun_parse(argv)
    assert ns.standalone and ns.nnodes == "1" and ns.nproc_per_node == "2"
    assert ns.training_script == "train.py" and ns.training_script_args == ["--config", "my cfg.json"]


def test_torchrun_args_two_nodes_uses_c10d_at_master():
    opts = LaunchOptions(script="t.py", nnodes="2", master_addr="10.1.2.3",
                         master_port=1234, max_restarts=3, rdzv_id="job7")
    argv = torchrun_args(opts, nproc_per_node=8)
    ns = _torchrun_parse(argv)
    assert not ns.standalone
    assert (ns.nnodes, ns.rdzv_backend, ns.rdzv_endpoint) == ("2", "c10d", "10.1.2.3:1234")
    assert (ns.rdzv_id, ns.max_restarts, ns.nproc_per_node) == ("job7", 3, "8")
    assert not any(a.startswith("--node_rank") for a in argv)  # c10d would ignore it


def test_torchrun_args_node_rank_uses_the_static_rendezvous():
    """A node rank is honoured (static rendezvous: node R gets ranks R*nproc..) or refused."""
    opts = LaunchOptions(script="t.py", nnodes="2", node_rank=1, master_addr="10.1.2.3", master_port=1234,
                         max_restarts=2)  # fmt: skip
    argv = torchrun_args(opts, nproc_per_node=8)
    ns = _torchrun_parse(argv)
    assert (ns.nnodes, ns.rdzv_backend, ns.node_rank) == ("2", "static", 1)
    assert (ns.master_addr, ns.master_port, ns.max_restarts) == ("10.1.2.3", 1234, 2)
    assert not any(a.startswith(("--rdzv_endpoint", "--rdzv_conf", "--rdzv_id")) for a in argv)
    default_port = _torchrun_parse(torchrun_args(LaunchOptions(script="t.py", nnodes="3", node_rank=0,
                                                               master_addr="h"), 1))  # fmt: skip
    assert (default_port.rdzv_backend, default_port.master_port) == ("static", 29500)
    with pytest.raises(ValueError, match="elastic --nnodes 1:4"):
        LaunchOptions(script="t.py", nnodes="1:4", node_rank=0, master_addr="h")
    with pytest.raises(ValueError, match="needs --master_addr"):
        torchrun_args(LaunchOptions(script="t.py", nnodes="2", node_rank=1), 1)
    with pytest.raises(ValueError, match="--rdzv_conf configures the c10d rendezvous"):
        torchrun_args(LaunchOptions(script="t.py", nnodes="2", node_rank=1, master_addr="h",
                                    rdzv_conf="join_timeout=60"), 1)  # fmt: skip
    ns = build_parser().parse_args(["run", "--nnodes", "2", "--node_rank", "1", "--master_addr", "h", "t.py"])
    assert (ns.nnodes, ns.node_rank) == ("2", 1)
    run_help = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "torchrun's static rendezvous" in " ".join(run_help.split())


def test_torchrun_args_elastic_range_and_defaults():
    opts = LaunchOptions(script="t.py", nnodes="1:4", master_addr="head", elastic="restart")
    ns = _torchrun_parse(torchrun_args(opts, nproc_per_node=1))
    assert (ns.nnodes, ns.rdzv_endpoint) == ("1:4", "head:29500")
    # a port alone on one node: c10d on loopback rather than standalone
    ns = _torchrun_parse(torchrun_args(LaunchOptions(script="t.py", master_port=4321), 1))
    assert (ns.nnodes, ns.rdzv_backend, ns.rdzv_endpoint) == ("1", "c10d", "127.0.0.1:4321")
    ns = _torchrun_parse(torchrun_args(LaunchOptions(script="t.py", nnodes="2", master_addr="::1"), 1))
    assert ns.rdzv_endpoint == "[::1]:29500"
    ns = _torchrun_parse(torchrun_args(LaunchOptions(script="pkg.train", module=True), 1))
    assert ns.module and ns.training_script == "pkg.train"


def test_launch_options_errors():
    with pytest.raises(ValueError, match="--master_addr"):
        torchrun_args(LaunchOptions(script="t.py", nnodes="2"), nproc_per_node=1)
    with pytest.raises(ValueError, match="--node_rank 2"):
        LaunchOptions(script="t.py", nnodes="2", node_rank=2)
    with pytest.raises(ValueError, match="--nproc 0"):
        LaunchOptions(script="t.py", nproc=0)
    with pytest.raises(ValueError, match="--master_port"):
        LaunchOptions(script="t.py", master_port=70000)
    with pytest.raises(ValueError, match="--max_restarts"):
        LaunchOptions(script="t.py", max_restarts=-1)


def test_core_lists_and_each_ranks_share(tmp_path):
    from terascale.launcher.cores import parse_core_list, rank_cores, usable_cores

    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]  # DeepSpeed's example
    assert parse_core_list("0-3") == [0, 1, 2, 3] and parse_core_list("6") == [6]
    for bad, message in (("3-1", "from a lower to a higher"), ("0-3,2", "ascending"), ("a", "not a core number"),
                         ("1,,2", "not a core number"), ("-1", "not a core number")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_core_list(bad)
    # Equal runs in order; the remainder stays unused (DeepSpeed's split).
    cores = list(range(10))
    assert [rank_cores(cores, 3, r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match=r"2 core\(s\) \(0-1\) cannot give each of the 3 processes"):
        rank_cores([0, 1], 3, 0)
    # One CPU per physical core: hyperthread siblings (same package and core id) count once.
    sysfs = tmp_path / "cpu"
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (0, 1), (1, 0), (1, 1)]):
        topology = sysfs / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert usable_cores(range(8), sysfs) == [0, 1, 2, 3]
    assert usable_cores([1, 5, 6], sysfs) == [1, 6]
    assert usable_cores([0, 9], sysfs) == [0, 9]  # cpu9's topology is unknown: every CPU counts


def test_the_rank_shim_passes_local_rank_and_binds_cores_like_deepspeed():
    """`terascale run` runs the script through terascale.launcher.worker when it passes
    --local_rank or binds cores; torchrun's own parser reads the command as intended."""
    ns = build_parser().parse_args(["run", "--nproc", "2", "--bind_core_list", "0-3", "t.py", "--no_local_rank"])
    assert (ns.no_local_rank, ns.bind_cores_to_rank, ns.bind_core_list) == (False, False, "0-3")
    assert ns.script_args == ["--no_local_rank"]  # the script's, after the script
    opts = LaunchOptions(script="t.py", script_args=("--x", "1"), local_rank_arg=True, bind_core_list="0-3")
    ns = _torchrun_parse(torchrun_args(opts, nproc_per_node=2))
    assert ns.module and ns.training_script == "terascale.launcher.worker"
    assert ns.training_script_args == ["--local_rank_arg", "--bind_cores_to_rank", "--bind_core_list=0-3", "t.py",
                                       "--x", "1"]  # fmt: skip
    ns = _torchrun_parse(torchrun_args(LaunchOptions(script="pkg.train", module=True, local_rank_arg=True), 1))
    assert ns.training_script_args == ["--local_rank_arg", "--module", "pkg.train"]
    plain = torchrun_args(LaunchOptions(script="t.py"), 1)  # neither: torchrun runs the script itself
    assert _torchrun_parse(plain).training_script == "t.py"
    with pytest.raises(ValueError, match="--bind_core_list '2-1'"):
        LaunchOptions(script="t.py", bind_core_list="2-1")


# ---------------------------------------------------------------------------
# environment files and ssh commands


def test_env_files_merge_and_errors(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\nB=cwd-ds\nC='quoted value'\n")
    (cwd / ".terascale_env").write_text("\nC=cwd ts = with equals\n")
    assert load_env_files([home, cwd]) == {"A": "home", "B": "cwd-ds", "C": "cwd ts = with equals"}
    assert load_env_files([tmp_path / "nowhere"]) == {}
    with pytest.raises(ValueError, match="line 2"):
        parse_env_file("A=1\nNOEQUALS\n")
    with pytest.raises(ValueError, match="line 1"):
        parse_env_file("1BAD=x\n")


def test_remote_exports_selects_pythonpath_and_nccl():
    environ = {"PYTHONPATH": "/x", "NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5", "HOME": "/h", "XNCCL_": "no"}
    got = remote_exports(environ, {"NCCL_DEBUG": "WARN", "MY_VAR": "1"})
    assert got == {"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5", "PYTHONPATH": "/x", "MY_VAR": "1"}


def _split_remote(remote: str) -> tuple[str, dict[str, str], list[str]]:
    """Take `cd DIR && export K=V ... && exec ARGV` apart the way a shell would."""
    tokens = shlex.split(remote)
    assert tokens[0] == "cd" and tokens[2] == "&&"
    cwd, rest = tokens[1], tokens[3:]
    exports: dict[str, str] = {}
    if rest[0] == "export":
        end = rest.index("&&")
        exports = dict(t.split("=", 1) for t in rest[1:end])
        rest = rest[end + 1:]
    assert rest[0] == "exec"
    return cwd, exports, rest[1:]


def test_ssh_commands_per_host(tmp_path):
    (tmp_path / ".terascale_env").write_text("MY_VAR=has space's\n")
    exports = remote_exports({"PYTHONPATH": "/repo", "NCCL_DEBUG": "INFO", "OTHER": "x"},
                             load_env_files([tmp_path]))
    pool = {"n0": 4, "n1": 4, "n2": 4}
    hosts = select_resources(pool, exclude="n1@n2:1,3")
    opts = LaunchOptions(script="/work dir/train.py", script_args=("--name", "a b", "it's"))
    cmds = ssh_commands(opts, hosts, slots_per_host=pool, exports=exports, cwd="/work dir",
                        rdzv_id="abc", python="/venv/bin/python")
    assert len(cmds) == 2
    for cmd, host in zip(cmds, ["n0", "n2"]):
        assert cmd[0] == "ssh" and cmd[-2] == host and "BatchMode=yes" in cmd
        cwd, env, argv = _split_remote(cmd[-1])
        assert cwd == "/work dir"
        assert env["PYTHONPATH"] == "/repo" and env["NCCL_DEBUG"] == "INFO"
        assert env["MY_VAR"] == "has space's" and "OTHER" not in env
        assert argv[0] == "/venv/bin/python"
        ns = _torchrun_parse(argv)
        # c10d assigns node ranks itself; torchrun would only warn about --node_rank
        assert (ns.nnodes, ns.rdzv_backend) == ("2", "c10d") and "--node_rank" not in " ".join(argv)
        assert (ns.rdzv_endpoint, ns.rdzv_id) == ("n0:29500", "abc")
        assert ns.training_script == "/work dir/train.py"
        assert ns.training_script_args == ["--name", "a b", "it's"]
    # n0 uses all its slots; n2 only 0 and 2, so only n2 pins its devices
    assert "CUDA_VISIBLE_DEVICES" not in _split_remote(cmds[0][-1])[1]
    assert _split_remote(cmds[1][-1])[1]["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert _torchrun_parse(_split_remote(cmds[0][-1])[2]).nproc_per_node == "4"
    assert _torchrun_parse(_split_remote(cmds[1][-1])[2]).nproc_per_node == "2"


def test_ssh_commands_master_override_and_elastic():
    pool = {"a": 1, "b": 1, "c": 1}
    opts = LaunchOptions(script="t.py", nnodes="2:5", master_addr="10.0.0.1", master_port=5000, elastic="restart")
    cmds = ssh_commands(opts, select_resources(pool, nnodes="2:5"), slots_per_host=pool, exports={},
                        cwd="/w", rdzv_id="r")
    assert [c[-2] for c in cmds] == ["a", "b", "c"]
    for cmd in cmds:
        cwd, env, argv = _split_remote(cmd[-1])
        assert env == {}
        ns = _torchrun_parse(argv)
        assert (ns.nnodes, ns.rdzv_endpoint) == ("2:3", "10.0.0.1:5000")
    # The default for a range: every host runs a live elastic agent over the same store.
    live = dataclasses.replace(opts, elastic="live")
    for cmd in ssh_commands(live, select_resources(pool, nnodes="2:5"), slots_per_host=pool, exports={},
                            cwd="/w", rdzv_id="r"):
        argv = _split_remote(cmd[-1])[2]
        assert argv[1:3] == ["-m", "terascale.elastic.agent"], argv
        assert {"--endpoint=10.0.0.1:5000", "--nnodes=2:3", "--run-id=r"} <= set(argv)
        assert argv[argv.index("--") + 1 :][-1] == "t.py"


def test_live_agent_args_carry_the_timings_and_refuse_torchrun_settings():
    opts = LaunchOptions(script="t.py", script_args=("--x",), nnodes="1:4", master_addr="h", elastic_timeout=5,
                         elastic_expiry=2)  # fmt: skip
    argv = torchrun_args(opts, 2)
    assert "--timeout=5" in argv and "--expiry=2" in argv and "--nproc=2" in argv
    assert argv[argv.index("--") + 1 :][-2:] == ["t.py", "--x"]
    with pytest.raises(ValueError, match="--rdzv_conf configures torchrun"):
        torchrun_args(dataclasses.replace(opts, rdzv_conf="last_call_timeout=4"), 1)
    with pytest.raises(ValueError, match="--elastic 'sometimes'"):
        LaunchOptions(script="t.py", elastic="sometimes")


# ---------------------------------------------------------------------------
# --launcher pdsh / mpi / slurm: one command for every host (tools not needed)


def test_pdsh_command_starts_one_torchrun_agent_on_every_host():
    pool = {"n0": 2, "n1": 2}
    opts = LaunchOptions(script="/work dir/train.py", script_args=("--name", "a b"), local_rank_arg=True)
    argv, env = launcher_command("pdsh", opts, select_resources(pool), slots_per_host=pool,
                                 exports={"PYTHONPATH": "/repo"}, cwd="/work dir", rdzv_id="r1",
                                 launcher_args="-u 60", python="/py")  # fmt: skip
    assert argv[:-1] == ["pdsh", "-S", "-f", "2", "-w", "n0,n1", "-u", "60"]
    assert env == {"PDSH_RCMD_TYPE": "ssh"}
    cwd, exports, agent = _split_remote(argv[-1])
    assert (cwd, exports) == ("/work dir", {"PYTHONPATH": "/repo"})
    ns = _torchrun_parse(agent)
    assert (ns.nnodes, ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id) == ("2", "c10d", "n0:29500", "r1")
    assert ns.nproc_per_node == "2" and "--node_rank" not in " ".join(agent)  # c10d ranks the agents
    assert ns.training_script == "terascale.launcher.worker"
    assert ns.training_script_args == ["--local_rank_arg", "/work dir/train.py", "--name", "a b"]
    # One command: one slot count, one device list for every host.
    with pytest.raises(ValueError, match="same number of processes on every host"):
        launcher_command("pdsh", opts, {"n0": [0, 1], "n1": [0]}, slots_per_host={"n0": 2, "n1": 1}, exports={},
                         cwd="/w", rdzv_id="r")  # fmt: skip
    argv, _ = launcher_command("pdsh", opts, {"n0": [1], "n1": [1]}, slots_per_host=pool, exports={}, cwd="/w",
                               rdzv_id="r")  # fmt: skip
    assert _split_remote(argv[-1])[1] == {"CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(ValueError, match="every host must use the same slots"):
        launcher_command("pdsh", opts, {"n0": [0], "n1": [1]}, slots_per_host=pool, exports={}, cwd="/w",
                         rdzv_id="r")  # fmt: skip


def test_mpirun_command_runs_the_script_in_every_rank():
    pool = {"a": 2, "b": 1}
    opts = LaunchOptions(script="t.py", script_args=("--x", "1"), master_port=6000)
    argv, env = launcher_command("mpi", opts, select_resources(pool), slots_per_host=pool,
                                 exports={"PYTHONPATH": "/repo", "NCCL_DEBUG": "has space"}, cwd="/w", rdzv_id="r",
                                 launcher_args="--mca btl tcp,self", python="/py")  # fmt: skip
    assert env == {}
    assert argv == ["mpirun", "-np", "3", "-H", "a:2,b:1", "--map-by", "slot", "--bind-to", "none", "-wdir", "/w",
                    "--mca", "btl", "tcp,self", "-x", "PYTHONPATH=/repo", "-x", "NCCL_DEBUG=has space",
                    "-x", "MASTER_ADDR=a", "-x", "MASTER_PORT=6000", "/py", "-u", "t.py", "--x", "1"]  # fmt: skip
    # --local_rank and core binding through the rank shim; the user's own binding is kept.
    shim = LaunchOptions(script="pkg.train", module=True, local_rank_arg=True, bind_cores=True, master_addr="head")
    argv, _ = launcher_command("mpi", shim, {"a": [0, 1]}, slots_per_host=pool, exports={}, cwd="/w", rdzv_id="r",
                               launcher_args="--bind-to core", python="/py")  # fmt: skip
    assert "none" not in argv and argv[argv.index("-x") :] == [
        "-x", "MASTER_ADDR=head", "-x", "MASTER_PORT=29500", "/py", "-u", "-m", "terascale.launcher.worker",
        "--local_rank_arg", "--bind_cores_to_rank", "--module", "pkg.train"]  # fmt: skip
    # Without torchrun's agent: a fixed world, no restarts.
    for bad, message in ((dict(max_restarts=1), "--max_restarts needs torchrun's agent"),
                         (dict(nnodes="1:2"), "fixed world"),
                         (dict(rdzv_conf="join_timeout=900"), "--rdzv_conf configures torchrun's")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            launcher_command("mpi", LaunchOptions(script="t.py", **bad), {"a": [0, 1]}, slots_per_host=pool,
                             exports={}, cwd="/w", rdzv_id="r")  # fmt: skip


def test_srun_command_and_its_environment():
    pool = {"n1": 4, "n2": 4}
    opts = LaunchOptions(script="t.py", local_rank_arg=True)
    hosts = select_resources(pool, include="n1:0,1@n2:0,1")
    argv, env = launcher_command("slurm", opts, hosts, slots_per_host=pool, exports={"PYTHONPATH": "/repo"},
                                 cwd="/w", rdzv_id="r", launcher_args="--exclusive", python="/py")  # fmt: skip
    assert argv == ["srun", "--ntasks", "4", "--ntasks-per-node", "2", "--nodes", "2", "--nodelist", "n1,n2",
                    "--exclusive", "/py", "-u", "-m", "terascale.launcher.worker", "--local_rank_arg",
                    "t.py"]  # fmt: skip
    # srun passes its environment on; no master unless given (the ranks read SLURM's node list).
    assert env == {"PYTHONPATH": "/repo", "CUDA_VISIBLE_DEVICES": "0,1"}
    given = LaunchOptions(script="t.py", master_addr="n2", master_port=7000)
    _, env = launcher_command("slurm", given, {"n1": [0, 1, 2, 3]}, slots_per_host=pool, exports={}, cwd="/w",
                              rdzv_id="r")  # fmt: skip
    assert env == {"MASTER_ADDR": "n2", "MASTER_PORT": "7000"}
    with pytest.raises(ValueError, match="same number of processes"):
        launcher_command("slurm", opts, {"n1": [0, 1], "n2": [0]}, slots_per_host={"n1": 2, "n2": 1}, exports={},
                         cwd="/w", rdzv_id="r")  # fmt: skip


def test_cli_launcher_choices_and_errors(tmp_path, monkeypatch, capsys):
    ns = build_parser().parse_args(["run", "--hostfile", "h", "--launcher", "slurm", "--launcher_args", "-p gpu",
                                    "t.py"])  # fmt: skip
    assert (ns.launcher, ns.launcher_args) == ("slurm", "-p gpu")
    assert build_parser().parse_args(["run", "t.py"]).launcher == "torchrun"
    assert main(["run", "--launcher", "mpi", "t.py"]) == 2
    assert "starts the hosts of a --hostfile" in capsys.readouterr().err
    assert main(["run", "--launcher_args=-x", "t.py"]) == 2
    assert "--launcher_args go to --launcher pdsh, mpi or slurm" in capsys.readouterr().err
    (tmp_path / "hosts").write_text("n1 slots=1\nn2 slots=1\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no pdsh here
    for launcher, tool in (("slurm", "srun"), ("pdsh", "pdsh")):
        assert main(["run", "--hostfile", str(tmp_path / "hosts"), "--launcher", launcher, "t.py"]) == 2
        assert f"{tool} was not found on PATH" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# CLI parsing and env report (in-process)


def test_cli_parses_deepspeed_spellings():
    ns = build_parser().parse_args(
        ["run", "--num_gpus", "2", "--num_nodes", "1:2", "--master_addr", "h", "train.py", "--nproc", "9"])
    assert (ns.nproc, ns.nnodes, ns.master_addr, ns.script) == (2, "1:2", "h", "train.py")
    assert ns.script_args == ["--nproc", "9"]  # everything after the script belongs to it


def test_cli_usage_errors(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert main(["run", "--include", "a", "train.py"]) == 2
    assert "--hostfile" in capsys.readouterr().err
    assert main(["run", "--nnodes", "2", "train.py"]) == 2
    assert "--master_addr" in capsys.readouterr().err


def test_env_report_table(tmp_path):
    rows = dict(collect_env())
    import torch

    assert rows["torch"] == torch.__version__
    assert rows["CUDA available"] in ("yes", "no")
    assert "gloo=yes" in rows["distributed backends"]
    assert rows["O_DIRECT in cwd"] == "yes" or rows["O_DIRECT in cwd"].startswith("no")
    assert format_table([("a", "1"), ("long name", "2")]) == "a          1\nlong name  2"
    assert odirect_status(tmp_path / "missing-dir").startswith("no")
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


# ---------------------------------------------------------------------------
# real runs: `python -m terascale ...` with torchrun underneath


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TS_TEST_MARKER", None)
    env.update(extra)
    return env


def _start(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    # A session of its own so a timeout can kill the launcher with all its children.
    return subprocess.Popen([sys.executable, "-m", "terascale", *args], cwd=cwd, env=env or _env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, deadline: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"launcher timed out; output:\n{out}")
    return proc.returncode, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(out_dir: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out_dir.glob("rank*.json")), key=lambda r: r["rank"])


def test_real_run_single_node_two_procs(tmp_path):
    proc = _start(["run", "--nproc", "2", str(SCRIPTS / "allreduce_worker.py"), str(tmp_path), "x y"])
    rc, out = _finish(proc, time.monotonic() + TIMEOUT_S)
    assert rc == 0, out
    recs = _records(tmp_path)
    assert [r["rank"] for r in recs] == [0, 1]
    assert all(r["world_size"] == 2 and r["result"] == 3.0 for r in recs)
    assert sorted(r["local_rank"] for r in recs) == [0, 1]
    assert all(r["argv"] == ["x y"] for r in recs)
    # As DeepSpeed's launcher: --local_rank=N first among the script's arguments.
    assert all(r["local_rank_arg"] == f"--local_rank={r['local_rank']}" for r in recs)


def _cores_available(n: int) -> bool:
    from terascale.launcher.cores import usable_cores

    return len(usable_cores()) >= n


@pytest.mark.skipif(not _cores_available(2), reason="needs two physical cores")
def test_real_run_binds_each_rank_to_its_cores(tmp_path):
    from terascale.launcher.cores import usable_cores

    every = usable_cores()
    half = len(every) // 2
    listed = every[:2]
    cases = [  # (flag, the cores of local ranks 0 and 1)
        ("--bind_cores_to_rank", [every[:half], every[half : 2 * half]]),  # every physical core, halved
        (f"--bind_core_list={listed[0]},{listed[1]}", [listed[:1], listed[1:]]),
    ]
    for i, (flag, expected) in enumerate(cases):
        out = tmp_path / str(i)
        out.mkdir()
        # OMP_NUM_THREADS=1 in the caller's environment: binding sets it to the share's size.
        proc = _start(["run", "--nproc", "2", flag, "--no_local_rank", str(SCRIPTS / "allreduce_worker.py"), str(out)])
        rc, text = _finish(proc, time.monotonic() + TIMEOUT_S)
        assert rc == 0, text
        recs = _records(out)
        assert [r["cpus"] for r in sorted(recs, key=lambda r: r["local_rank"])] == expected, (flag, recs)
        share = str(len(expected[0]))
        assert all(r["omp_num_threads"] == share and str(r["torch_threads"]) == share for r in recs), (flag, recs)
        assert all(r["local_rank_arg"] is None and r["result"] == 3.0 for r in recs), (flag, recs)


def test_run_refuses_core_binding_that_cannot_work(tmp_path):
    """Checked before any rank starts: usage errors, exit code 2."""
    from terascale.launcher.cores import usable_cores

    core = usable_cores()[0]
    one = _start(["run", "--nproc", "2", "--bind_core_list", str(core), str(SCRIPTS / "record_env.py"), str(tmp_path)])
    rc, out = _finish(one, time.monotonic() + TIMEOUT_S)
    assert rc == 2 and f"1 core(s) ({core}) cannot give each of the 2 processes" in out, out
    bad = _start(["run", "--nproc", "1", "--bind_core_list", "1-0", str(SCRIPTS / "record_env.py"), str(tmp_path)])
    rc, out = _finish(bad, time.monotonic() + TIMEOUT_S)
    assert rc == 2 and "'1-0' is not a range from a lower to a higher core" in out, out
    assert list(tmp_path.iterdir()) == []


def test_real_run_of_a_deepspeed_style_script(tmp_path):
    """A script parsing --local_rank next to deepspeed.add_config_arguments (``import
    terascale as deepspeed``), launched as DeepSpeed's examples are."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                  "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}))  # fmt: skip
    proc = _start(["run", "--nproc", "2", str(SCRIPTS / "deepspeed_style.py"), "--out", str(tmp_path), "--deepspeed",
                   "--deepspeed_config", str(config)])  # fmt: skip
    rc, out = _finish(proc, time.monotonic() + TIMEOUT_S)
    assert rc == 0, out
    recs = _records(tmp_path)
    assert [r["rank"] for r in recs] == [0, 1]
    for r in recs:
        assert r["local_rank"] == r["env_local_rank"] == r["rank"]
        assert r["deepspeed"] is True and r["deepspeed_config"] == str(config)
        assert r["losses"][1] < r["losses"][0]


def test_real_run_two_nodes_on_localhost(tmp_path):
    port = str(_free_port())
    common = ["run", "--nnodes", "2", "--nproc", "1", "--master_addr", "127.0.0.1", "--master_port", port]
    script = [str(SCRIPTS / "allreduce_worker.py"), str(tmp_path)]
    procs = [_start([*common, "--node_rank", str(r), *script]) for r in (0, 1)]
    deadline = time.monotonic() + TIMEOUT_S
    results = [_finish(p, deadline) for p in procs]
    for rc, out in results:
        assert rc == 0, out
    recs = _records(tmp_path)
    assert [r["rank"] for r in recs] == [0, 1]
    assert all(r["world_size"] == 2 and r["local_rank"] == 0 and r["result"] == 3.0 for r in recs)


def test_real_run_node_rank_is_honoured_when_node_1_starts_first(tmp_path):
    """--nnodes 2 --node_rank R: the static rendezvous gives node 1 global rank 1 even when it
    arrives first (under c10d the first to arrive would be rank 0)."""
    port = str(_free_port())
    common = ["run", "--nnodes", "2", "--nproc", "1", "--master_addr", "127.0.0.1", "--master_port", port]
    script = [str(SCRIPTS / "record_env.py"), str(tmp_path)]
    first = _start([*common, "--node_rank", "1", *script], env=_env(TS_TEST_MARKER="node 1"))
    time.sleep(3.0)  # node 1's agent is up and waiting before node 0 starts
    second = _start([*common, "--node_rank", "0", *script], env=_env(TS_TEST_MARKER="node 0"))
    deadline = time.monotonic() + TIMEOUT_S
    for proc in (first, second):
        rc, out = _finish(proc, deadline)
        assert rc == 0, out
    recs = _records(tmp_path)
    assert [(r["rank"], r["world_size"], r["marker"]) for r in recs] == [(0, 2, "node 0"), (1, 2, "node 1")]


def _fake_ssh_env(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # A wrapper rather than a link, so the test does not depend on the script's mode bits.
    ssh = bindir / "ssh"
    ssh.write_text(f"#!/bin/sh\nexec /bin/bash {shlex.quote(str(SCRIPTS / 'fake_ssh.sh'))} \"$@\"\n")
    ssh.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    return _env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", HOME=str(home))


def test_real_run_hostfile_over_fake_ssh(tmp_path):
    """Two 'hosts' reached through a stand-in ssh that runs the remote command locally."""
    env = _fake_ssh_env(tmp_path)
    work, out_dir = tmp_path / "work dir", tmp_path / "out"
    work.mkdir()
    out_dir.mkdir()
    (work / "hosts").write_text("nodeA slots=2\nnodeB slots=1\n")
    (work / ".terascale_env").write_text("TS_TEST_MARKER=from env file\n")
    env.pop("TERASCALE_AS_DEEPSPEED", None)  # reaches the 'hosts' only by the export --as-deepspeed adds
    proc = _start(["run", "--hostfile", "hosts", "--include", "nodeA:1@nodeB", "--as-deepspeed",
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                   str(SCRIPTS / "record_env.py"), str(out_dir), "it's a b"], cwd=work, env=env)
    rc, out = _finish(proc, time.monotonic() + TIMEOUT_S)
    assert rc == 0, out
    recs = _records(out_dir)
    assert [r["rank"] for r in recs] == [0, 1] and all(r["world_size"] == 2 for r in recs)
    assert all(r["marker"] == "from env file" and r["argv"] == ["it's a b"] for r in recs)
    assert all(r["as_deepspeed"] == "1" for r in recs)  # exported to every host
    assert all(r["local_rank_arg"] == f"--local_rank={r['local_rank']}" for r in recs)  # remote hosts too
    by_host = {r["fake_host"]: r for r in recs}
    assert by_host["nodeA"]["cuda_visible_devices"] == "1"  # a subset of nodeA's two slots
    assert by_host["nodeB"]["cuda_visible_devices"] is None
    # streamed output carries the host prefix
    assert "nodeA: rank" in out and "nodeB: rank" in out, out


def test_real_env_command(capsys):
    import torch

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out and "O_DIRECT" in out and "memory" in out


# ---------------------------------------------------------------------------
# process supervision with plain commands (no torch, so fast)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_run_remote_prefixes_output_and_succeeds():
    out = io.StringIO()
    rc = run_remote([("h1", _py("print('hello'); print('again')")), ("h2", _py("print('world')"))], out=out)
    assert rc == 0
    assert sorted(out.getvalue().splitlines()) == ["h1: again", "h1: hello", "h2: world"]


def test_run_remote_failure_terminates_the_others(tmp_path, capsys):
    flag = tmp_path / "slow-is-up"
    slow = f"import pathlib, time; print('up', flush=True); pathlib.Path({str(flag)!r}).touch(); time.sleep(600)"
    # "bad" fails only once "slow" runs (however long that takes), so the test sees a
    # live process being stopped.
    bad = f"import os, sys, time\nwhile not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\nsys.exit(3)"
    out = io.StringIO()
    start = time.monotonic()
    rc = run_remote([("slow", _py(slow)), ("bad", _py(bad))], out=out, grace_s=5.0)
    assert rc == 3
    assert time.monotonic() - start < 300  # "slow" was stopped, not waited for its 600 s
    assert "bad exited with code 3" in capsys.readouterr().err
    assert "slow: up" in out.getvalue()


def test_run_local_exit_codes():
    assert run_local(_py("raise SystemExit(5)")) == 5
    assert run_local(_py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")) == 128 + 9


# ---------------------------------------------------------------------------
# DeepSpeed's launcher command line ([Note: DeepSpeed's launcher flags]); command construction
# only, but for one real run and the shim's own test


def _run_fields(argv: list[str]) -> dict:
    from terascale.launcher.deepspeed_cli import launch_fields

    return launch_fields(build_parser().parse_args(["run", *argv]))


def test_deepspeeds_flags_become_launch_options(tmp_path, capsys):
    assert _run_fields(["--elastic_training", "--min_elastic_nodes", "2", "--max_elastic_nodes", "4", "t.py"])[
        "nnodes"] == "2:4"  # fmt: skip
    assert _run_fields(["--elastic_training", "--num_nodes", "3", "t.py"])["nnodes"] == "1:3"  # DeepSpeed's defaults
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=1\nb slots=1\n")
    assert _run_fields(["--elastic_training", "-H", str(hosts), "t.py"])["nnodes"] == "1:2"
    # Without --elastic_training DeepSpeed ignores the range; so does terascale, and says so.
    assert _run_fields(["--min_elastic_nodes", "2", "t.py"])["nnodes"] is None
    assert "take effect with --elastic_training only" in capsys.readouterr().err
    assert _run_fields(["-q", "--min_elastic_nodes", "2", "t.py"])["log_level"] == "error"
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="give it once"):
        _run_fields(["--elastic_training", "--num_nodes", "1:3", "--max_elastic_nodes", "3", "t.py"])
    # DeepSpeed's "unset" spellings.
    fields = _run_fields(["--num_gpus", "-1", "--num_nodes", "-1", "--node_rank", "-1", "--enable_each_rank_log",
                          "None", "t.py"])  # fmt: skip
    assert (fields["nproc"], fields["nnodes"], fields["node_rank"], fields["rank_log"]) == (None, None, None, None)
    fields = _run_fields(["--enable_each_rank_log", "logs", "--save_pid", "--log_level", "DEBUG", "--no_python",
                          "--ssh_port", "2222", "--venv_script", "/v/bin/activate", "--force_multi",
                          "t.sh"])  # fmt: skip
    folder, stamp = os.path.split(fields["rank_log"])
    assert folder == os.path.abspath("logs") and len(stamp) == 14 and stamp.isdigit()  # <timestamp>_rank<N>.log
    assert (fields["save_pid"], fields["log_level"], fields["ssh_port"]) == (os.getpid(), "debug", 2222)
    assert fields["no_python"] and fields["force_multi"] and fields["venv_script"] == "/v/bin/activate"
    LaunchOptions(script="t.sh", **fields)
    ns = build_parser().parse_args(["run", "--as-deepspeed", "--no_ssh_check", "--num_gpus", "2", "train.py",
                                    "--deepspeed", "ds.json"])  # fmt: skip
    assert ns.as_deepspeed and ns.nproc == 2 and ns.script_args == ["--deepspeed", "ds.json"]


def test_deepspeeds_launcher_names_and_refusals(capsys):
    assert build_parser().parse_args(["run", "-H", "h", "--launcher", "OpenMPI", "t.py"]).launcher == "mpi"
    assert build_parser().parse_args(["run", "-H", "h", "--launcher", "PDSH", "t.py"]).launcher == "pdsh"
    for name, says in (("mpich", "PMI_RANK"), ("impi", "PMI_RANK"), ("MVAPICH", "MV2_COMM_WORLD_RANK"),
                       ("jsrun", "jsrun is not built")):  # fmt: skip
        assert main(["run", "--launcher", name, "t.py"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"argument --launcher: {name}:" in err and says in err, err
    assert main(["run", "--autotuning", "tune", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "--autotuning tune: DeepSpeed's autotuner is not built" in err and "terascale plan" in err
    assert main(["run", "--module", "--no_python", "pkg"]) == 2
    assert "--module and --no_python" in capsys.readouterr().err


def test_no_python_and_rank_logs_in_the_commands():
    from terascale.launcher.backends import rank_program

    ns = _torchrun_parse(torchrun_args(LaunchOptions(script="t.sh", script_args=("a",), no_python=True), 1))
    assert ns.no_python and (ns.training_script, ns.training_script_args) == ("t.sh", ["a"])
    opts = LaunchOptions(script="t.sh", no_python=True, local_rank_arg=True, rank_log="/logs/20260101000000")
    ns = _torchrun_parse(torchrun_args(opts, 1))
    assert not ns.no_python and ns.training_script == "terascale.launcher.worker"
    assert ns.training_script_args == ["--local_rank_arg", "--no_python", "--rank_log=/logs/20260101000000", "t.sh"]
    # A rank log alone runs the shim too; mpirun and srun run the executable itself.
    assert rank_program(LaunchOptions(script="t.sh", rank_log="/l/x"), "/py")[3:] == [
        "terascale.launcher.worker", "--rank_log=/l/x", "t.sh"]  # fmt: skip
    assert rank_program(LaunchOptions(script="t.sh", script_args=("a",), no_python=True), "/py") == ["t.sh", "a"]


def test_the_rank_shim_runs_an_executable_and_writes_its_rank_log(tmp_path):
    script = tmp_path / "show.sh"
    script.write_text('#!/bin/sh\necho "args: $*"\necho "to stderr" >&2\n')
    script.chmod(0o755)
    prefix = tmp_path / "logs" / "20260101000000"
    env = {**_env(), "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-m", "terascale.launcher.worker", "--local_rank_arg", "--no_python",
                           f"--rank_log={prefix}", str(script), "x y"], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "", done.stderr
    assert (tmp_path / "logs" / "20260101000000_rank3.log").read_text() == "args: --local_rank=1 x y\nto stderr\n"


def test_deepspeeds_ssh_flags_in_the_ssh_pdsh_and_mpirun_commands():
    pool = {"n0": 1, "n1": 1}
    opts = LaunchOptions(script="t.py", ssh_port=2222, venv_script="/v/bin/activate", save_pid=123)
    cmds = ssh_commands(opts, select_resources(pool), slots_per_host=pool, exports={}, cwd="/w", rdzv_id="r")
    for cmd, host in zip(cmds, pool):
        assert cmd[-4:-1] == ["-p", "2222", host]
        # Sourced first, as DeepSpeed's pdsh runner does; $$ is the pid the agent keeps after exec.
        assert cmd[-1].startswith(". /v/bin/activate && echo $$ > /tmp/123.deepspeed && cd /w && exec ")
    argv, env = launcher_command("pdsh", opts, select_resources(pool), slots_per_host=pool, exports={}, cwd="/w",
                                 rdzv_id="r")  # fmt: skip
    assert env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}
    assert argv[-1].startswith(". /v/bin/activate && echo $$ > /tmp/123.deepspeed && cd /w")
    mpi = LaunchOptions(script="t.py", ssh_port=2222)
    argv, _ = launcher_command("mpi", mpi, select_resources(pool), slots_per_host=pool, exports={}, cwd="/w",
                               rdzv_id="r")  # fmt: skip
    assert argv[argv.index("plm_rsh_args") - 1 : argv.index("plm_rsh_args") + 2] == ["--mca", "plm_rsh_args", "-p 2222"]
    for launcher, bad, message in (("slurm", mpi, "srun starts the tasks through SLURM"),
                                   ("mpi", opts, "--venv_script is sourced by the remote shell")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            launcher_command(launcher, bad, select_resources(pool), slots_per_host=pool, exports={}, cwd="/w",
                             rdzv_id="r")  # fmt: skip


def test_remote_exports_carry_deepspeeds_prefixes_the_switch_and_ds_env_file(tmp_path):
    from terascale.launcher.environment import env_file_names

    environ = {"TERASCALE_AS_DEEPSPEED": "1", "PYTHONUNBUFFERED": "1", "MLFLOW_TRACKING_URI": "http://m",
               "UCX_TLS": "tcp", "MV2_DEBUG": "1", "NCCL_DEBUG": "INFO", "HOME": "/h", "TERASCALE_OTHER": "x"}
    assert remote_exports(environ, {}) == {k: v for k, v in environ.items() if k not in ("HOME", "TERASCALE_OTHER")}
    # DeepSpeed's DS_ENV_FILE names its env file; an absolute one is read once.
    (tmp_path / "my.env").write_text("A=1\n")
    (tmp_path / ".terascale_env").write_text("B=2\n")
    assert env_file_names({"DS_ENV_FILE": "my.env"}) == ("my.env", ".terascale_env")
    assert load_env_files([tmp_path], env_file_names({"DS_ENV_FILE": "my.env"})) == {"A": "1", "B": "2"}
    names = env_file_names({"DS_ENV_FILE": str(tmp_path / "my.env")})
    assert load_env_files([tmp_path / "nowhere", tmp_path], names) == {"A": "1", "B": "2"}


def test_no_ssh_starts_this_machine_as_its_node_of_the_hostfile():
    from terascale.launcher.runner import node_options

    pool = {"a": 2, "b": 2, "c": 2}
    here = node_options(LaunchOptions(script="t.py", no_ssh=True, node_rank=1), select_resources(pool))
    ns = _torchrun_parse(torchrun_args(here, 2))
    assert (ns.nnodes, ns.rdzv_backend, ns.node_rank, ns.master_addr, ns.master_port) == ("3", "static", 1, "a", 29500)
    # An elastic range: c10d gives the ranks; --node_rank only picked this host.
    here = node_options(LaunchOptions(script="t.py", no_ssh=True, node_rank=2, nnodes="2:3", master_addr="m",
                                      elastic="restart"),
                        select_resources(pool, nnodes="2:3"))  # fmt: skip
    ns = _torchrun_parse(torchrun_args(here, 2))
    assert (ns.nnodes, ns.rdzv_backend, ns.rdzv_endpoint) == ("2:3", "c10d", "m:29500")
    with pytest.raises(ValueError, match=r"--no_ssh starts this machine's ranks only.*--node_rank R in \[0, 3\)"):
        node_options(LaunchOptions(script="t.py", no_ssh=True), select_resources(pool))


@pytest.fixture
def started(monkeypatch) -> list[dict]:
    """What `terascale run` would start on this machine, instead of starting it (4 'devices')."""
    from terascale.launcher import runner

    calls: list[dict] = []
    monkeypatch.setattr(runner, "default_nproc", lambda: 4)
    monkeypatch.setattr(runner, "run_local", lambda argv, env, pid_file=None: calls.append(
        {"argv": argv, "env": env, "pid_file": pid_file}) or 0)  # fmt: skip
    return calls


def test_one_machine_as_deepspeed_takes_it_include_localhost(started, capsys, tmp_path):
    assert main(["run", "--as-deepspeed", "--include", "localhost:1,3", "--save_pid", "t.py", "--x"]) == 0
    (call,) = started
    ns = _torchrun_parse(call["argv"])
    assert ns.nproc_per_node == "2" and ns.training_script_args == ["--local_rank_arg", "t.py", "--x"]
    assert call["env"]["CUDA_VISIBLE_DEVICES"] == "1,3" and call["env"]["TERASCALE_AS_DEEPSPEED"] == "1"
    assert call["pid_file"] == f"/tmp/{os.getpid()}.deepspeed"
    for argv, message in ((["--num_gpus", "1", "-i", "localhost"], "--nproc cannot be combined with --include"),
                          (["--include", "worker-1"], "the one host is localhost with this machine's 4"),
                          (["--force_multi"], "--force_multi starts the hosts of a --hostfile")):  # fmt: skip
        assert main(["run", *argv, "t.py"]) == 2
        assert message in capsys.readouterr().err
    # --no_ssh with a hostfile: this machine's slots as host R, the rest started the same way by hand.
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=4\nb slots=4\n")
    assert main(["run", "-H", str(hosts), "--no_ssh", "--node_rank", "1", "--include", "a@b:2,3", "t.py"]) == 0
    ns = _torchrun_parse(started[-1]["argv"])
    assert (ns.nnodes, ns.node_rank, ns.nproc_per_node, ns.master_addr) == ("2", 1, "2", "a")
    assert started[-1]["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert main(["run", "-H", str(hosts), "--no_ssh", "--launcher", "mpi", "--node_rank", "0", "t.py"]) == 2
    assert "--no_ssh starts this machine's ranks only" in capsys.readouterr().err


def test_deepspeed_launcher_runner_names(tmp_path):
    """`deepspeed.launcher.runner` is this module: DeepSpeed's names of it, with DeepSpeed's behaviour."""
    import collections

    from terascale.launcher import runner as dsrun

    assert (dsrun.DEEPSPEED_ENVIRONMENT_NAME, dsrun.PDSH_MAX_FAN_OUT) == (".deepspeed_env", 1024)
    assert dsrun.DEEPSPEED_ENVIRONMENT_PATHS == [os.path.expanduser("~"), "."]
    assert {"NCCL", "PYTHON", "MLFLOW", "UCX", "MV2"} <= set(dsrun.EXPORT_ENVS)
    assert dsrun.fetch_hostfile(str(tmp_path / "missing")) is None
    (tmp_path / "hosts").write_text("w0 slots=4\nw1 slots=2\n")
    assert dsrun.fetch_hostfile(str(tmp_path / "hosts")) == collections.OrderedDict([("w0", 4), ("w1", 2)])
    assert dsrun._parse_hostfile(["", "w0 slots=2", "# c"]) == {"w0": 2}
    hosts = {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}
    assert dsrun.parse_resource_filter(hosts) is hosts
    assert dsrun.parse_resource_filter(hosts, include_str="w1:3,0@w1:0") == {"w1": [0, 3]}  # sorted, once each
    assert dsrun.parse_resource_filter(hosts, exclude_str="w0:0,1@w1:3") == {"w0": [2, 3], "w1": [0, 1, 2]}
    assert dsrun.parse_resource_filter({"w0": [0, 1]}, exclude_str="w0") == {}  # nothing left is no error here
    for include, exclude in (("A", "B"), ("jeff", ""), ("", "w1:4"), ("", "w1@w0:1@5")):
        with pytest.raises(ValueError):
            dsrun.parse_resource_filter(hosts, include_str=include, exclude_str=exclude)
    assert dsrun.parse_inclusion_exclusion({"w0": 2, "w1": 2}, "w1:1", "") == {"w1": [1]}
    ns = dsrun.parse_args(["--num_gpus", "2", "t.py", "--x"])
    assert (ns.user_script, ns.user_args, ns.nproc, ns.as_deepspeed) == ("t.py", ["--x"], 2, True)
    with pytest.raises(ValueError, match="--nproc cannot be combined with --include"):
        dsrun.main(["--num_gpus", "1", "-i", "localhost", "foo.py"])
    for flag in ("-i", "-e"):  # DeepSpeed refuses --num_nodes with a filter too (terascale's own run does not)
        with pytest.raises(ValueError, match="--num_nodes cannot be combined with --include"):
            dsrun.main(["--num_nodes", "1", flag, "localhost", "foo.py"])


def test_python_m_deepspeed_launcher_runner_is_deepspeeds_command_line():
    env = _env(TERASCALE_AS_DEEPSPEED="1")
    done = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--autotuning", "run", "t.py"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "--autotuning run: DeepSpeed's autotuner is not built" in done.stderr, done.stderr


_STAND_IN_RANK = """
import glob, json, os, sys
import deepspeed
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
rank = int(os.environ["RANK"])
# --save_pid: the file naming terascale run holds this node's torchrun agent, the rank's parent.
pid_files = [f for f in glob.glob("/tmp/*.deepspeed") if open(f).read() == str(os.getppid())]
record = {"rank": rank, "terascale": getattr(deepspeed, "__terascale__", False), "version": deepspeed.__version__,
          "env_file": DEEPSPEED_ENVIRONMENT_NAME, "argv": sys.argv[1:], "pid_files": pid_files}
out = sys.argv[-1]
with open(os.path.join(out, f".rank{rank}.tmp"), "w") as f:
    json.dump(record, f)
os.rename(os.path.join(out, f".rank{rank}.tmp"), os.path.join(out, f"rank{rank}.json"))
print(f"rank {rank} runs on {deepspeed.__version__}", flush=True)
"""


def test_real_run_as_deepspeed_each_rank_imports_terascale_as_deepspeed(tmp_path):
    """`deepspeed --num_gpus 2 train.py` as `terascale run --as-deepspeed --num_gpus 2 train.py`, with
    DeepSpeed's per-rank logs and pid file."""
    from terascale.integrations.deepspeed.standin import VERSION

    script, out, logs = tmp_path / "train.py", tmp_path / "out", tmp_path / "logs"
    script.write_text(_STAND_IN_RANK)
    out.mkdir()
    env = {k: v for k, v in _env().items() if k != "TERASCALE_AS_DEEPSPEED"}
    proc = _start(["run", "--as-deepspeed", "--num_gpus", "2", "--enable_each_rank_log", str(logs), "--save_pid",
                   str(script), "--deepspeed", str(out)], env=env)  # fmt: skip
    rc, text = _finish(proc, time.monotonic() + TIMEOUT_S)
    assert rc == 0, text
    recs = _records(out)
    assert [r["rank"] for r in recs] == [0, 1]
    for r in recs:
        assert r["terascale"] is True and r["version"] == VERSION and r["env_file"] == ".deepspeed_env"
        assert r["argv"] == [f"--local_rank={r['rank']}", "--deepspeed", str(out)]
        assert r["pid_files"] == [f"/tmp/{proc.pid}.deepspeed"]
    assert not os.path.exists(f"/tmp/{proc.pid}.deepspeed")  # removed when the job ended
    for rank in (0, 1):  # each rank's output in its own file, not on the launcher's
        (log,) = logs.glob(f"*_rank{rank}.log")
        assert f"rank {rank} runs on {VERSION}" in log.read_text()
        assert f"rank {rank} runs on" not in text
