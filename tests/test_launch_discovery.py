"""Rank discovery for processes that MPI launchers and srun start (terascale.comm.discovery).

Unit tests read each launcher's variables from a plain dict; the real runs start two
processes with OpenMPI's or SLURM's variables (no RANK/WORLD_SIZE), with a real ``mpirun``
where OpenMPI is installed, and with ``terascale run --launcher mpi``, and check that they
form one 2-rank job whose trained parameters equal those of ``terascale run --nproc 2``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from terascale.comm.discovery import (
    Launch,
    MpiLayout,
    discover,
    local_placement,
    parse_hostlist,
    parse_tasks_per_node,
    slurm_port,
    started_by,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "discovered_train.py"
TIMEOUT_S = 120

OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu-a[07-08]",
        "SLURM_TASKS_PER_NODE": "2(x2)"}  # fmt: skip


def _no_mpi4py() -> None:
    return None


# ---------------------------------------------------------------------------
# each launcher's variables


def test_openmpi_on_one_node_uses_loopback_and_the_default_port():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    launch = discover(env, mpi_layout=_no_mpi4py)
    assert launch == Launch("OpenMPI", 1, 2, 1, 2, "127.0.0.1", 29500)
    assert launch.torch_environment() == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    assert discover({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_addr == "head"
    assert discover({**env, "MASTER_PORT": "1234"}).master_port == 1234


def test_openmpi_across_nodes_needs_master_addr_or_mpi4py():
    assert discover({**OMPI, "MASTER_ADDR": "node0"}, mpi_layout=_no_mpi4py) == Launch("OpenMPI", 3, 4, 1, 2, "node0",
                                                                                        29500)  # fmt: skip
    with pytest.raises(ValueError) as err:
        discover(OMPI, mpi_layout=_no_mpi4py)
    message = str(err.value)
    # The variables seen and both ways out, never a silent world of one.
    for part in ("OpenMPI started 4 processes on more than one node", "OMPI_COMM_WORLD_LOCAL_SIZE=2",
                 "MASTER_ADDR is not set", "mpirun -x MASTER_ADDR=", "pip install mpi4py"):  # fmt: skip
        assert part in message, message
    # With mpi4py: rank 0's host as MPI tells it.
    calls = []

    def layout() -> MpiLayout:
        calls.append(1)
        return MpiLayout("node0.cluster", 1, 2)

    assert discover(OMPI, mpi_layout=layout).master_addr == "node0.cluster" and calls == [1]


def test_mvapich_and_mpich_and_intel_mpi():
    mv2 = {"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0",
           "MV2_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    assert discover(mv2, mpi_layout=_no_mpi4py) == Launch("MVAPICH", 0, 2, 0, 2, "127.0.0.1", 29500)
    hydra = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "MASTER_ADDR": "h0"}
    assert discover(hydra, mpi_layout=_no_mpi4py) == Launch("MPICH/Intel MPI", 5, 8, 1, 4, "h0", 29500)
    pals = {"PMI_RANK": "1", "PMI_SIZE": "2", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "2"}
    assert discover(pals, mpi_layout=_no_mpi4py).local_rank == 1
    # PMI from srun --mpi=pmi2 gives no local rank; SLURM's describes the same processes.
    pmi_srun = {"PMI_RANK": "2", "PMI_SIZE": "4", **SRUN, "MASTER_ADDR": "gpu-a07"}
    expected = Launch("MPICH/Intel MPI", 2, 4, 0, 2, "gpu-a07", slurm_port(4242))  # the job's port: one job
    assert discover(pmi_srun, mpi_layout=_no_mpi4py) == expected
    with pytest.raises(ValueError, match="no variable gives this rank's local rank"):
        discover({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h"}, mpi_layout=_no_mpi4py)
    assert discover({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h"},
                    mpi_layout=lambda: MpiLayout("h", 1, 2)).local_rank == 1  # fmt: skip


def test_srun_tasks_take_the_first_host_and_a_port_from_the_job_id():
    launch = discover(SRUN)
    assert launch == Launch("SLURM", 2, 4, 0, 2, "gpu-a07", slurm_port(4242))
    assert slurm_port(4242) == 24242 and slurm_port(123456) == 23456
    # The step's node list (where task 0 runs) over the job's; MASTER_* over both.
    step = {**SRUN, "SLURM_STEP_NODELIST": "gpu-a[08,11]", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}
    assert (discover(step).master_addr, discover(step).world_size) == ("gpu-a08", 2)
    assert discover({**SRUN, "MASTER_ADDR": "x", "MASTER_PORT": "777"}).master_addr == "x"
    assert discover({**SRUN, "MASTER_PORT": "777"}).master_port == 777
    old_names = {k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"} | {"SLURM_NODELIST": "n1"}
    assert discover(old_names).master_addr == "n1"
    # Tasks per node: the count at SLURM_NODEID, or SLURM_NTASKS_PER_NODE.
    uneven = {**SRUN, "SLURM_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1", "SLURM_PROCID": "3"}
    assert discover(uneven).local_world_size == 1
    per_node = {k: v for k, v in SRUN.items() if k != "SLURM_TASKS_PER_NODE"} | {"SLURM_NTASKS_PER_NODE": "2"}
    assert discover(per_node).local_world_size == 2
    with pytest.raises(ValueError, match="nor MASTER_ADDR says where rank 0 runs"):
        discover({k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"})


def test_nothing_to_discover():
    assert discover({}) is None
    assert discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}) is None  # one process
    # torchrun's variables win over every launcher's (e.g. torchrun started by srun).
    assert discover({**SRUN, **OMPI, "RANK": "0", "WORLD_SIZE": "8"}) is None
    # A SLURM batch script is one process, whatever SLURM_NTASKS says; srun's tasks have a step.
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert started_by(batch) is None and discover(batch) is None


def test_mpi_wins_over_the_slurm_variables_of_its_daemons():
    # mpirun inside an allocation starts its daemons with srun: SLURM counts daemons.
    env = {**OMPI, "MASTER_ADDR": "h", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "3", "SLURM_PROCID": "1",
           "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}  # fmt: skip
    assert discover(env).launcher == "OpenMPI" and discover(env).rank == 3


def test_malformed_values_are_errors_naming_the_variable():
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE='two' is not an integer"):
        discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match=r"rank OMPI_COMM_WORLD_RANK=2 is not in \[0, OMPI_COMM_WORLD_SIZE=2\)"):
        discover({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="MASTER_PORT=70000 is not a port"):
        discover({**SRUN, "MASTER_PORT": "70000"})


def test_local_placement_for_the_rank_shim():
    assert local_placement({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (1, 2)
    assert local_placement(OMPI) == (1, 2)
    assert local_placement(SRUN) == (0, 2)
    assert local_placement({"LOCAL_RANK": "0"}) == (0, None)
    assert local_placement({}) is None


def test_hostlists():
    assert parse_hostlist("node[01-04,07],gpu-a[1-2]") == ["node01", "node02", "node03", "node04", "node07",
                                                          "gpu-a1", "gpu-a2"]  # fmt: skip
    assert parse_hostlist("solo") == ["solo"]
    assert parse_hostlist("a,b.example.com,c[9-10]") == ["a", "b.example.com", "c9", "c10"]
    assert parse_hostlist("rack[1-2]-n[0-1]") == ["rack1-n0", "rack1-n1", "rack2-n0", "rack2-n1"]
    assert parse_hostlist("n[098-100]") == ["n098", "n099", "n100"]
    for bad, message in (("n[1-3", "unbalanced"), ("n1-3]", "unbalanced"), ("n[3-1]", "runs backwards"),
                         ("n[a]", "not a number"), ("a,,b", "empty entry"), ("", "empty entry")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_hostlist(bad)
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="not N or N"):
        parse_tasks_per_node("2(3)")


def test_init_distributed_refuses_a_launch_it_may_not_read(monkeypatch):
    """DeepSpeed's auto_mpi_discovery=False on an MPI launch: an error, not a world of one."""
    import importlib.util

    import torch.distributed as dist

    from terascale.comm import api

    if dist.is_initialized():
        pytest.skip("this process already has a default group (init_distributed would reuse it)")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in OMPI.items():
        monkeypatch.setenv(name, value)
    refused = r"OpenMPI started 4 processes .* init_distributed\(auto_mpi_discovery=False\)"
    with pytest.raises(ValueError, match=refused):
        api.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    # With discovery, a multi-node launch without a master is a loud error too.
    if importlib.util.find_spec("mpi4py") is None:
        with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
            api.init_distributed(dist_backend="gloo")
    assert "RANK" not in os.environ and not dist.is_initialized()  # nothing half-done


# ---------------------------------------------------------------------------
# real processes


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "MV2_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "GROUP_RANK", "ROLE_RANK")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", TERASCALE_DEVICE="cpu", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)  # fmt: skip
    return env


def _run_all(commands: list[tuple[list[str], dict[str, str]]], cwd: Path | None = None) -> None:
    procs = [subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for argv, env in commands]  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            outputs.append(out)
            assert proc.returncode == 0, "\n".join(outputs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def _result(out: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    records = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    return records, torch.load(out / "final.pt", weights_only=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same job under ``terascale run --nproc 2`` (torchrun)."""
    out = tmp_path_factory.mktemp("torchrun")
    _run_all([([sys.executable, "-m", "terascale", "run", "--nproc", "2", str(SCRIPT), "--out", str(out)], _env())])
    records, state = _result(out)
    assert [(r["rank"], r["world_size"], r["launched_by"]) for r in records] == [(0, 2, "torchrun"), (1, 2, "torchrun")]
    return state


def _check_one_job(out: Path, reference: dict[str, torch.Tensor], local_rank_arg: bool = False) -> None:
    records, state = _result(out)
    # Two ranks of one world (a silent world of one would leave rank0.json only, twice written).
    assert [(r["rank"], r["world_size"], r["local_rank"]) for r in records] == [(0, 2, 0), (1, 2, 1)], records
    assert all(r["launched_by"] == "other" and r["env_local_rank"] == str(r["rank"]) for r in records)
    assert [r["local_rank_arg"] for r in records] == ([0, 1] if local_rank_arg else [None, None])
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)  # parity with torchrun, bit for bit


def test_openmpi_variables_form_one_job_equal_to_terascale_run(tmp_path, reference):
    port = str(_free_port())
    commands = [([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                 _env(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                      OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_PORT=port))
                for r in (0, 1)]  # fmt: skip
    _run_all(commands)
    _check_one_job(tmp_path, reference)


def _free_slurm_job_id() -> int:
    """A job id whose derived port (20000 + id % 10000) is free here now."""
    for job_id in range(int(time.time()) % 10000, 10000):
        with socket.socket() as s:
            try:
                s.bind(("", slurm_port(job_id)))
            except OSError:
                continue
        return 70000 + job_id
    pytest.skip("no free port in 20000-29999")


def test_slurm_variables_form_one_job_equal_to_terascale_run(tmp_path, reference):
    """srun's variables only: the master from the node list, the port from the job id."""
    job = str(_free_slurm_job_id())
    commands = [([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                 _env(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_NTASKS="2",
                      SLURM_LOCALID=str(r), SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost",
                      SLURM_TASKS_PER_NODE="2"))
                for r in (0, 1)]  # fmt: skip
    _run_all(commands)
    _check_one_job(tmp_path, reference)


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")


@needs_mpirun
def test_real_mpirun_forms_one_job_equal_to_terascale_run(tmp_path, reference):
    argv = ["mpirun", "-np", "2", "--bind-to", "none", "-x", f"MASTER_PORT={_free_port()}",
            sys.executable, str(SCRIPT), "--out", str(tmp_path)]  # fmt: skip
    _run_all([(argv, _env())])
    _check_one_job(tmp_path, reference)


@needs_mpirun
def test_terascale_run_launcher_mpi_on_a_local_hostfile(tmp_path, reference):
    """`terascale run --launcher mpi`: mpirun starts the ranks (through the rank shim, which
    passes --local_rank=N from OpenMPI's variables) and they discover each other."""
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "terascale", "run", "--hostfile", "hosts", "--launcher", "mpi",
            "--master_port", str(_free_port()), str(SCRIPT), "--out", str(out)]  # fmt: skip
    _run_all([(argv, _env())], cwd=tmp_path)
    _check_one_job(out, reference, local_rank_arg=True)
