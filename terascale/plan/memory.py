"""Memory per rank of one plan, by category and tier: the numbers the planner checks.

[Note: predicted peak memory]
A plan's memory per rank is a list of parts, each a category on a tier (device, host or
NVMe). Model states follow ZeRO's formulas ([Note: memory formulas] in
``terascale.zero.estimate``, with the optimizer's own bytes per parameter); what the
formulas leave out is what makes a prediction of the *peak* hold:

- runtime: the process as it is at plan time (Python, torch, gloo, data) without the
  model's tensors, which the engine replaces by its own flat buffers;
- working set: at stages 2-3 the full gradient buffers of the groups whose reduction is
  in flight (one group without ``overlap_comm`` or where an NVMe tier maps large blocks,
  up to ``reduce_bucket_size`` elements otherwise) and one spare; at stage 3 the gathered groups
  (with the default ``stage3_max_reuse_distance`` every group gathered in forward stays
  for backward, within ``stage3_max_live_parameters``; with a short distance, or shards
  fetched from NVMe, the group in use, the next and the prefetch window); the NVMe tiers'
  host buffers (``buffer_count`` optimizer runs, or as many as there are runs; parameter
  shards; gradient shards); during the optimizer step the fp32 gradients of each run
  ([Note: master pieces]);
- activations: the measured bytes per sample ([Note: the model's profile]) times the
  micro-batch, for the policy (``blocks``: every block's input plus one block's own
  while it is recomputed). Backward holds them while it makes tensors of its own: about
  ``LOSS_BACKWARD`` times what the forward keeps outside the blocks (the logits and the
  loss: their gradients in two dtypes), or with checkpointing the larger of
  ``RECOMPUTE_LOSS`` times that and ``RECOMPUTE_BLOCK`` blocks' worth;
- the host allocator: glibc serves blocks under 32 MiB from its heap, which keeps what is
  freed for reuse. Transients of that size that come one after another (each optimizer
  run's fp32 gradients) then add up instead of reusing one block, and the heap keeps
  ``SLACK`` of the parameters' bytes from building the flat buffers, plus
  ``SLACK_BYTES`` for the first step's fixed costs. With an NVMe tier that maps large
  blocks ([Note: host memory with an NVMe tier]) only the fixed costs remain. With N > 1
  ranks the collectives' transients (receive buffers of reduce-scatters, gathers) leave
  ``COMM_SLACK`` x (N-1)/N of the parameters' bytes on top. At stage 1 with the
  optimizer on NVMe the end of the window holds ``STAGE1_NVME`` of the rank's share of
  the gradients besides (measured, mechanism not pinned down).

The constants were fitted on 46 measured runs of the GPTs of ``bench/planner.py``
(16.8M and 109M parameters; stages 0-3; in memory and on NVMe; 1 and 2 ranks;
micro-batches 1-16; with and without checkpointing). In ``bench/planner.py``'s seven
cases (``bench/RESULTS.md``, issue 32) the chosen plans came within 0.94-1.07 of the
measured peak and the hand-written configs within 0.94-1.05. Stage 3 with parameters and
optimizer on NVMe came out at 0.72-0.86 until the engine trimmed the heap after its first
steps (``ShardedState.step``): the model's full tensors, built before ``initialize`` in
glibc's heap, leave holes there that the steps' small transients spread over. With the
trims, 0.98-1.01 at a ``sub_group_size`` of 1e6 (109M and 180M, one rank); at 4e6 the
holes refill between trims (0.94 by step 12, towards 0.90): not modelled.

The peak is the runtime plus the model states plus the larger of the two phases' working
sets: forward and backward (activations, gathered groups, gradient buffers) or the
optimizer step (fp32 gradients of the runs); in the heap, with checkpointing, the two add
up. On a machine without an accelerator the device's parts are host memory; on one with
an accelerator the device's parts are its memory (the caching allocator reuses blocks, so
only the largest step transient counts there), not validated on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from terascale.plan.profile import ModelProfile
from terascale.zero.estimate import MASTER_BYTES, model_state_bytes
from terascale.zero.host import BOUNDED_HOST_MIN_NVME_BYTES
from terascale.zero.masters import NVME_RUN_SPLIT_NUMEL, RUN_SPLIT_NUMEL

CATEGORIES = ("runtime", "parameters", "gradients", "optimizer states", "activations", "working set")
TIERS = ("device", "host", "nvme")
# Calibrated on bench/planner.py's GPTs (16.8M and 109M parameters, stages 0-3, offload,
# 1-2 ranks, micro-batches 1-16): see [Note: predicted peak memory].
LOSS_BACKWARD = 3.0  # backward's own tensors, in units of what the forward keeps outside the blocks
RECOMPUTE_LOSS = 1.4  # the same with checkpointed blocks (their recompute comes after the loss's)
HELD_GROUPS = 2  # terascale.zero.early_step.HELD_GROUPS
RECOMPUTE_BLOCK = 2.0  # a recomputed block's activations and their gradients, in units of one block's
SLACK = 0.28  # of the parameters' bytes in compute dtype: what the heap keeps from building the flat buffers
SLACK_BYTES = 20 << 20  # the first step's fixed costs (autograd, the optimizer's kernels' buffers)
COMM_SLACK = 0.6  # of the parameters' bytes x (N-1)/N: what the collectives' transients leave in the heap
STAGE1_NVME = 0.6  # of this rank's share of the gradients: held at stage 1's window end with an NVMe optimizer
HEAP_THRESHOLD = 32 << 20  # glibc's largest dynamic mmap threshold: smaller blocks come from the heap


@dataclass(frozen=True)
class Part:
    """``bytes`` of ``category`` on ``tier`` per rank; ``what`` says what they are."""

    category: str
    tier: str
    bytes: float
    what: str


@dataclass(frozen=True)
class Knobs:
    """The config's settings that size a plan's memory besides its choices."""

    reduce_bucket: int = 500_000_000
    overlap_comm: bool | None = None  # None: the stage's default (on at stage 3)
    prefetch: int = 50_000_000
    max_live: int = 1_000_000_000
    max_reuse: int = 1_000_000_000
    persistence: int = 100_000
    sub_group: int = 1_000_000_000
    opt_buffers: int = 4
    param_buffers: int = 5
    max_in_cpu: int = 1_000_000_000
    accum_bytes: int | None = None  # data_types.grad_accum_dtype, if set
    state_bytes: float = 8.0  # optimizer state per parameter besides the master
    master_bytes: int = MASTER_BYTES  # 2 with bf16.bf16_master_weights_and_grads ([Note: bf16 masters and optimizer states])
    optimizer: str = "Adam"
    # The config lets an NVMe optimizer step under backward with one micro-step a window
    # ([Note: the optimizer step under backward]): final gradient shards go to their runs,
    # never to disk, and at most HELD_GROUPS groups of them wait in memory.
    early_step: bool = False
    # offload_optimizer.overlap_step ([Note: the overlapped host step]): the step holds a
    # second set of gradient shards (or swap files) and stages the new parameters.
    overlap_step: bool = False
    hpz: int = 1  # zero_hpz_partition_size: stage 3 keeps a secondary partition over this many ranks
    mirror_copies: int = 0  # live elasticity: host copies of the rank's masters and optimizer state


@dataclass(frozen=True)
class Shape:
    """A plan's choices that size memory."""

    stage: int
    offload_optimizer: str  # none | cpu | nvme
    offload_param: str  # none | cpu | nvme
    micro_batch: int
    policy: str  # activation checkpointing: none | blocks | every_n | selective


def runs(groups: list[int], sub_group: int, split: int) -> list[int]:
    """Elements of each optimizer run over shards of ``groups`` elements: pieces of at most
    ``sub_group`` elements, a run ending before it would exceed ``sub_group`` and at a
    group's end once it holds ``split`` ([Note: master pieces])."""
    out: list[int] = []
    run, last = 0, -1
    sub_group = max(1, sub_group)
    for g, numel in enumerate(groups):
        for lo in range(0, numel, sub_group):
            piece = min(sub_group, numel - lo)
            if run and (run + piece > sub_group or (last != g and run >= split)):
                out.append(run)
                run = 0
            run += piece
            last = g
    return out + ([run] if run else [])


def largest_run(groups: list[int], sub_group: int, split: int) -> int:
    """Elements of the largest run of :func:`runs`."""
    return max(runs(groups, sub_group, split), default=0)


def heap_held(sizes: list[float]) -> float:
    """Bytes the host allocator holds for transients of these sizes that come and go one
    after another: the heap keeps the ones below its mapping threshold, a mapped one is
    returned at once (so only the largest of those counts)."""
    small = sum(b for b in sizes if b < HEAP_THRESHOLD)
    return small + max((b for b in sizes if b >= HEAP_THRESHOLD), default=0.0)


def activation_bytes(profile: ModelProfile, shape: Shape, every_n: int = 2) -> float:
    """Bytes the forward keeps for backward at ``shape``'s micro-batch and policy."""
    a = profile.activations
    if a.source == "unknown":
        return 0.0
    if shape.policy == "none" or a.blocks == 0:
        per = a.per_sample
    elif shape.policy == "every_n":
        checked = -(-a.blocks // every_n)
        inside = a.per_sample - a.outside
        per = a.outside + inside * (1 - checked / a.blocks) + a.block_inputs * checked / a.blocks + a.largest_block
    else:  # blocks, selective (kept as blocks: the most selective keeps is bounded by what it recomputes)
        per = a.outside + a.block_inputs + a.largest_block
    return per * shape.micro_batch


def backward_bytes(profile: ModelProfile, shape: Shape) -> float:
    """What backward holds beside the saved activations (see [Note: predicted peak memory])."""
    a = profile.activations
    if a.source == "unknown":
        return 0.0
    if shape.policy == "none" or a.blocks == 0:
        return LOSS_BACKWARD * a.outside * shape.micro_batch
    return max(RECOMPUTE_LOSS * a.outside, RECOMPUTE_BLOCK * a.largest_block) * shape.micro_batch


def predict(profile: ModelProfile, shape: Shape, knobs: Knobs, world: int, runtime: float, has_device: bool) -> list[Part]:
    """The parts of ``shape``'s memory per rank (see [Note: predicted peak memory]).

    ``runtime``: the host bytes of the process without the model's tensors.
    """
    s, n, c = shape.stage, max(1, world), profile.compute_bytes
    psi, trainable = profile.numel, profile.trainable
    dev = "device"
    grad_bytes = knobs.accum_bytes or c
    # The master is shared with a parameter of its dtype that is not offloaded ([Note: master pieces]).
    master = 0 if (c == knobs.master_bytes and shape.offload_optimizer == "none") else knobs.master_bytes
    per = master + knobs.state_bytes
    states = model_state_bytes(psi, n, s, state_bytes=knobs.state_bytes, param_bytes=c, master_bytes=master,
                               grad_bytes=knobs.accum_bytes if s == 0 else grad_bytes, trainable=trainable)  # fmt: skip
    parts = [Part("runtime", "host", runtime, "the process at plan time without the model's tensors")]
    groups = profile.group_numels(trainable_only=True)
    top = max(groups, default=0)
    nvme_params = s == 3 and shape.offload_param == "nvme"
    # Parameters.
    dyn, persistent = profile.stage3_groups(knobs.persistence) if s == 3 else ([], 0)
    shard = in_cpu = 0.0
    largest = max(dyn, default=0)
    if s < 3:
        parts.append(Part("parameters", dev, states.params, "full parameters (flat buffers)"))
    else:
        shard = model_state_bytes(sum(dyn), n, 3, param_bytes=c).params
        parts.append(Part("parameters", dev, persistent * c, "persistent small parameters (full)"))
        if nvme_params:
            in_cpu = min(shard, knobs.max_in_cpu * c)
            parts.append(Part("parameters", "host", in_cpu, "shards kept in host memory (max_in_cpu)"))
            parts.append(Part("parameters", "nvme", shard - in_cpu, "parameter shards in swap files"))
            # The step stages each group's pieces in a pool buffer even where the shard stays in memory.
            count = min(max(2, knobs.param_buffers), len(dyn)) if shard > in_cpu else 2
            parts.append(Part("working set", "host", count * largest * c / n,
                              "offload_param buffers (buffer_count x largest shard)"))  # fmt: skip
        else:
            parts.append(Part("parameters", "host" if shape.offload_param == "cpu" else dev, shard, "parameter shards"))
        if knobs.hpz > 1:  # [Note: ZeRO++ gathers]: kept on the device whatever the shards' tier
            parts.append(Part("parameters", dev, sum(dyn) * c / min(knobs.hpz, n),
                              "hpZ secondary partition (zero_hpz_partition_size)"))  # fmt: skip
    # Optimizer runs.
    shards = [g // n for g in groups] if s >= 1 else groups
    split = NVME_RUN_SPLIT_NUMEL if shape.offload_optimizer == "nvme" else RUN_SPLIT_NUMEL
    run_sizes = runs(shards, knobs.sub_group, split) if s >= 1 else []
    run = max(run_sizes, default=0)
    state_bytes = states.optimizer
    nvme_states = state_bytes if shape.offload_optimizer == "nvme" else 0.0
    # Gradients.
    inflight = 0.0
    grads_swapped = False
    if s == 0:
        parts.append(Part("gradients", dev, states.grads, "fp32 accumulation buffer"))
    elif s == 1:
        parts.append(Part("gradients", dev, states.grads, "full gradient buffers"))
    else:
        grad_shards = states.grads
        tier = dev
        if shape.offload_optimizer == "nvme" and knobs.early_step:
            grad_shards = min(grad_shards, HELD_GROUPS * top * grad_bytes / n)
        elif shape.offload_optimizer == "nvme" and grad_shards > knobs.opt_buffers * run * per:
            tier = "nvme"  # [Note: gradient swapping]
            nvme_states += grad_shards
            grads_swapped = True
            parts.append(Part("working set", "host", 3 * top * grad_bytes / n, "gradient swap buffers"))
        parts.append(Part("gradients", tier, grad_shards, "gradient shards"))
    if shape.offload_optimizer == "nvme":
        parts.append(Part("optimizer states", "nvme", state_bytes,
                          f"fp32 masters and {knobs.optimizer} state in swap files"))  # fmt: skip
        parts.append(Part("working set", "host", min(max(1, knobs.opt_buffers), len(run_sizes)) * run * per,
                          "offload_optimizer buffers (buffer_count x largest run)"))  # fmt: skip
    else:
        tier = "host" if shape.offload_optimizer == "cpu" else dev
        parts.append(Part("optimizer states", tier, state_bytes, f"fp32 masters and {knobs.optimizer} state"))
    if knobs.mirror_copies:  # [Note: in-memory redundancy]: always host memory
        parts.append(Part("working set", "host", knobs.mirror_copies * state_bytes,
                          "live elasticity: two own snapshots of the masters and optimizer state, two of a peer's"))
    if has_device and shape.offload_optimizer != "none" and s >= 1 and not knobs.overlap_step:
        # [Note: the host step's transfers]: two staging buffers each way, and the gradient
        # shards kept in memory copied down under backward into a buffer per run.
        parts.append(Part("working set", "host", 2 * run * (grad_bytes + c), "the host step's staging buffers"))
        if not grads_swapped and not (knobs.early_step and shape.offload_optimizer == "nvme"):
            parts.append(Part("working set", "host", trainable * grad_bytes / n,
                              "the host step's gradients, copied down under backward"))  # fmt: skip
    if knobs.overlap_step and shape.offload_optimizer != "none" and s >= 1:
        # [Note: the overlapped host step]: the step holds the window's gradients (a second
        # set of swap files where they go to disk) and writes new parameters into a staging
        # buffer, or into second swap files for shards on disk (through two run buffers).
        if grads_swapped:
            parts.append(Part("gradients", "nvme", states.grads, "the overlapped step's second gradient files"))
        else:
            parts.append(Part("working set", "host", trainable * grad_bytes / n,
                              "the overlapped step's gradients (taken over, or a copy)"))  # fmt: skip
        on_disk = shard - in_cpu if nvme_params else 0.0
        staged = max(0.0, trainable * c / n - on_disk)
        parts.append(Part("working set", "host", staged, "the overlapped step's staged parameters"))
        if on_disk:
            parts.append(Part("parameters", "nvme", on_disk, "the overlapped step's second parameter files"))
            parts.append(Part("working set", "host", 2 * run * c, "the overlapped step's parameter write buffers"))
    # [Note: host memory with an NVMe tier]: large blocks are mapped and returned at once.
    nvme_tier = shape.offload_optimizer == "nvme" or nvme_params
    mapped = nvme_tier and (has_device or nvme_states >= BOUNDED_HOST_MIN_NVME_BYTES)
    if s >= 2:
        overlap = knobs.overlap_comm if knobs.overlap_comm is not None else s == 3
        # Up to the bucket waits its reduction; where large blocks are mapped (an NVMe tier)
        # each buffer goes back as its reduction ends, instead of staying in the heap.
        held = min(trainable, max(knobs.reduce_bucket, top)) if overlap and not mapped else top
        inflight = (held + top) * c
        parts.append(Part("working set", dev, inflight, "full gradient buffers in flight and one spare"))
    # What forward and backward hold on top.
    acts = activation_bytes(profile, shape)
    parts.append(Part("activations", dev, acts, f"kept for backward ({shape.policy}, micro-batch {shape.micro_batch})"))
    gathered = 0.0
    if s == 3:
        if knobs.max_reuse >= sum(dyn) - largest and not nvme_params:
            gathered = min(sum(dyn), knobs.max_live + largest) * c  # forward's groups kept for backward
        else:
            gathered = min(sum(dyn), 2 * largest + min(knobs.prefetch, sum(dyn))) * c
        parts.append(Part("working set", dev, gathered, "gathered parameter groups (stage 3)"))
    backward = backward_bytes(profile, shape)
    # The step's fp32 gradients of each run; the two phases do not overlap, so only what the
    # step holds beyond backward's working set counts.
    step = 0.0
    if s >= 1 and shape.offload_optimizer == "none":
        sizes = [4.0 * r for r in run_sizes]
        step = max(sizes, default=0.0) if has_device or mapped else heap_held(sizes)
    # In the heap, a recompute's small transients do not fit the holes the step left: they add up.
    reuse = 0.0 if (shape.policy != "none" and not (has_device or mapped)) else acts + gathered + backward + inflight
    transient = backward + max(0.0, step - reuse)
    if transient:
        which = "backward's own gradients" if transient == backward else "fp32 gradients of the optimizer runs"
        parts.append(Part("working set", dev, transient, f"transient: {which}"))
    if s == 1 and shape.offload_optimizer == "nvme":
        parts.append(Part("working set", dev, STAGE1_NVME * trainable * c / n,
                          "stage 1's window end with the optimizer on NVMe (measured)"))  # fmt: skip
    slack = SLACK_BYTES + (0.0 if mapped else SLACK * psi * c) + COMM_SLACK * (n - 1) / n * psi * c
    parts.append(Part("working set", "host", slack, "host allocator's retention"))
    if not has_device:
        parts = [Part(p.category, "host", p.bytes, p.what) if p.tier == dev else p for p in parts]
    return parts


def totals(parts: list[Part]) -> dict[str, float]:
    """Bytes per tier."""
    out = dict.fromkeys(TIERS, 0.0)
    for p in parts:
        out[p.tier] += p.bytes
    return out


def by_category(parts: list[Part], tier: str | None = None) -> dict[str, float]:
    """Bytes per category (on ``tier`` only, if given)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for p in parts:
        if tier is None or p.tier == tier:
            out[p.category] += p.bytes
    return out
