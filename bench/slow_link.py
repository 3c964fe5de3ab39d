"""Shaped-link benchmark: two "nodes" on one machine joined by a link of a chosen
bandwidth, each configuration's step time and cross-node bytes (issue 35, E3).

    python bench/slow_link.py --quick                              # harness check, under a minute
    python bench/slow_link.py --rates 1gbit,10gbit --repeats 3 --json slow_link.json
    python bench/slow_link.py --configs zero3,zero3+all --rates 1gbit --steps 20 --warmup 5
    python bench/slow_link.py --nproc-per-node 1                   # 2 nodes x 1 rank
    python bench/slow_link.py --selftest-only --rates 1gbit,10gbit  # only the link check
    python bench/slow_link.py --list                               # the configurations

Needs root. Everything runs inside a sandbox this script creates and removes at exit
(also on Ctrl-C, SIGTERM and errors; a later run sweeps what a SIGKILLed one left):

* one network namespace ``tsl-<pid>`` with only ``lo`` up. Traffic stays on loopback
  addresses (127.0.0.0/8) inside it: no veth, no other address, nothing leaves it.
* Node 0 is 127.0.1.1, node 1 is 127.0.2.1 (``lo`` answers all of 127/8). Each node's
  ``terascale run`` agent (and so its ranks) runs in its own UTS namespace (``unshare
  --uts``) with hostname ``tsl-node0`` / ``tsl-node1``; ``/etc/netns/<ns>/hosts`` (bind-
  mounted over /etc/hosts by ``ip netns exec``) maps the names to the addresses, so gloo,
  which binds its listening socket to the address its hostname resolves to when
  ``GLOO_SOCKET_IFNAME`` is unset, listens on the node's address.
* gloo does not bind the *connecting* side of a pair: the kernel gives it 127.0.0.1 (the
  prefsrc of the 127/8 local route), so a cross-node and an intra-node connection look
  alike on the wire. A tiny ``LD_PRELOAD`` shim (C, compiled here at start with ``cc``
  into the work directory) binds every unbound TCP socket that connects to a 127/8
  address to the node's own address first (``TSL_SOURCE_ADDR``), so node 0's sockets
  always send from 127.0.1.1 and node 1's from 127.0.2.1. Nothing else changes.
* The link: HTB on ``lo`` with one class per direction (127.0.1.0/24 -> 127.0.2.0/24 and
  back, u32 filters on source and destination), each at the chosen rate (a full-duplex
  link; the other direction's ACKs share a class with that direction's data), and a
  default class at 200 Gbit for everything else, so intra-node traffic is unshaped.
  ``CONFIG_HZ`` is 250 here, so each shaped class gets a burst of at least 2x rate/HZ
  (1 MB at 1 Gbit, 10 MB at 10 Gbit). The HTB class byte counters are the ground truth
  for cross-node bytes (IP and TCP headers included; GSO packets of up to 64 KiB make
  that under 0.1%).
* **Latency cannot be shaped**: the kernel has no netem (and no dummy interfaces), and a
  userspace delay per packet is not viable on 2 cores. The link has loopback latency
  (~10 us). For an alpha-beta projection the table says how many collectives per step
  each configuration issues, by op and group size (from terascale's comms logger): add
  ``count x alpha x (ring steps)`` per collective for the latency you want to model.

Before the first job at each rate a self-test measures TCP throughput inside the
namespace (one Python socket stream, through the same addresses): each cross-node
direction must come out at 75-110% of the rate, else the run stops; the same-node figure
(unshaped) is printed beside it (one Python stream is CPU-bound at a few GB/s here, so
at 10 Gbit it is only a few times the rate). Measured 2026-11-27: 125 MB/s both ways at
1gbit and 1254 MB/s at 10gbit, same node 2-6 GB/s (also without any qdisc).

Sizing (2026-11-27, 2 busy cores, 2 x 2 ranks, the default ~98M model, fp32): a job
spends ~25-30 s starting and building the model, then a step takes ~6.5-7 s at 1gbit
(link-bound: zero3 moves 1.58 GB across per step, stage0 1.18 GB) and ~3-4 s at 10gbit
(CPU-bound: gloo on 2 shared cores does not fill a 10 Gbit link; see "link busy").

Each job: two ``terascale run --nnodes 2 --node_rank K --nproc N`` agents (static
rendezvous at 127.0.1.1). Each rank is this file (``slow_link.py worker``): the GPT of
``examples/gpt`` (default 13 layers x 768, vocab 8192, ~98M parameters; ``--quick``:
2 x 128), micro-batch ``--micro-batch`` x ``--seq`` tokens (1 x 64: communication
dominates), ``OMP_NUM_THREADS=1``, seed 0, each rank's tokens derived from the step
number and its rank, ``comms_logger`` on. ``--warmup`` steps, then (after a barrier)
rank 0 reads the HTB counters, every rank resets its comms logger, and ``--steps``
measured steps run; after another barrier rank 0 reads the counters again. Rank 0
writes one JSON line: per-step times, losses, the HTB byte deltas, and every rank's
comms-logger records.

Configurations are data (``CONFIGS`` below): a name, the plain config it is measured
against (its *family* baseline: ``zero3`` or ``stage0``), and the overrides deep-merged
over that baseline's config. Configurations terascale does not build yet (ZeRO++ keys,
the 1-bit optimizers) are probed in the driver first (``Config.load(...).require_built()``
and the optimizer factory) and skipped with the reason; adding one is a line in
``CONFIGS``. The driver runs every (rate, repeat, configuration), configurations
interleaved within each repeat with the order rotated per repeat, and prints a table:
median ms/step over repeats (with the spread of per-repeat medians), cross-node bytes
per step (HTB counters), bytes sent per step (comms logger: each op's bus bytes, i.e.
what each rank sends in a ring algorithm, summed over ranks; the logger's DeepSpeed-style
message size is in the JSON too), ratios to the family baseline, loss, and the
collectives per step for the alpha-beta note. ``--json`` gets everything.

Notes for reading the numbers: the cross-node bytes include the rendezvous store's
keep-alives (bytes per second) and two barriers per window (< 1 KiB); the comms logger
sees only collectives terascale issues inside forward/backward/step. On 2 cores with
2 x 2 ranks the CPUs are oversubscribed: compare configurations only within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NS_PREFIX, WORK_PREFIX = "tsl-", "slow_link-"  # + the driver's pid: how sweep_stale knows its own
NODE_ADDRS = ("127.0.1.1", "127.0.2.1")
NODE_NETS = ("127.0.1.0/24", "127.0.2.0/24")
HOSTNAMES = ("tsl-node0", "tsl-node1")
HZ = 250  # CONFIG_HZ of this kernel: an HTB class needs a burst of at least rate/HZ
DEFAULT_RATE = "200gbit"  # the class of everything that is not cross-node
LR = 1e-3
NPROC = "$nproc_per_node"  # in CONFIGS: replaced by --nproc-per-node

# -- the configurations: name -> the family baseline it is compared with, and overrides -----

BASELINES: dict[str, dict] = {
    # Parameters freed after their forward use and gathered again for backward: a model too
    # large to stay gathered, which is what ZeRO-3 (and ZeRO++'s hpZ) is for; 3 x the
    # parameters cross the link a step, the ZeRO++ paper's accounting.
    "zero3": {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}},
    "stage0": {"zero_optimization": {"stage": 0},
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}},
}
# "overrides" are deep-merged over BASELINES[family]; "$warmup" and "$nproc_per_node" in a
# value are replaced by --warmup and --nproc-per-node ("$warmup-1": 0/1 Adam's variance
# phase runs to var_freeze_step + 1, so that the measured steps are all local ones).
CONFIGS: dict[str, dict] = {
    "zero3": {"family": "zero3", "overrides": {}},
    "zero3+qwZ": {"family": "zero3", "overrides": {"zero_optimization": {"zero_quantized_weights": True}}},
    "zero3+qgZ": {"family": "zero3", "overrides": {"zero_optimization": {"zero_quantized_gradients": True}}},
    "zero3+hpZ": {"family": "zero3", "overrides": {"zero_optimization": {"zero_hpz_partition_size": NPROC}}},
    "zero3+all": {"family": "zero3", "overrides": {"zero_optimization": {
        "zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": NPROC}}},
    "stage0": {"family": "stage0", "overrides": {}},
    "onebit_adam": {"family": "stage0", "overrides": {"optimizer": {
        "type": "OneBitAdam", "params": {"lr": LR, "weight_decay": 0.0, "freeze_step": "$warmup"}}}},
    "zero_one_adam": {"family": "stage0", "overrides": {"optimizer": {
        "type": "ZeroOneAdam", "params": {"lr": LR, "weight_decay": 0.0, "var_freeze_step": "$warmup-1"}}}},
    "onebit_lamb": {"family": "stage0", "overrides": {"optimizer": {
        "type": "OneBitLamb", "params": {"lr": LR, "weight_decay": 0.0, "freeze_step": "$warmup"}}}},
}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _substitute(value, subs: dict):
    if isinstance(value, dict):
        return {k: _substitute(v, subs) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, subs) for v in value]
    return subs.get(value, value) if isinstance(value, str) else value


def build_config(name: str, a: argparse.Namespace) -> dict:
    spec = CONFIGS[name]
    cfg = _merge(BASELINES[spec["family"]], spec["overrides"])
    cfg = _substitute(cfg, {NPROC: a.nproc_per_node, "$warmup": a.warmup, "$warmup-1": max(0, a.warmup - 1)})
    cfg.update({
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False, "debug": False},
    })
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def refusal(cfg: dict) -> str | None:
    """Why terascale refuses ``cfg`` before any rank starts (None: it is accepted as far as
    can be told without a world): the config's own validation and unbuilt-feature check,
    then the optimizer factory on a one-element parameter."""
    sys.path.insert(0, str(ROOT))
    try:
        import torch

        from terascale.config import Config
        from terascale.optim.factory import build_optimizer

        Config.load(copy.deepcopy(cfg)).require_built()
        opt = cfg.get("optimizer", {})
        build_optimizer(opt.get("type", "AdamW"), opt.get("params"), [torch.zeros(1, requires_grad=True)])
    except Exception as exc:  # noqa: BLE001 - any refusal is reported, not raised
        return f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return None


# -- the worker: one rank, run by terascale run ------------------------------------------------


def worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="slow_link.py worker")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    import terascale

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.width))
    n_params = model.num_parameters()
    config = json.loads(Path(a.config).read_text())
    engine, *_ = terascale.initialize(model=model, config=config)
    comms = engine.comms_logger
    micro = engine.train_micro_batch_size_per_gpu()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        t = torch.randint(0, a.vocab, (micro, a.seq + 1), generator=g)
        return t[:, :-1], t[:, 1:]

    def one_step(step: int) -> tuple[float, float]:
        x, y = batch(step)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t0, float(loss.detach())

    warm = [one_step(s) for s in range(1, a.warmup + 1)]
    dist.barrier()
    before = htb_counters() if rank == 0 else None
    if comms is not None:
        comms.reset()
    dist.barrier()  # nobody sends a byte of the window before rank 0 has read the counters
    w0 = time.perf_counter()
    measured = [one_step(s) for s in range(a.warmup + 1, a.warmup + a.steps + 1)]
    dist.barrier()
    window_s = time.perf_counter() - w0
    after = htb_counters() if rank == 0 else None
    mine = {"rank": rank, "records": comms.records() if comms is not None else None,
            "losses": [x[1] for x in measured], "times": [x[0] for x in measured]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # after the window: not counted
    if rank == 0:
        result = {
            "params": n_params, "world": dist.get_world_size(), "micro_batch": micro,
            "warmup_times": [x[0] for x in warm], "warmup_losses": [x[1] for x in warm],
            "times": mine["times"], "losses": mine["losses"], "window_s": window_s,
            "htb_before": before, "htb_after": after, "ranks": everyone,
        }
        tmp = Path(a.out + ".tmp")
        tmp.write_text(json.dumps(result) + "\n")
        os.replace(tmp, a.out)
    engine.destroy()


# -- the sandbox: a namespace, addresses, the shim, the link -----------------------------------


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def htb_counters(dev: str = "lo") -> dict[str, dict[str, int]]:
    """Bytes and packets sent per HTB class of ``dev`` in the current namespace."""
    return _parse_counters(sh("tc", "-s", "class", "show", "dev", dev).stdout)


SHIM_C = r"""
/* slow_link.py: bind a TCP socket that connects to 127/8 to $TSL_SOURCE_ADDR first. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

static int (*real_connect)(int, const struct sockaddr *, socklen_t);

static int loopback4(const struct in_addr *a) { return (ntohl(a->s_addr) >> 24) == 127; }

static void bind_source(int fd, const struct sockaddr *dst) {
    const char *src = getenv("TSL_SOURCE_ADDR");
    struct in_addr want;
    int type = 0, one = 1;
    socklen_t tl = sizeof(type);
    struct sockaddr_storage cur;
    socklen_t cl = sizeof(cur);
    if (!src || !dst || inet_pton(AF_INET, src, &want) != 1) return;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM) return;
    memset(&cur, 0, sizeof(cur));
    if (getsockname(fd, (struct sockaddr *)&cur, &cl) != 0) return;
    if (dst->sa_family == AF_INET) {
        const struct sockaddr_in *d = (const struct sockaddr_in *)dst;
        struct sockaddr_in s;
        if (!loopback4(&d->sin_addr) || ((struct sockaddr_in *)&cur)->sin_port != 0) return;
        memset(&s, 0, sizeof(s));
        s.sin_family = AF_INET;
        s.sin_addr = want;
        setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
        bind(fd, (struct sockaddr *)&s, sizeof(s));
    } else if (dst->sa_family == AF_INET6) {
        const struct sockaddr_in6 *d = (const struct sockaddr_in6 *)dst;
        struct sockaddr_in6 s;
        struct in_addr v4;
        if (!IN6_IS_ADDR_V4MAPPED(&d->sin6_addr) || ((struct sockaddr_in6 *)&cur)->sin6_port != 0) return;
        memcpy(&v4, &d->sin6_addr.s6_addr[12], 4);
        if (!loopback4(&v4)) return;
        memset(&s, 0, sizeof(s));
        s.sin6_family = AF_INET6;
        s.sin6_addr.s6_addr[10] = 0xff;
        s.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&s.sin6_addr.s6_addr[12], &want, 4);
        setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
        bind(fd, (struct sockaddr *)&s, sizeof(s));
    }
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    int saved = errno;
    if (!real_connect) real_connect = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "connect");
    bind_source(fd, addr);
    errno = saved;
    return real_connect(fd, addr, len);
}
"""


def build_shim(work: Path) -> Path:
    src, lib = work / "tsl_source.c", work / "tsl_source.so"
    src.write_text(SHIM_C)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("slow_link.py needs a C compiler (cc) for its source-address shim")
    sh(cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl")
    return lib


def sweep_stale() -> None:
    """Remove what an earlier driver that was SIGKILLed left behind: namespaces (with their
    processes), /etc/netns entries and work directories named after a driver pid that no
    longer runs (only names this script gives)."""
    def dead(name: str, prefix: str) -> bool:
        pid = name.removeprefix(prefix).split("-")[0]
        return pid.isdigit() and not Path(f"/proc/{pid}").exists()

    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(NS_PREFIX) and dead(ns, NS_PREFIX):
            print(f"sweeping namespace {ns} of a dead run", flush=True)
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", ns, check=False)
    etc = Path("/etc/netns")
    if etc.is_dir():
        for d in etc.iterdir():
            if d.name.startswith(NS_PREFIX) and dead(d.name, NS_PREFIX):
                shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            etc.rmdir()  # only when empty
    for d in Path(tempfile.gettempdir()).glob(f"{WORK_PREFIX}*"):
        if d.is_dir() and dead(d.name, WORK_PREFIX):
            shutil.rmtree(d, ignore_errors=True)


def rate_bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use tc's notation, e.g. 1gbit, 500mbit, 10gbit")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return bits * 8 if m.group(3) == "bps" else bits


def burst_bytes(rate: str) -> int:
    """HTB burst for ``rate``: 2x what the rate sends in one jiffy, at least 1 MB."""
    return max(1 << 20, int(2 * rate_bits(rate) / 8 / HZ))


class LinkSandbox:
    """A network namespace with ``lo`` up, /etc/netns/<ns>/hosts naming the two nodes, and
    HTB on ``lo`` shaping node0 <-> node1; everything goes at :meth:`close`, with every
    process still running in the namespace."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.ns = f"{NS_PREFIX}{os.getpid()}"
        self.etc = Path("/etc/netns") / self.ns
        self._made_ns = self._made_etc = self._made_etc_root = False
        self.rate: str | None = None

    def open(self) -> LinkSandbox:
        sh("ip", "netns", "add", self.ns)
        self._made_ns = True
        sh(*self.cmd("ip", "link", "set", "lo", "up"))
        if not Path("/etc/netns").exists():
            Path("/etc/netns").mkdir()
            self._made_etc_root = True
        self.etc.mkdir()
        self._made_etc = True
        (self.etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{addr} {name}\n" for addr, name in zip(NODE_ADDRS, HOSTNAMES)))
        return self

    def cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def node_cmd(self, node: int, *args: str) -> list[str]:
        """``args`` run as node ``node``: in the namespace, in a UTS namespace of its own with
        the node's hostname."""
        return self.cmd("unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', HOSTNAMES[node], *args)

    def shape(self, rate: str) -> None:
        """(Re)build the HTB tree on ``lo``: node0->node1 and node1->node0 at ``rate``."""
        sh(*self.cmd("tc", "qdisc", "del", "dev", "lo", "root"), check=False)
        burst = burst_bytes(rate)
        big = burst_bytes(DEFAULT_RATE)
        tc = self.cmd("tc")
        sh(*tc, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "30")
        for minor, r, b in (("10", rate, burst), ("20", rate, burst), ("30", DEFAULT_RATE, big)):
            sh(*tc, "class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{minor}", "htb", "rate", r,
               "ceil", r, "burst", str(b), "cburst", str(b), "quantum", "200000")
        for (src, dst), minor in (((NODE_NETS[0], NODE_NETS[1]), "10"), ((NODE_NETS[1], NODE_NETS[0]), "20")):
            sh(*tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", "src", src, "match", "ip", "dst", dst, "flowid", f"1:{minor}")
        self.rate = rate

    def unshape(self) -> None:
        sh(*self.cmd("tc", "qdisc", "del", "dev", "lo", "root"), check=False)
        self.rate = None

    def counters(self) -> dict[str, dict[str, int]]:
        return _parse_counters(sh(*self.cmd("tc", "-s", "class", "show", "dev", "lo")).stdout)

    def pids(self) -> list[int]:
        if not self._made_ns:
            return []
        return [int(x) for x in sh("ip", "netns", "pids", self.ns, check=False).stdout.split() if x.isdigit()]

    def kill_all(self) -> None:
        """SIGKILL every process in the namespace (agents, ranks, orphans)."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.1)

    def close(self) -> None:
        self.kill_all()
        if self._made_ns:
            sh("ip", "netns", "del", self.ns, check=False)
            self._made_ns = False
        if self._made_etc:
            shutil.rmtree(self.etc, ignore_errors=True)
            self._made_etc = False
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only when empty (another run may still use it)
        self._made_etc_root = False


def _parse_counters(text: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for block in re.split(r"\n(?=class )", text):
        m = re.match(r"class htb (\S+)", block)
        s = re.search(r"Sent (\d+) bytes (\d+) pkt", block)
        if m and s:
            out[m.group(1)] = {"bytes": int(s.group(1)), "packets": int(s.group(2))}
    return out


def cross_bytes(before: dict, after: dict) -> dict[str, int]:
    d = {c: after.get(c, {}).get("bytes", 0) - before.get(c, {}).get("bytes", 0) for c in ("1:10", "1:20", "1:30")}
    return {"node0_to_node1": d["1:10"], "node1_to_node0": d["1:20"], "intra_node": d["1:30"],
            "cross": d["1:10"] + d["1:20"]}


# -- the link self-test: TCP throughput inside the namespace -----------------------------------


def throughput(argv: list[str]) -> None:
    """``slow_link.py _throughput SRC DST SECONDS``: one TCP stream from SRC to a listener
    on DST for SECONDS; prints MB/s received (10^6 bytes)."""
    src, dst, seconds = argv[0], argv[1], float(argv[2])
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((dst, 0))
    srv.listen(1)
    got = [0, 0.0]

    def receive() -> None:
        conn, _ = srv.accept()
        buf = bytearray(1 << 20)
        t0 = None
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            if t0 is None:
                t0 = time.perf_counter()
            got[0] += n
        got[1] = time.perf_counter() - (t0 or time.perf_counter())
        conn.close()

    th = threading.Thread(target=receive)
    th.start()
    c = socket.socket()
    c.bind((src, 0))
    c.connect(srv.getsockname())
    data = b"\0" * (1 << 20)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c.sendall(data)
    c.close()
    th.join()
    print(json.dumps({"src": src, "dst": dst, "MBps": got[0] / max(got[1], 1e-9) / 1e6, "bytes": got[0]}))


def selftest(box: LinkSandbox, rate: str, seconds: float) -> dict:
    """Cross-node (node0 -> node1) and same-node (node0 -> node0) TCP throughput, shaped at
    ``rate`` (the namespace is shaped already) and the counters' view of the cross one."""
    def run(src: str, dst: str) -> float:
        out = sh(*box.cmd(sys.executable, str(Path(__file__).resolve()), "_throughput", src, dst, str(seconds))).stdout
        return json.loads(out.strip().splitlines()[-1])["MBps"]

    c0 = box.counters()
    cross = run(NODE_ADDRS[0], NODE_ADDRS[1])
    c1 = box.counters()
    back = run(NODE_ADDRS[1], NODE_ADDRS[0])
    same = run(NODE_ADDRS[0], NODE_ADDRS[0])
    d = cross_bytes(c0, c1)
    want = rate_bits(rate) / 8 / 1e6
    res = {"rate": rate, "rate_MBps": want, "cross_MBps": cross, "reverse_MBps": back, "same_node_MBps": same,
           "cross_test_bytes_in_node0_to_node1_class": d["node0_to_node1"],
           "cross_test_bytes_in_other_classes": d["node1_to_node0"] + d["intra_node"]}
    # TCP goodput below the shaped rate (headers, ACK pacing) and a little above it (HTB's burst)
    res["ok"] = 0.75 * want <= cross <= 1.1 * want and 0.75 * want <= back <= 1.1 * want
    # One Python stream tops out at a few GB/s on these cores: at high rates the unshaped
    # same-node test may not show much headroom; that is a property of the test, not the link.
    res["same_node_headroom"] = same / max(cross, 1e-9)
    return res


# -- one job: two agents -------------------------------------------------------------------------


def _listening(pid: int, port: int) -> bool:
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def run_job(box: LinkSandbox, shim: Path, work: Path, name: str, cfg: dict, a: argparse.Namespace,
            port: int, tag: str) -> dict:
    """Train ``cfg`` on 2 nodes x ``a.nproc_per_node`` ranks; rank 0's result, or an error."""
    jdir = work / tag
    jdir.mkdir(parents=True)
    (jdir / "config.json").write_text(json.dumps(cfg, indent=1))
    out = jdir / "result.json"
    wargs = ["--config", str(jdir / "config.json"), "--out", str(out), "--warmup", str(a.warmup),
             "--steps", str(a.steps), "--layers", str(a.layers), "--width", str(a.width), "--heads", str(a.heads),
             "--vocab", str(a.vocab), "--seq", str(a.seq)]
    agents: list[subprocess.Popen] = []
    t0 = time.time()
    deadline = time.monotonic() + a.job_timeout
    try:
        for node in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TERASCALE_DEVICE": "cpu",
                   "PYTHONPATH": str(ROOT), "LD_PRELOAD": str(shim), "TSL_SOURCE_ADDR": NODE_ADDRS[node]}
            env.pop("GLOO_SOCKET_IFNAME", None)
            argv = box.node_cmd(node, sys.executable, "-m", "terascale", "run", "--nnodes", "2", "--node_rank",
                                str(node), "--nproc", str(a.nproc_per_node), "--master_addr", NODE_ADDRS[0],
                                "--master_port", str(port), "--no_local_rank", str(Path(__file__).resolve()),
                                "worker", *wargs)
            with open(jdir / f"agent{node}.log", "w") as log:
                agents.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            if node == 0:  # the store listens before node 1 dials it
                while not _listening(agents[0].pid, port):
                    if agents[0].poll() is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
        if a.show_sockets:
            _show_sockets(box, agents, jdir, deadline, port, 2 * a.nproc_per_node)
        while any(p.poll() is None for p in agents):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {tag} ran past --job-timeout {a.job_timeout} s")
            if any(p.poll() not in (None, 0) for p in agents):  # one node failed: do not wait for the other's timeout
                time.sleep(2)
                break
            time.sleep(0.2)
    except TimeoutError as exc:
        return {"error": str(exc), "log_dir": str(jdir), "wall_s": time.time() - t0}
    finally:
        for p in agents:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        box.kill_all()  # any rank that outlived its agent
    codes = [p.returncode for p in agents]
    if not out.exists():
        return {"error": f"exit codes {codes}: " + _error_tail(jdir), "log_dir": str(jdir),
                "wall_s": time.time() - t0}
    res = json.loads(out.read_text())
    res.update(wall_s=time.time() - t0, exit_codes=codes, log_dir=str(jdir))
    return res


def _error_tail(jdir: Path) -> str:
    """The most telling line of the agents' logs (a Python exception, else the last line)."""
    lines = []
    for log in sorted(jdir.glob("agent*.log")):
        lines += log.read_text(errors="replace").splitlines()
    errors = [ln for ln in lines if re.match(r"\s*(\[rank\d+\]: )?\w+(Error|Exception)\b", ln)]
    return (errors[-1] if errors else lines[-1] if lines else "no output").strip()[:400]


def _show_sockets(box: LinkSandbox, agents: list, jdir: Path, deadline: float, port: int, world: int) -> None:
    """Once gloo's pairs are up (world x (world - 1) established endpoints on ports other
    than the store's), save ``ss -tnp`` of the namespace to sockets.txt and print it."""
    while time.monotonic() < deadline and all(p.poll() is None for p in agents):
        text = sh(*box.cmd("ss", "-tnp"), check=False).stdout
        pairs = [ln for ln in text.splitlines() if ln.startswith("ESTAB") and f":{port} " not in ln]
        if len(pairs) >= world * (world - 1):
            (jdir / "sockets.txt").write_text(text)
            print(text, flush=True)
            return
        time.sleep(0.5)


# -- the driver --------------------------------------------------------------------------------


def summarise_job(res: dict, a: argparse.Namespace) -> dict:
    """Per-step numbers of one job: ms/step, cross-node bytes, logger bytes, collectives."""
    steps = a.steps
    cross = cross_bytes(res["htb_before"], res["htb_after"])
    sent = msg = 0.0
    ops: dict[tuple[str, int | None], int] = {}
    for r in res["ranks"]:
        for rec in r["records"] or []:
            # bus bytes (what a rank sends in a ring): busbw x latency
            sent += rec["busbw_gbps"] * 1e9 * rec["total_latency_ms"] / 1e3
            msg += rec["total_bytes"]
            if r["rank"] == 0:
                key = (rec["op"], _group_size(rec))
                ops[key] = ops.get(key, 0) + rec["count"]
    have_logger = any(r["records"] is not None for r in res["ranks"])
    world, local = res["world"], a.nproc_per_node
    # a group larger than a node, or the whole world, spans both nodes; smaller ones may not (hpZ)
    spanning = sum(c for (op, n), c in ops.items() if n is not None and (n == world or n > local))
    return {
        "ms_per_step": statistics.median(res["times"]) * 1e3,
        "window_ms_per_step": res["window_s"] / steps * 1e3,
        "cross_bytes_per_step": cross["cross"] / steps,
        "node0_to_node1_per_step": cross["node0_to_node1"] / steps,
        "node1_to_node0_per_step": cross["node1_to_node0"] / steps,
        "intra_node_bytes_per_step": cross["intra_node"] / steps,
        "logger_sent_bytes_per_step": sent / steps if have_logger else None,
        "logger_msg_bytes_per_step": msg / steps if have_logger else None,
        "collectives_per_step": {f"{op}" + (f" (group {n})" if n else ""): c / steps
                                 for (op, n), c in sorted(ops.items(), key=lambda kv: str(kv[0]))},
        "spanning_collectives_per_step": spanning / steps if have_logger else None,
        "loss_last": res["losses"][-1], "loss_first_measured": res["losses"][0],
        "params": res["params"],
    }


def _group_size(rec: dict) -> int | None:
    """The op's group size from its busbw/algbw factor (None where the factor is 1)."""
    if not rec["algbw_gbps"]:
        return None
    f = rec["busbw_gbps"] / rec["algbw_gbps"]
    if rec["op"] == "all_reduce" and f < 2:  # 2(n-1)/n
        return round(2 / (2 - f))
    if rec["op"] in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single") and f < 1:
        return round(1 / (1 - f))  # (n-1)/n
    return None


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def report(results: dict, a: argparse.Namespace) -> None:
    rows = results["rows"]
    print()
    for st in results.get("selftests", []):
        print(f"link self-test at {st['rate']}: node0->node1 {st['cross_MBps']:.0f} MB/s, node1->node0 "
              f"{st['reverse_MBps']:.0f} MB/s (shaped rate {st['rate_MBps']:.0f} MB/s), same node "
              f"{st['same_node_MBps']:.0f} MB/s (unshaped){'' if st['ok'] else '  <-- NOT AS SHAPED'}"
              f"{'' if st['same_node_headroom'] > 1.5 else '  (same node barely faster: the test is CPU-bound)'}")
    print()
    print(f"GPT {results.get('params') or '?'} parameters ({a.layers} layers x {a.width}, vocab {a.vocab}), "
          f"micro-batch {a.micro_batch} x {a.seq} tokens, {a.dtype}, 2 nodes x {a.nproc_per_node} rank(s) x "
          f"{a.threads} thread(s); {a.warmup} warm-up + {a.steps} measured steps, {a.repeats} repeat(s). Latency is "
          "not shaped (no netem): loopback latency only.")
    print()
    print("| config | rate | ms/step median (per-repeat range) | cross-node bytes/step (tc) | "
          "bytes sent/step (comms logger, all ranks) | link busy | time vs base | cross bytes vs base | "
          "loss (last step) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r.get("skipped"):
            print(f"| {r['config']} | {r['rate']} | skipped: not built yet (see below) | | | | | | |")
            continue
        if r.get("failed"):
            print(f"| {r['config']} | {r['rate']} | FAILED: {r['failed'][:160]} | | | | | | |")
            continue
        base = next((b for b in rows if b["config"] == r["family"] and b["rate"] == r["rate"] and "ms" in b), None)
        tr = f"{r['ms'] / base['ms']:.2f}x" if base and base is not r else ("1.00x" if base is r else "-")
        br = f"{r['cross'] / base['cross']:.2f}x" if base and base is not r and base["cross"] else \
            ("1.00x" if base is r else "-")
        spread = f"{min(r['ms_repeats']):.0f}-{max(r['ms_repeats']):.0f}"
        print(f"| {r['config']} | {r['rate']} | {r['ms']:.0f} ({spread}) | {fmt_bytes(r['cross'])} | "
              f"{fmt_bytes(r['sent'])} | {r['busy'] * 100:.0f}% | {tr} | {br} | {r['loss']:.5f} |")
    print()
    print("cross-node bytes: HTB class counters, both directions, IP/TCP headers included. bytes sent: each "
          "collective's bus bytes (what a rank sends in a ring) summed over ranks, intra-node included; with 1 rank "
          "per node the two agree. link busy: the busier direction's bytes per step at the shaped rate over the "
          "measured window's time per step (near 100%: link-bound; low: CPU-bound).")
    print()
    print("Collectives per step (rank 0's comms logger, by op and group size inferred from busbw/algbw) for an "
          "alpha-beta estimate: add count x alpha x ring steps (all-reduce 2(n-1), all-gather/reduce-scatter n-1) "
          "for the groups that span both nodes; groups of n <= ranks per node may be intra-node (hpZ).")
    seen = set()
    for r in rows:
        if "collectives" in r and r["config"] not in seen:
            seen.add(r["config"])
            ops = ", ".join(f"{k}: {v:g}" for k, v in r["collectives"].items()) or "(none recorded)"
            n = r.get("spanning")
            extra = (f"; spanning both nodes: {n:g}/step, so at least +{n * 0.025:.2f} ms (alpha 25 us) or "
                     f"+{n:.0f} ms (alpha 1 ms) per step" if n is not None else "")
            print(f"- {r['config']}: {ops}{extra}")
    for name, why in results.get("skipped", {}).items():
        print(f"- {name} skipped, terascale refuses it: {why[:400]}")


def aggregate(name: str, rate: str, jobs: list[dict]) -> dict:
    good = [j for j in jobs if "summary" in j]
    row = {"config": name, "family": CONFIGS[name]["family"], "rate": rate}
    if not good:
        row["failed"] = jobs[0].get("error", "?") if jobs else "no job ran"
        return row
    s = [j["summary"] for j in good]
    row.update({
        "ms": statistics.median(x["ms_per_step"] for x in s),
        "ms_repeats": [x["ms_per_step"] for x in s],
        "window_ms": statistics.median(x["window_ms_per_step"] for x in s),
        "cross": statistics.median(x["cross_bytes_per_step"] for x in s),
        "intra": statistics.median(x["intra_node_bytes_per_step"] for x in s),
        # the busier direction's bytes at the shaped rate, over the step time: near 100% = link-bound
        "busy": statistics.median(max(x["node0_to_node1_per_step"], x["node1_to_node0_per_step"])
                                  / (rate_bits(rate) / 8) / (x["window_ms_per_step"] / 1e3) for x in s),
        "sent": (statistics.median(x["logger_sent_bytes_per_step"] for x in s)
                 if s[0]["logger_sent_bytes_per_step"] is not None else None),
        "msg": (statistics.median(x["logger_msg_bytes_per_step"] for x in s)
                if s[0]["logger_msg_bytes_per_step"] is not None else None),
        "loss": s[-1]["loss_last"],
        "collectives": s[0]["collectives_per_step"],
        "spanning": s[0]["spanning_collectives_per_step"],
        "failed_repeats": len(jobs) - len(good),
    })
    return row


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names (--list shows them)")
    p.add_argument("--list", action="store_true", help="print the configurations and exit")
    p.add_argument("--rates", default="1gbit,10gbit", help="link rates in tc notation, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="measured steps per job")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per job (also the 1-bit freeze_step)")
    p.add_argument("--nproc-per-node", dest="nproc_per_node", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--layers", type=int, default=13)
    p.add_argument("--width", "--model-size", dest="width", type=int, default=768, help="hidden size")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--quick", action="store_true",
                   help="harness check: 2 x 128 model, 1 repeat, 2 warm-up + 3 steps, only configs given or zero3,stage0")
    p.add_argument("--selftest-s", dest="selftest_s", type=float, default=2.0, help="seconds per throughput test")
    p.add_argument("--selftest-only", dest="selftest_only", action="store_true")
    p.add_argument("--no-selftest", dest="no_selftest", action="store_true")
    p.add_argument("--show-sockets", dest="show_sockets", action="store_true",
                   help="print `ss -tnp` of the namespace during the first job")
    p.add_argument("--job-timeout", dest="job_timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    p.add_argument("--keep-logs", dest="keep_logs", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.width, a.heads, a.vocab, a.repeats = 2, 128, 4, 1024, 1
        a.steps, a.warmup = min(a.steps, 3), min(a.warmup, 2)
        if "--configs" not in " ".join(argv):
            a.configs = "zero3,stage0"
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    unknown = [c for c in a.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    a.rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    for r in a.rates:
        try:
            rate_bits(r)
        except ValueError as exc:
            p.error(str(exc))
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    if a.list:
        for name, spec in CONFIGS.items():
            print(f"{name:15s} vs {spec['family']:7s} {json.dumps(spec['overrides'])}")
        return 0
    if os.geteuid() != 0:
        raise SystemExit("slow_link.py needs root: it creates a network namespace and shapes its loopback")
    sweep_stale()
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-"))
    box = LinkSandbox(work)
    results: dict = {"args": {k: v for k, v in vars(a).items()}, "work": str(work), "rows": [], "jobs": [],
                     "selftests": [], "skipped": {}}
    ok = False

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    began = time.time()
    print(f"work directory {work}", flush=True)
    try:
        shim = build_shim(work)
        box.open()
        results["namespace"] = box.ns
        ok = drive(a, box, shim, work, results)
    except KeyboardInterrupt:
        results["failure"] = "interrupted"
        print("interrupted: cleaning up", flush=True)
    except Exception:  # noqa: BLE001 - still clean up and report
        results["failure"] = traceback.format_exc()
        print(results["failure"], flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave the sandbox behind
        box.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    results["wall_s"] = round(time.time() - began, 1)
    if results["rows"] or results["selftests"]:
        report(results, a)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
        print(f"\nJSON: {a.json}")
    ok = ok and "failure" not in results
    if ok and not a.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept in {work}")
    print(f"wall {results['wall_s']:.0f} s; {'ok' if ok else 'FAILED: ' + results.get('failure', 'see above')[-300:]}")
    return 0 if ok else 1


def drive(a: argparse.Namespace, box: LinkSandbox, shim: Path, work: Path, results: dict) -> bool:
    names = []
    for name in a.configs:
        why = refusal(build_config(name, a))
        if why:
            print(f"skipping {name}: terascale refuses it ({why[:300]})", flush=True)
            results["skipped"][name] = why
        else:
            names.append(name)
    port = 29500
    all_ok = True
    for rate in a.rates:
        box.shape(rate)
        print(f"link {rate}: HTB on lo of {box.ns}, burst {burst_bytes(rate)} B per direction", flush=True)
        results.setdefault("tc", {})[rate] = sh(*box.cmd("tc", "class", "show", "dev", "lo")).stdout
        if not a.no_selftest:
            st = selftest(box, rate, a.selftest_s)
            results["selftests"].append(st)
            print(f"  self-test: node0->node1 {st['cross_MBps']:.0f} MB/s, node1->node0 {st['reverse_MBps']:.0f} MB/s "
                  f"(rate {st['rate_MBps']:.0f} MB/s), same node {st['same_node_MBps']:.0f} MB/s", flush=True)
            if not st["ok"]:
                results["failure"] = f"the link at {rate} is not shaped as asked: {st}"
                return False
        if a.selftest_only:
            continue
        jobs: dict[str, list[dict]] = {n: [] for n in names}
        for rep in range(a.repeats):
            order = names[rep % len(names):] + names[: rep % len(names)] if names else []
            for name in order:
                port += 1
                tag = f"{rate}-r{rep}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
                show = a.show_sockets and port == 29501
                a_show, a.show_sockets = a.show_sockets, show
                t0 = time.time()
                res = run_job(box, shim, work, name, build_config(name, a), a, port, tag)
                a.show_sockets = a_show
                entry = {"config": name, "rate": rate, "repeat": rep, **res}
                if "error" in res:
                    all_ok = False
                    print(f"  {name} @ {rate} repeat {rep}: FAILED ({res['error'][:300]}); logs {res['log_dir']}",
                          flush=True)
                else:
                    entry["summary"] = summarise_job(res, a)
                    results["params"] = res["params"]
                    s = entry["summary"]
                    print(f"  {name} @ {rate} repeat {rep}: {s['ms_per_step']:.0f} ms/step, cross-node "
                          f"{fmt_bytes(s['cross_bytes_per_step'])}/step, logger sent "
                          f"{fmt_bytes(s['logger_sent_bytes_per_step'])}/step, loss {s['loss_last']:.5f} "
                          f"({time.time() - t0:.0f} s)", flush=True)
                jobs[name].append(entry)
                results["jobs"].append(entry)
        for name in a.configs:
            if name in results["skipped"]:
                results["rows"].append({"config": name, "family": CONFIGS[name]["family"], "rate": rate,
                                        "skipped": "not built: " + results["skipped"][name]})
            else:
                results["rows"].append(aggregate(name, rate, jobs[name]))
    box.unshape()
    return all_ok


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_throughput":
        throughput(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
