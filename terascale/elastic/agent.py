"""The per-node agent of a live elastic job: ``terascale run --nnodes MIN:MAX``.

[Note: the live elastic agent]
torchrun's agent answers every change of membership by stopping all of its workers and
starting new ones, which then reload the last checkpoint. This agent never stops a
worker that runs: membership is the workers' own business ([Note: membership epochs]),
decided over the job's c10d ``TCPStore``. The agent

* hosts that store when the rendezvous endpoint is this machine and its port is free
  (the first agent to start, as torch's c10d rendezvous backend does), else connects to it;
* starts ``--nproc`` rank processes with the store's address, the job id, its own node
  id and the member bounds in the environment (no ``RANK``/``WORLD_SIZE``: an epoch gives
  them);
* starts again, as a new member, a rank that exits with an error (up to
  ``--max-restarts`` times in all): the running ranks take it in at a step boundary;
* ends when all its ranks ended well; the agent hosting the store keeps it up until the
  other members are done too (they read it to the end), and marks the job closed so that
  processes still waiting to join exit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

from terascale.elastic.membership import ENV_LAST_CALL, ENV_MAX, ENV_MIN, ENV_NODE, ENV_RUN_ID, ENV_STORE
from terascale.elastic.world import ENV_EXPIRY, ENV_TIMEOUT

POLL_S = 0.1
DONE_GRACE_S = 30.0  # how long the store's host waits for the other members after its own ranks ended


def _host_store(host: str, port: int):
    """The job's store: hosted here if this agent is first at a local endpoint, else a client."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    local = host in ("127.0.0.1", "localhost", "::1", socket.gethostname(), socket.getfqdn())
    if local:
        try:
            return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout), True
        except Exception:  # noqa: BLE001 - the port is taken: another agent hosts it
            pass
    return dist.TCPStore(host, port, is_master=False, timeout=timeout), False


def _start(command: Sequence[str], env: dict[str, str], local_rank: int, nproc: int) -> subprocess.Popen:
    env = {**env, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nproc)}
    return subprocess.Popen(list(command), env=env)


def run(args: argparse.Namespace) -> int:
    host, _, port = args.endpoint.rpartition(":")
    host = host.strip("[]")
    store, hosting = _host_store(host, int(port))
    low, _, high = args.nnodes.partition(":")
    node = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({
        ENV_STORE: f"{host}:{port}", ENV_RUN_ID: args.run_id, ENV_NODE: node,
        ENV_MIN: str(int(low) * args.nproc), ENV_MAX: str(int(high or low) * args.nproc),
        "TORCHELASTIC_RUN_ID": args.run_id,
    })  # fmt: skip
    if args.expiry is not None:
        env[ENV_EXPIRY] = str(args.expiry)
    if args.timeout is not None:
        env[ENV_TIMEOUT] = str(args.timeout)
    if args.last_call is not None:
        env[ENV_LAST_CALL] = str(args.last_call)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    workers = {r: _start(command, env, r, args.nproc) for r in range(args.nproc)}
    restarts, code = args.max_restarts, 0
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        while workers:
            time.sleep(POLL_S)
            for r, p in list(workers.items()):
                rc = p.poll()
                if rc is None:
                    continue
                del workers[r]
                if rc == 0 or stopping:
                    code = code or rc
                    continue
                if restarts > 0 and not _job_over(store, args.run_id):
                    restarts -= 1
                    print(f"terascale: local rank {r} exited with {rc}; starting it again as a new member "
                          f"({restarts} restart(s) left)", file=sys.stderr, flush=True)  # fmt: skip
                    workers[r] = _start(command, env, r, args.nproc)
                else:
                    why = "no restarts are left" if restarts <= 0 else "the job is over"
                    print(f"terascale: local rank {r} exited with {rc} and {why}", file=sys.stderr,
                          flush=True)  # fmt: skip
                    code = rc
                    for other in workers.values():
                        other.terminate()
    except KeyboardInterrupt:
        for p in workers.values():
            p.terminate()
        code = 130
    if hosting:
        _serve_until_done(store, args.run_id)
    return code


def _job_over(store, run_id: str) -> bool:
    """Whether the job ended (a rank that fails then is not started again: there is
    nothing left to join, and the store's host may be gone)."""
    import torch.distributed as dist

    try:
        return dist.PrefixStore(f"terascale/elastic/{run_id}/", store).check(["closed"])
    except Exception:  # noqa: BLE001 - the store is unreachable: its host ended the job (or died)
        return True


def _serve_until_done(store, run_id: str) -> None:
    """Keep the store up while members of other nodes still use it."""
    import torch.distributed as dist

    jobs = dist.PrefixStore(f"terascale/elastic/{run_id}/", store)
    jobs.set("closed", "1")
    deadline = time.monotonic() + DONE_GRACE_S
    last = None
    while time.monotonic() < deadline:
        n = int(jobs.add("joins", 0))
        members = [jobs.get(f"join/{k}").decode() for k in range(1, n + 1)]
        beats = [jobs.add(f"hb/{m}", 0) for m in members if not jobs.check([f"left/{m}"])]
        if last is not None and beats == last:
            return  # nobody beats any more: every member is done or gone
        last = beats
        time.sleep(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m terascale.elastic.agent", description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", required=True, help="host:port of the job's store")
    p.add_argument("--run-id", required=True)
    p.add_argument("--nnodes", required=True, help="MIN:MAX nodes")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--expiry", type=float, default=None, help="seconds without a heartbeat before a member is gone")
    p.add_argument("--timeout", type=float, default=None, help="seconds a collective waits for a peer")
    p.add_argument("--last-call", type=float, default=None, help="seconds a starting quorum waits for more")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
