"""The ``terascale`` command line: ``terascale run ...``, ``plan``, ``estimate``, ``consolidate`` and ``env``.

Each subcommand registers itself through one ``_add_<name>`` function and a
handler, so later subcommands slot in without touching the others. Heavy
modules (torch, the engine) are imported only by the handler that needs them,
which keeps ``terascale --help`` fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from terascale.launcher.deepspeed_cli import add_deepspeed_arguments, launcher_name  # no torch

if TYPE_CHECKING:
    from terascale.launcher.runner import LaunchOptions

__all__ = ["build_parser", "main"]

_Handler = Callable[[argparse.Namespace], int]


def _add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """Where ranks run: --nproc, --nnodes, --node_rank, --master_addr/--master_port,
    --rdzv_id, --hostfile, --include/--exclude (shared by `run` and `check`)."""
    p.add_argument(
        "--nproc", "--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num_accelerators",
        dest="nproc", type=int, default=None, metavar="N",
        help="processes per node (default: number of visible CUDA devices, else 1; "
        "with --hostfile: the host's slots)",
    )
    p.add_argument(
        "--nnodes", "--num_nodes", dest="nnodes", default=None, metavar="N|MIN:MAX",
        help="number of nodes, or an elastic range (default: 1; with --hostfile: all hosts)",
    )
    p.add_argument("--node_rank", "--node-rank", dest="node_rank", type=int, default=None, metavar="R",
                   help="this node's rank with a fixed --nnodes N started by hand on every node: node R "
                   "gets global ranks R*nproc.. whichever node starts first (torchrun's static rendezvous; "
                   "refused with an elastic MIN:MAX, whose rendezvous ranks nodes as they join)")
    p.add_argument("--master_addr", "--master-addr", dest="master_addr", default=None, metavar="ADDR",
                   help="rendezvous host (default: standalone on one node; first host of the hostfile)")
    p.add_argument("--master_port", "--master-port", dest="master_port", type=int, default=None, metavar="PORT",
                   help="rendezvous port (default: 29500, or a free port for a standalone run)")
    p.add_argument("--rdzv_id", "--rdzv-id", dest="rdzv_id", default=None, metavar="ID",
                   help="rendezvous id shared by all nodes of one job")
    p.add_argument("--rdzv_conf", "--rdzv-conf", dest="rdzv_conf", default=None, metavar="K=V,...",
                   help="torchrun's rendezvous settings over terascale's defaults (keep_alive_interval=1, "
                   "keep_alive_max_attempt=5, last_call_timeout=2: a lost node is re-formed around in "
                   "seconds), e.g. 'last_call_timeout=5,join_timeout=900'; keep-alive settings that "
                   "could split the job (under 3 attempts or 4 s) are refused")
    p.add_argument("--elastic", default="live", choices=("live", "restart"),
                   help="with --nnodes MIN:MAX: live (default) keeps the rank processes when nodes leave or join, "
                   "moving the state in memory; restart is torchrun's (every change restarts them from the last "
                   "checkpoint)")
    p.add_argument("--elastic_timeout", "--elastic-timeout", dest="elastic_timeout", type=float, default=None,
                   metavar="S", help="live elastic: seconds a collective waits for a peer that stopped answering "
                   "before the job goes on without it (default 30)")
    p.add_argument("--elastic_expiry", "--elastic-expiry", dest="elastic_expiry", type=float, default=None,
                   metavar="S", help="live elastic: seconds without a heartbeat before a member counts as gone "
                   "(default 1)")
    p.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                   help="DeepSpeed-format hostfile ('HOST slots=N' lines); start one agent per host over ssh")
    p.add_argument("--launcher", default="torchrun", type=launcher_name, choices=("torchrun", "pdsh", "mpi", "slurm"),
                   help="how the hosts of --hostfile are started: torchrun agents over ssh (default), pdsh "
                   "(torchrun agents), mpi or openmpi (OpenMPI's mpirun) or slurm (srun, inside an allocation); "
                   "under mpi and slurm each rank finds its place from the launcher's variables")
    p.add_argument("--launcher_args", "--launcher-args", dest="launcher_args", default="", metavar="ARGS",
                   help="extra arguments for pdsh, mpirun or srun, in one string "
                   "(--launcher_args='-p gpu'; with '=' when it starts with a dash)")
    p.add_argument("-i", "--include", default="", metavar="SPEC",
                   help="use only these hosts/slots, e.g. 'worker-0@worker-1:0,2' (without --hostfile, as in "
                   "DeepSpeed: 'localhost:0,1', this machine's devices)")
    p.add_argument("-e", "--exclude", default="", metavar="SPEC",
                   help="use everything but these hosts/slots, e.g. 'worker-1:0'")


def _launch_options(args: argparse.Namespace, script: str, script_args: Sequence[str] = (), *,
                    module: bool = False, max_restarts: int = 0, local_rank_arg: bool = False,
                    bind_cores: bool = False, bind_core_list: str | None = None, **fields: Any) -> LaunchOptions:
    """The :class:`LaunchOptions` of the arguments :func:`_add_launch_arguments` added (``fields``
    override them)."""
    from terascale.launcher.runner import LaunchOptions

    values = dict(
        script=script,
        script_args=tuple(script_args),
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
        elastic=getattr(args, "elastic", "live"),
        elastic_timeout=getattr(args, "elastic_timeout", None),
        elastic_expiry=getattr(args, "elastic_expiry", None),
        max_restarts=max_restarts,
        module=module,
        local_rank_arg=local_rank_arg,
        bind_cores=bind_cores,
        bind_core_list=bind_core_list,
    )
    return LaunchOptions(**{**values, **fields})


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        allow_abbrev=False,
        help="launch a training script on one or many machines (torchrun underneath)",
        description=(
            "Launch SCRIPT with torch.distributed.run. One machine: "
            "`terascale run --nproc 2 train.py`. Many: either run `terascale run --nnodes N "
            "--node_rank R --master_addr A ...` on every machine, or give a DeepSpeed-style "
            "--hostfile and terascale starts one agent per host over ssh (or all hosts with "
            "--launcher pdsh, mpi or slurm). DeepSpeed's launcher command line works as it is: "
            "`deepspeed --num_gpus 2 train.py --deepspeed ds.json` is `terascale run --as-deepspeed "
            "--num_gpus 2 train.py --deepspeed ds.json`."
        ),
    )
    _add_launch_arguments(p)
    p.add_argument("--max_restarts", "--max-restarts", dest="max_restarts", type=int, default=0, metavar="K",
                   help="restart the workers up to K times after a failure (default: 0)")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat SCRIPT as a module name, as `python -m` does")
    p.add_argument("--no_local_rank", "--no-local-rank", dest="no_local_rank", action="store_true",
                   help="do not pass --local_rank=N to the script (by default it gets it, as DeepSpeed's "
                   "launcher passes it; LOCAL_RANK is in the environment either way)")
    p.add_argument("--bind_cores_to_rank", "--bind-cores-to-rank", dest="bind_cores_to_rank", action="store_true",
                   help="pin each process to an equal share of this node's cores (one per physical core) "
                   "and set OMP_NUM_THREADS to its size, as DeepSpeed's launcher does")
    p.add_argument("--bind_core_list", "--bind-core-list", dest="bind_core_list", default=None, metavar="LIST",
                   help="the cores to share out, e.g. '0-15,32-47' (implies --bind_cores_to_rank)")
    add_deepspeed_arguments(p)
    p.add_argument("script", help="training script (or module with --module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from terascale.launcher.deepspeed_cli import launch_fields, stand_in_environment
    from terascale.launcher.runner import launch

    opts = _launch_options(args, args.script, args.script_args, module=args.module, max_restarts=args.max_restarts,
                           local_rank_arg=not args.no_local_rank, bind_cores=args.bind_cores_to_rank,
                           bind_core_list=args.bind_core_list, **launch_fields(args))  # fmt: skip
    return launch(opts, hostfile=args.hostfile, include=args.include, exclude=args.exclude, launcher=args.launcher,
                  launcher_args=args.launcher_args, environ=stand_in_environment(args.as_deepspeed))


def _add_env(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "env",
        help="show versions, devices, backends and I/O support on this machine",
        description="Print a table of what terascale can use here: versions, CUDA devices, "
        "NCCL, distributed backends, CPUs and memory, O_DIRECT support, optional packages.",
    )
    p.set_defaults(handler=_env)


def _env(args: argparse.Namespace) -> int:
    from terascale.launcher.env_report import print_env

    return print_env()


def _add_estimate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="memory per rank for each ZeRO stage and offload choice",
        description="Print the model-state memory each rank needs (device, host, NVMe) for "
        "ZeRO stages 0-3 with and without optimizer/parameter offload, by the ZeRO formulas.",
    )
    p.add_argument("--params", type=float, required=True, help="number of parameters (e.g. 7e9)")
    p.add_argument("--world", type=int, default=1, help="ranks (default 1): data-parallel, or split into pp x tp x dp with --layouts")
    p.add_argument("--largest-layer", type=float, default=None,
                   help="parameters of the largest layer (stage-3 working set; default params/10)")
    p.add_argument("--offload", nargs="+", choices=("none", "cpu", "nvme"), default=("none", "cpu", "nvme"),
                   help="offload choices to list (default: all)")
    shape = p.add_argument_group("activations (a transformer's shape; all of them or none)")
    shape.add_argument("--layers", type=int, help="transformer layers")
    shape.add_argument("--hidden", type=int, help="hidden size")
    shape.add_argument("--heads", type=int, help="attention heads")
    shape.add_argument("--seq", type=int, help="sequence length")
    shape.add_argument("--micro-batch", type=int, default=1, help="micro-batch per rank (default 1)")
    shape.add_argument("--unfused-attention", action="store_true", help="attention scores are kept (no flash/SDPA)")
    layouts = p.add_argument_group("3D layouts (with the shape above): every pp x tp x dp of --world ranks")
    layouts.add_argument("--layouts", action="store_true",
                         help="memory per rank and bytes communicated per step for each layout and ZeRO stage")
    layouts.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step")
    layouts.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                         help="list only the layouts that fit this many GiB per rank")
    p.set_defaults(handler=_estimate)


def _estimate(args: argparse.Namespace) -> int:
    from terascale.zero.estimate import estimate_memory, format_estimates

    largest = int(args.largest_layer) if args.largest_layer else None
    rows = estimate_memory(int(args.params), args.world, largest_layer_params=largest, offload=tuple(args.offload))
    print(format_estimates(rows, int(args.params), args.world))
    shape = (args.layers, args.hidden, args.heads, args.seq)
    if any(v is not None for v in shape):
        if None in shape:
            print("terascale estimate: activations need --layers, --hidden, --heads and --seq together", file=sys.stderr)
            return 2
        from terascale.activation.estimate import estimate_activations, format_activation_estimates

        acts = estimate_activations(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                                    micro_batch=args.micro_batch, fused_attention=not args.unfused_attention)
        print()
        print(format_activation_estimates(acts, args.seq, args.micro_batch))
    if args.layouts:
        if None in shape or args.global_batch is None:
            print("terascale estimate --layouts needs --layers, --hidden, --heads, --seq and --global-batch", file=sys.stderr)
            return 2
        from terascale.parallel.estimate import estimate_layouts, format_layouts

        rows = estimate_layouts(params=args.params, world=args.world, layers=args.layers, hidden=args.hidden,
                                heads=args.heads, seq=args.seq, global_batch=args.global_batch,
                                micro_batch=args.micro_batch, fused_attention=not args.unfused_attention)  # fmt: skip
        print()
        print(format_layouts(rows, args.device_memory))
    return 0


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="the memory planner's table: every plan's memory per rank and step time, and its choice",
        description="Weigh the plans a config leaves open (\"auto\" in zero_optimization.stage, "
        "offload_optimizer/offload_param.device, train_micro_batch_size_per_gpu, "
        "activation_checkpointing.policy) for a model on this machine, without launching ranks, as "
        "terascale.initialize does: memory per rank by category (runtime, parameters, gradients, "
        "optimizer states, activations, working set) and tier (device, host, NVMe), the step-time "
        "shape (compute, communication, offload I/O, optimizer), which plan is chosen and why. A config "
        "without \"auto\" shows its own plan and whether it fits. Exit code 2 when nothing fits.",
    )
    p.add_argument("--model", required=True, metavar="SPEC",
                   help="gpt:layers=4,width=512,heads=8,vocab=8192,seq=64 (the benchmarks' GPT); a Hugging "
                   "Face config.json (or its folder) or model name (needs transformers); or module:callable "
                   "returning an nn.Module or (module, sample)")
    p.add_argument("--config", required=True, help="the config file (JSON or hjson), or JSON text")
    p.add_argument("--world", type=int, default=1, metavar="N", help="data-parallel ranks (default 1)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, default=None, metavar="L",
                   help="ranks sharing this machine's memory and disk (default: all of --world)")
    p.add_argument("--seq", type=int, default=None, help="tokens in the measured sample (gpt: its seq; HF: default 512)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="emulate a machine with this much host memory for the job, e.g. 8GiB (as planner.host_memory)")
    p.add_argument("--device-memory", default=None, metavar="SIZE", help="emulate devices of this size (per rank)")
    p.add_argument("--disk-space", default=None, metavar="SIZE", help="emulate this much free NVMe space")
    p.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    from terascale.config import Config
    from terascale.config.planner import parse_bytes
    from terascale.plan import plan
    from terascale.plan.choose import describe_need, fits
    from terascale.plan.models import build_model

    cfg = Config.load(args.config)
    local = args.nproc_per_node or args.world
    caps = {key: None if getattr(args, key) is None else parse_bytes(getattr(args, key))
            for key in ("host_memory", "device_memory", "disk_space")}  # fmt: skip
    per_rank = {key: None if v is None else v // (local if key != "device_memory" else 1) for key, v in caps.items()}
    named = build_model(args.model, args.seq)
    result = plan(named.module, cfg, world=args.world, local_ranks=local, sample=named.sample, call=named.call, **per_rank)
    if named.note:
        print(f"model spec: {named.note}")
    print(result.table())
    if not result.autos and not fits(result.chosen, result.machine, result.margin):
        print(f"does not fit: {describe_need(result.chosen, result.machine, result.margin)}")
        return 2
    return 0


def _add_consolidate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "consolidate",
        help="one ordinary safetensors file (or Hugging Face folder) from a sharded checkpoint",
        description="Assemble the model's full state dict from a checkpoint written on any number "
        "of ranks, parameter by parameter (peak memory: about the largest parameter). OUT ending "
        "in .safetensors gets one file loadable by model.load_state_dict; with --hf, OUT is a "
        "folder that transformers' from_pretrained loads.",
    )
    p.add_argument("checkpoint", help="a checkpoint folder, or the save directory (with --tag or its 'latest')")
    p.add_argument("out", help="output .safetensors file (or folder with --hf)")
    p.add_argument("--tag", default=None, help="checkpoint tag inside the save directory (default: latest)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="floating dtype (default fp32)")
    p.add_argument("--hf", action="store_true", help="write a Hugging Face folder (config.json + model.safetensors)")
    p.set_defaults(handler=_consolidate)


def _consolidate(args: argparse.Namespace) -> int:
    from terascale.checkpoint import write_consolidated, write_pretrained
    from terascale.checkpoint.consolidate import DTYPES

    dtype = DTYPES[args.dtype]
    if args.hf:
        out = write_pretrained(args.checkpoint, args.out, tag=args.tag, dtype=dtype)
        print(f"wrote {out}/config.json and {out}/model.safetensors")
    else:
        nbytes = write_consolidated(args.checkpoint, args.out, tag=args.tag, dtype=dtype)
        print(f"wrote {args.out} ({nbytes / 2**20:.1f} MiB)")
    return 0


def _add_elastic_config(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "elastic-config",
        help="the global batch size and valid world sizes of a config's elasticity section",
        description="Compute what an enabled `elasticity` section decides, as DeepSpeed does: the "
        "global batch size (fixed whatever the world size), the data-parallel world sizes it splits "
        "over exactly (and, for version 0.2, the node counts), and with --world N the micro batch "
        "and gradient accumulation steps used on N ranks.",
    )
    p.add_argument("config", help="the config file (JSON or hjson)")
    p.add_argument("--world", type=int, default=None, metavar="N",
                   help="data-parallel world size (GPUs / model_parallel_size): print its micro batch × "
                   "accumulation steps")
    p.set_defaults(handler=_elastic_config)


def _elastic_config(args: argparse.Namespace) -> int:
    from terascale.config import Config
    from terascale.config.elasticity import BATCH_KEYS, check_batch_keys, format_plan, plan_elastic

    cfg = Config.load(args.config)
    plan = plan_elastic(cfg.elasticity)
    check_batch_keys(cfg.elasticity, {key: getattr(cfg, key) for key in BATCH_KEYS})
    print(format_plan(plan, args.world))
    return 0


def _add_check(subparsers: argparse._SubParsersAction) -> None:
    from terascale.health.verdict import CheckOptions  # no torch: pure options and verdict

    p = subparsers.add_parser(
        "check",
        allow_abbrev=False,
        help="pre-flight health check of every rank: compute, memory, disk, collectives",
        description="Run a short measurement on every rank, started as `terascale run` starts "
        "a script: matmul TFLOP/s (fp32, bf16), memory bandwidth, host<->device copies (CUDA), "
        "NVMe write/read through terascale's I/O engine, and all-reduce / all-gather / "
        "reduce-scatter bus bandwidth over the world, node-local and cross-node groups. Rank 0 "
        "prints one row per rank and names every rank below --tolerance x the median. Exit "
        "code 0: healthy; 1: a measurement failed or a rank is an outlier; 2: bad arguments.",
    )
    _add_launch_arguments(p)
    CheckOptions.add_arguments(p)
    p.set_defaults(handler=_check)


def _check(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from terascale.health.verdict import CheckOptions
    from terascale.launcher.runner import launch

    opts = CheckOptions.from_args(args)
    if opts.json_path is not None and not os.path.isdir(os.path.dirname(opts.json_path)):
        raise ValueError(f"--json {args.json_path}: the directory {os.path.dirname(opts.json_path)} does not exist")
    with tempfile.TemporaryDirectory(prefix="terascale-check-") as tmp:
        # The ranks on this machine leave the verdict here (see preflight's _exit_code).
        verdict_file = os.path.join(tmp, "verdict")
        script_args = [*opts.to_argv(), "--verdict-file", verdict_file]
        launch_opts = _launch_options(args, "terascale.health.preflight", script_args, module=True)
        rc = launch(launch_opts, hostfile=args.hostfile, include=args.include, exclude=args.exclude,
                    launcher=args.launcher, launcher_args=args.launcher_args)
        verdict = int(open(verdict_file).read()) if os.path.exists(verdict_file) else None
    if rc == 0:
        return verdict or 0  # no file: the ranks ran on other hosts and exited with the verdict
    if verdict is None:
        print(f"terascale check: the ranks exited with code {rc}; the output above says why", file=sys.stderr)
    else:
        print(f"terascale check: FAILED: a rank exited with code {rc} after reporting", file=sys.stderr)
    return 130 if rc == 130 else 1


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="an HTML page of plots (loss, throughput, MFU, memory, time, comms) from a run's CSV monitor files",
        description="Read the files csv_monitor wrote (<output_path>/<job_name>/*.csv) and write "
        "report.html with one PNG per plot: loss and held-out loss, optimizer state, throughput, MFU, "
        "memory per rank, time per step, communication bandwidth, stragglers, and a table of final "
        "values. Prints the HTML's path. Exit code 2 when a folder holds no CSV files.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="the csv_monitor's <output_path>/<job_name> folder (or its parent, holding one job)")
    p.add_argument("--compare", default=None, metavar="OTHER_RUN",
                   help="another run's folder: overlaid on every plot, with the ratio in the tables")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: RUN_DIR/report)")
    p.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from terascale.profiling.report import build_report

    print(build_report(args.run_dir, out_dir=args.out, compare=args.compare))
    return 0


def _add_data(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "data",
        help="prepare token datasets (memory-mapped shards) and check them",
        description="Token datasets for training ([Note: the token dataset format] in terascale/data/shards.py).",
    )
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser(
        "prepare",
        help="tokenize text files, JSONL and Hugging Face datasets into token shards",
        description="Tokenize FILES (text files: one document each; .jsonl: one per line; .parquet, .arrow "
        "and save_to_disk folders: one per row; other folders: the files under them) in parallel worker "
        "processes into OUT. Run again after an interruption: it resumes.",
    )
    prep.add_argument("files", nargs="+", metavar="FILES")
    prep.add_argument("--out", required=True, help="the dataset folder to write")
    prep.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer (tokenizer.json or its "
                      "folder); default: bytes (ids 0-255)")  # fmt: skip
    prep.add_argument("--append-eos", default=None, metavar="TOKEN", help="append this token to every document")
    prep.add_argument("--text-key", default="text", help="the text field of JSONL records and dataset rows")
    prep.add_argument("--workers", type=int, default=None, help="worker processes (default: one per core)")
    prep.set_defaults(handler=_data_prepare)
    check = sub.add_parser("check", help="verify a prepared dataset's files against its manifest (every checksum)")
    check.add_argument("folder")
    check.set_defaults(handler=_data_check)


def _data_prepare(args: argparse.Namespace) -> int:
    from terascale.data import load_tokenizer, prepare

    done = prepare(args.files, args.out, tokenizer=load_tokenizer(args.tokenizer, args.append_eos),
                   workers=args.workers, text_key=args.text_key)  # fmt: skip
    print(f"{done.folder}: {done.tokens:,} tokens in {done.documents:,} documents, {done.shards} shards "
          f"({done.written} written now, {done.tokens_per_second:,.0f} tokens/s)")  # fmt: skip
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from terascale.data import TokenStore

    store = TokenStore(args.folder, verify="full")
    print(f"{store.folder}: {store.num_tokens:,} tokens in {store.num_documents:,} documents, "
          f"{len(store.shards)} shards, every checksum right (tokenizer {store.manifest['tokenizer']})")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``terascale`` argument parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="terascale",
        description="Train PyTorch models far larger than one device's memory.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_run(subparsers)
    _add_env(subparsers)
    _add_plan(subparsers)
    _add_estimate(subparsers)
    _add_consolidate(subparsers)
    _add_elastic_config(subparsers)
    _add_check(subparsers)
    _add_report(subparsers)
    _add_data(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``terascale`` command line on ``argv`` (default ``sys.argv[1:]``).

    Returns the exit code: the launched job's for ``run``, 2 for a usage
    error (reported on stderr as ``terascale: error: ...``).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage errors
        return exc.code if isinstance(exc.code, int) else 2
    handler: _Handler = args.handler
    try:
        return handler(args)
    except ValueError as exc:
        print(f"terascale {args.command}: error: {exc}", file=sys.stderr)
        return 2
