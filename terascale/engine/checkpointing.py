"""``engine.save_checkpoint`` / ``engine.load_checkpoint``: the engine's side of checkpoints.

The model state provides its tensors as spans (``[Note: logical checkpoints]``); this
module adds the rest of the training state (the :class:`TrainState` counters, loss
scaler, LR scheduler, optimizer options, data position, every rank's RNG, the config,
the client's state),
and drives the save protocol of ``[Note: atomic checkpoints]`` over a dedicated gloo
group, which the background thread of an asynchronous save can use while training goes
on over the others.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from terascale.checkpoint.directory import CheckpointDirectory, copy_durably, validate_tag
from terascale.checkpoint.manifest import MANIFEST, CheckpointError, Manifest, dtype_name, parse_dtype
from terascale.checkpoint.reader import CheckpointReader
from terascale.checkpoint.spans import BUFFER, OPTIM, OptimKey, ParamInfo, Slice, SliceMode, Span
from terascale.checkpoint.writer import shard_file_name, snapshot, staging_pool, write_shard
from terascale.comm import ops as comm_ops
from terascale.config import Config
from terascale.engine.checkpoint_layout import CheckpointLayout
from terascale.engine.data import DataPosition
from terascale.engine.loss_scaler import LossScaler
from terascale.engine.model_state import ModelState
from terascale.engine.parallel import ParallelLayout
from terascale.engine.train_state import TrainState
from terascale.offload.aio import AioOptions, AsyncIO
from terascale.offload.swap import BufferPool

logger = logging.getLogger("terascale")

CLIENT_STATE = "client_state.pt"
# Shard files are written once, sequentially, from the staging pool: the engine's
# defaults (16 MiB pieces, 16 in flight) measured as fast as any setting here (4-16 MiB
# pieces, 8-16 in flight: all within 1% of each other, at about 0.9x the raw disk).
_WRITE_OPTIONS = AioOptions()


class Checkpointer:
    """Saves and loads the training state of ``module``: its ``model_state`` (as spans, laid
    out by ``layout``), ``optimizer``, ``train_state``, ``loss_scaler``, ``lr_scheduler``
    and ``data`` position. At most one asynchronous save in flight."""

    def __init__(
        self,
        module: nn.Module,
        model_state: ModelState,
        layout: ParallelLayout,
        optimizer: torch.optim.Optimizer,
        config: Config,
        train_state: TrainState,
        *,
        loss_scaler: LossScaler,
        lr_scheduler: Any,
        data: DataPosition,
    ) -> None:
        self._module, self._state, self._optimizer, self._config = module, model_state, optimizer, config
        self._train, self._loss_scaler, self._scheduler, self._data = train_state, loss_scaler, lr_scheduler, data
        self._group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._job: _SaveJob | None = None  # the background save in flight, if any
        self._error: BaseException | None = None
        self._aio: AsyncIO | None = None
        self._pool: BufferPool | None = None
        # How long the last save kept training waiting: the save call, plus (asynchronous
        # saves) the optimizer step's wait for the write.
        self.last_stall_s = 0.0
        self.layout = CheckpointLayout(module, model_state, layout.dist, layout)

    def _writer(self) -> tuple[AsyncIO, BufferPool]:
        # Kept from save to save: a fresh pool's first touch of its pages costs as much as
        # the copy into it. One save uses them at a time; close() gives them back.
        if self._aio is None:
            self._aio, self._pool = AsyncIO(_WRITE_OPTIONS), staging_pool()
        return self._aio, self._pool

    def close(self) -> None:
        """Finish a save in flight and release the writer's threads and staging buffers."""
        try:
            self.wait()
        finally:
            if self._aio is not None:
                self._aio.close()
            self._aio = self._pool = None

    def coordination_group(self) -> dist.ProcessGroup:
        # Created on the first save, which every rank makes: new_group is collective.
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def write_on_ranks(self, write: Callable[[], None] | None, what: str) -> None:
        """Run ``write`` on the ranks that pass one (the others pass None) and return on
        every rank once all have finished, raising any rank's error on every rank.
        Collective: a folder one rank writes is complete wherever this returns, so a rank
        that reads it next (``from_pretrained``) never sees it half written, and a failed
        write cannot leave the other ranks waiting in their next collective."""
        failure: Exception | None = None
        if write is not None:
            try:
                write()
            except Exception as err:  # noqa: BLE001 - agreed over the group, raised on every rank
                failure = err
        error = None if failure is None else f"rank {dist.get_rank()}: {type(failure).__name__}: {failure}"
        try:
            _raise_if_any(error, self.coordination_group(), what)
        except CheckpointError:
            if failure is not None:
                raise failure from None  # the rank that failed raises its own error, type and trace
            raise

    # -- saving --------------------------------------------------------------------------------

    def save(
        self,
        save_dir: str | Path,
        tag: str | None,
        client_state: dict | None,
        save_latest: bool,
        *,
        asynchronous: bool | None = None,
        mirror_to: str | Path | None = None,
    ) -> str:
        """Write a checkpoint of every rank's state to ``save_dir/<tag>`` (default tag
        ``global_step<N>``) and, with ``save_latest``, point ``save_dir/latest`` at it;
        returns the tag.

        Collective. Each rank writes only its own state, as spans of named parameters, so
        the checkpoint loads on any number of ranks, at any ZeRO stage, offloaded or not.
        The write is atomic: a failure or crash leaves earlier checkpoints and ``latest``
        as they were. ``client_state`` (any picklable dict) comes back from :meth:`load`.
        Asynchronous (``asynchronous``, default ``checkpoint.async``): the call
        only captures what may change (see ``[Note: asynchronous saves]``) and a background
        thread does the rest, collectives included; the next optimizer step waits for the
        write, and the next save, load or ``wait()`` raises its error if it failed.
        ``mirror_to``: once committed, the checkpoint is copied to that directory too
        (``[Note: node-local checkpoints]``), in the background without holding training.
        """
        started = time.perf_counter()
        train = self._train
        self.wait()
        tag = validate_tag(str(tag) if tag is not None else f"global_step{train.global_steps}")
        if not train.is_boundary() and train.micro_steps % train.gradient_accumulation_steps:
            logger.warning("saving checkpoint '%s' inside an accumulation window: its gradients are not saved", tag)
        rank, world = dist.get_rank(), dist.get_world_size()
        group = self.coordination_group()
        directory = CheckpointDirectory(save_dir)
        state, optimizer, module = self._state, self._optimizer, self._module
        layout = self.layout
        described = [s for chunk in state.state_slices(optimizer, SliceMode.DESCRIBE) for s in layout.saved(chunk)]
        buffers = _buffer_slices(module) if layout.saves_buffers else []
        described += buffers
        client = None
        if rank == 0 and client_state is not None:
            client = io.BytesIO()
            torch.save(client_state, client)  # now: the caller may change the dict afterwards
        job = _SaveJob(
            directory=directory, tag=tag, save_latest=save_latest, group=group, described=described,
            info=_RankInfo(rank, world, _rng_state(), _optim_keys(described), layout.params(), _aliases(module),
                           _buffer_infos(module) if layout.saves_buffers else {}),
            manifest=self._manifest(tag) if rank == 0 else None,
            client_state=None if client is None else client.getvalue(),
            mirror=None if mirror_to is None else CheckpointDirectory(mirror_to),
        )  # fmt: skip
        if self._config.checkpoint.async_save if asynchronous is None else asynchronous:
            # [Note: asynchronous saves] Parameters, masters and optimizer state change
            # only in the optimizer step, which waits for the write (before_update), so
            # the background thread writes them from where they live, without a copy,
            # while forward and backward run. Buffers (forward may update them) are
            # copied now; so is state swapped in from NVMe, whose files the step rewrites.
            saving = (layout.saved(chunk) for chunk in state.state_slices(optimizer, SliceMode.SAVE))
            if state.memory().get("nvme", 0) > 0:
                chunks = snapshot(saving)
            else:
                chunks = [s for chunk in saving for s in chunk]
            job.chunks = [chunks + snapshot([buffers])]
            self._job = job
            self._thread = threading.Thread(target=self._run_in_background, args=(job,), name="terascale-checkpoint")
            self._thread.start()
        else:
            job.chunks = _chain((layout.saved(c) for c in state.state_slices(optimizer, SliceMode.SAVE)), buffers)
            self._run(job)
        self.last_stall_s = time.perf_counter() - started
        return tag

    def before_update(self) -> None:
        """Called before the optimizer step changes the state: let a background write of
        it finish first (its error, if any, is raised by the next save, load or wait). A
        copy to the mirror directory reads only the written files and goes on meanwhile."""
        if self._thread is not None and self._job is not None and not self._job.written.is_set():
            started = time.perf_counter()
            self._job.written.wait()
            self.last_stall_s += time.perf_counter() - started

    def wait(self) -> None:
        """Wait for an asynchronous save in flight; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = self._job = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the asynchronous checkpoint save failed: {error}") from error

    def _run_in_background(self, job: _SaveJob) -> None:
        try:
            self._run(job)
        except BaseException as exc:  # surfaces on the next save/load/wait
            self._error = exc
        finally:
            job.written.set()  # a failed write releases the optimizer step too

    def _run(self, job: _SaveJob) -> None:
        """The save protocol of ``[Note: atomic checkpoints]``: agree on the tag, rank 0
        prepares the staging folder, every rank writes its file, rank 0 commits once all
        succeeded; every rank raises the same error otherwise."""
        tag, directory, group, info = job.tag, job.directory, job.group, job.info
        self._validate_tag(tag, group)
        error = None
        if info.rank == 0:
            try:
                directory.prepare(tag)
                if job.client_state is not None:
                    (directory.staging(tag) / CLIENT_STATE).write_bytes(job.client_state)
            except OSError as exc:
                error = f"cannot create '{directory.staging(tag)}': {exc}"
        _raise_if_any(error, group, f"saving checkpoint '{tag}' failed")
        path = directory.staging(tag) / shard_file_name(info.rank, info.world)
        shard = None
        try:
            aio, pool = self._writer()
            shard = write_shard(path, job.described, job.chunks, aio, pool)
        except Exception as exc:
            error = f"rank {info.rank} writing '{path}': {exc}"
        gathered: list[Any] = [None] * info.world if info.rank == 0 else []
        comm_ops.gather_object((shard, info, error), gathered if info.rank == 0 else None, dst=0, group=group)
        result = None
        if info.rank == 0:

            def manifest_json() -> str:
                manifest = job.manifest
                assert manifest is not None
                manifest.files = [s for s, _, _ in gathered]
                for _, i, _ in gathered:  # every pipeline stage's parameters and buffers
                    manifest.params.update(i.params)
                    manifest.aliases.update(i.aliases)
                    manifest.buffers.update(i.buffers)
                manifest.rng = [i.rng for _, i, _ in gathered]
                manifest.optim_keys = {k: v for _, i, _ in gathered for k, v in i.optim_keys.items()}
                return manifest.to_json()

            errors = "; ".join(e for _, _, e in gathered if e) or None
            result = self._commit_or_abort(directory, tag, errors, manifest_json, job.save_latest)
        _raise_if_any(result, group, f"saving checkpoint '{tag}' failed; earlier checkpoints are untouched")
        job.written.set()
        if job.mirror is not None:
            self._mirror(job, path.name)

    def _commit_or_abort(
        self, directory: CheckpointDirectory, tag: str, error: str | None, manifest_json: Callable[[], str], save_latest: bool
    ) -> str | None:
        """(Rank 0, once every rank reported) commit ``tag`` in ``directory`` with the
        manifest ``manifest_json()`` unless a rank failed (``error``); on any failure remove
        the staging folder. Returns the error, if any."""
        if error is None:
            try:
                directory.commit(tag, manifest_json(), save_latest=save_latest)
                self._prune(directory, tag)
            except Exception as exc:
                error = f"committing '{directory.root / tag}': {exc}"
        if error is not None:
            directory.abort(tag)
        return error

    def _prune(self, directory: CheckpointDirectory, tag: str) -> None:
        keep = self._config.checkpoint.keep_last_n
        if keep:
            directory.prune(keep, protect=tag)

    def _mirror(self, job: _SaveJob, file_name: str) -> None:
        """Copy committed checkpoint ``job.tag`` to ``job.mirror`` with the same atomic
        protocol: each rank copies its own file, rank 0 commits the manifest last.

        [Note: node-local checkpoints] With ``checkpoint.local_dir`` the interval saves
        are written to a fast node-local disk (the optimizer step waits only for that) and
        then copied here to the shared ``save_dir``, file by file, by the ranks that wrote
        them. A node lost takes its local copies with it, so resuming looks at both
        directories and loads the newest checkpoint that every rank can read completely
        (``Resilience._newest_complete`` in ``terascale.engine.resilience``).
        """
        tag, source, mirror, group, rank = job.tag, job.directory.root / job.tag, job.mirror, job.group, job.info.rank
        assert mirror is not None
        error = None
        if rank == 0:
            try:
                mirror.prepare(tag)
                if (source / CLIENT_STATE).exists():
                    copy_durably(source / CLIENT_STATE, mirror.staging(tag) / CLIENT_STATE)
            except OSError as exc:
                error = f"cannot create '{mirror.staging(tag)}': {exc}"
        _raise_if_any(error, group, f"copying checkpoint '{tag}' to '{mirror.root}' failed")
        try:
            copy_durably(source / file_name, mirror.staging(tag) / file_name)
        except OSError as exc:
            error = f"rank {rank} copying '{source / file_name}' to '{mirror.staging(tag)}': {exc}"
        errors: list[Any] = [None] * job.info.world
        comm_ops.all_gather_object(errors, error, group=group)
        result = "; ".join(e for e in errors if e) or None
        if rank == 0:
            result = self._commit_or_abort(mirror, tag, result, (source / MANIFEST).read_text, job.save_latest)
        _raise_if_any(result, group, f"copying checkpoint '{tag}' to '{mirror.root}' failed; its local copy is intact")

    def _validate_tag(self, tag: str, group: dist.ProcessGroup) -> None:
        mode = self._config.checkpoint.tag_validation
        if mode == "IGNORE" or dist.get_world_size() == 1:
            return
        tags: list[Any] = [None] * dist.get_world_size()
        comm_ops.all_gather_object(tags, tag, group=group)
        if len(set(tags)) > 1:
            msg = f"checkpoint tags differ between ranks: {sorted(set(tags))}"
            if mode == "FAIL":
                raise ValueError(msg + " (checkpoint.tag_validation is FAIL)")
            logger.warning(msg)

    def _manifest(self, tag: str) -> Manifest:
        extra = {}
        hf_config = getattr(self._module, "config", None)
        if hasattr(hf_config, "to_json_string") and hasattr(self._module, "save_pretrained"):
            extra["hf_config"] = json.loads(hf_config.to_json_string(use_diff=False))
        return Manifest(
            tag=tag,
            world_size=dist.get_world_size(),
            stage=self._config.zero_optimization.stage,
            params={},  # every rank's, merged when the files are written
            aliases={},
            buffers={},
            optim_keys={},
            files=[],
            engine=self._training_record(),
            config=self._config.model_dump(mode="json", by_alias=True, exclude_unset=True),
            extra=extra,
        )

    # -- loading -------------------------------------------------------------------------------

    def load(
        self,
        load_dir: str | Path,
        tag: str | None,
        *,
        load_optimizer_states: bool,
        load_lr_scheduler_states: bool,
        load_module_only: bool,
        data_position: bool = True,
    ) -> tuple[str | None, Any]:
        """Load checkpoint ``load_dir/<tag>`` (default: the one ``latest`` names; ``load_dir``
        may also be the checkpoint folder itself) on this rank's layout, whatever the
        saving one was.

        Collective. Each rank reads just the spans it holds. ``load_module_only`` restores
        only parameters and buffers (optimizer, scheduler, counters, RNG and data position
        are left as they are); ``data_position=False`` leaves the data loader's position as
        it is (a rollback past bad data). Returns ``(path, client_state)``, or ``(None,
        None)`` with a warning when ``load_dir`` has no ``latest`` and no tag was given (as
        DeepSpeed does, so a script can always try to resume).
        """
        self.wait()
        folder = CheckpointDirectory.find(load_dir, tag)
        if folder is None:
            logger.warning("no checkpoint to load: '%s' has no 'latest' file", load_dir)
            return None, None
        with_optim = load_optimizer_states and not load_module_only
        buffers = _persistent_buffers(self._module)
        with CheckpointReader(folder) as reader:
            m = reader.manifest
            _check_fits(folder, m, self.layout.params(), buffers, self.layout.all_names(set(buffers)))
            optim_keys = None
            if with_optim:
                _check_optimizer(folder, m, self._optimizer)
                optim_keys = {
                    k.removeprefix(OPTIM): OptimKey(parse_dtype(v["dtype"]), bool(v["scalar"])) for k, v in m.optim_keys.items()
                }
            for chunk in self._state.state_slices(self._optimizer, SliceMode.LOAD, optim_keys):
                for span, t in chunk:
                    self.layout.read(reader, span, t)
            self.layout.done()
            for name, b in buffers.items():
                reader.read_into(Span(BUFFER, name, 0, b.numel()), b.data)
        if not load_module_only:
            self._restore(m.engine, optimizer=with_optim, scheduler=load_lr_scheduler_states,
                          data_position=data_position)  # fmt: skip
            rank = dist.get_rank()
            if rank < len(m.rng):
                _set_rng_state(m.rng[rank])
        client = folder / CLIENT_STATE
        client_state = torch.load(client, weights_only=False) if client.exists() else {}
        return str(folder), client_state


    # -- the training record -------------------------------------------------------------------

    def _training_record(self) -> dict[str, Any]:
        """What a checkpoint keeps besides tensors, in the manifest's ``engine`` entry: the
        train state's counters (at its top level, as checkpoints always had them), the loss
        scaler, the LR scheduler, the optimizer's options and the data position."""
        scheduler, optimizer = self._scheduler, self._optimizer
        return {
            **self._train.state_dict(),
            "loss_scaler": self._loss_scaler.state_dict(),
            "lr_scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict") else None,
            "optimizer": {
                "type": type(optimizer).__name__,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            },
            "sampler": self._data.state_dict(),
        }

    def _restore(self, record: dict[str, Any], *, optimizer: bool, scheduler: bool, data_position: bool) -> None:
        """Restore :meth:`_training_record`'s ``record``; the optimizer's options, the
        scheduler and the data position only where asked."""
        self._train.load_state_dict(record)
        self._loss_scaler.load_state_dict(record["loss_scaler"])
        if optimizer:
            for group, saved in zip(self._optimizer.param_groups, record["optimizer"]["param_groups"]):
                for k, v in saved.items():
                    group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
        if scheduler and record.get("lr_scheduler") is not None and hasattr(self._scheduler, "load_state_dict"):
            self._scheduler.load_state_dict(record["lr_scheduler"])
        if data_position:
            self._data.load_state_dict(record.get("sampler"))


@dataclass
class _SaveJob:
    """One save, captured at the call: everything the (possibly background) write needs."""

    directory: CheckpointDirectory
    tag: str
    save_latest: bool
    group: dist.ProcessGroup
    described: list[Slice]
    info: _RankInfo
    manifest: Manifest | None
    client_state: bytes | None
    mirror: CheckpointDirectory | None = None  # copied there once committed
    chunks: Any = None  # the values: resident chunks (sync) or one list (async)
    written: threading.Event = field(default_factory=threading.Event)  # committed (or failed)


class _RankInfo:
    """What each rank sends rank 0 for the manifest."""

    def __init__(self, rank: int, world: int, rng: dict, optim_keys: dict, params: dict[str, ParamInfo],
                 aliases: dict[str, list[str]], buffers: dict[str, ParamInfo]) -> None:  # fmt: skip
        self.rank, self.world, self.rng, self.optim_keys = rank, world, rng, optim_keys
        self.params, self.aliases, self.buffers = params, aliases, buffers


def _chain(chunks: Any, last: list[Slice]) -> Any:
    yield from chunks
    yield last


def _raise_if_any(error: str | None, group: dist.ProcessGroup, what: str) -> None:
    """Agree over ``group`` on rank 0's (or any rank's) error; every rank raises it."""
    errors: list[Any] = [None] * dist.get_world_size()
    comm_ops.all_gather_object(errors, error, group=group)
    found = [e for e in errors if e]
    if found:
        raise CheckpointError(f"{what}: {'; '.join(found)}")


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    keys = set(module.state_dict(keep_vars=True))
    return {n: b for n, b in module.named_buffers() if n in keys}


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """A parameter's other names (tied inside this rank's module), by its first name."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {ns[0]: ns[1:] for ns in names.values() if len(ns) > 1}


def _buffer_infos(module: nn.Module) -> dict[str, ParamInfo]:
    return {n: ParamInfo(tuple(b.shape), b.dtype, -1) for n, b in _persistent_buffers(module).items()}


def _buffer_slices(module: nn.Module) -> list[Slice]:
    return [(Span(BUFFER, n, 0, b.numel()), b.detach().reshape(-1)) for n, b in _persistent_buffers(module).items()]


def _optim_keys(described: list[Slice]) -> dict[str, dict]:
    """The optimizer state keys among ``described``: dtype, and whether 0-d (a step count)."""
    keys: dict[str, dict] = {}
    for span, t in described:
        if span.key.startswith(OPTIM) and span.key not in keys:
            keys[span.key] = {"dtype": dtype_name(t.dtype), "scalar": t.dim() == 0}
    return keys


def _check_fits(
    folder: Path, m: Manifest, params: dict[str, ParamInfo], buffers: dict[str, torch.Tensor], model_names: set[str]
) -> None:
    """A clear error when the checkpoint is of another model: names missing, unexpected,
    reshaped. ``params``/``buffers`` are this rank's; ``model_names`` every parameter and
    buffer name of the model (other pipeline stages hold the rest)."""
    mine = {**{n: p.shape for n, p in params.items()}, **{n: tuple(b.shape) for n, b in buffers.items()}}
    saved = {**{n: p.shape for n, p in m.params.items()}, **{n: p.shape for n, p in m.buffers.items()}}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - model_names)
    reshaped = sorted(f"{n}: checkpoint {list(saved[n])}, model {list(mine[n])}" for n in set(mine) & set(saved)
                      if tuple(saved[n]) != tuple(mine[n]))  # fmt: skip
    if missing or unexpected or reshaped:
        def some(names: list[str]) -> str:
            return ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")

        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {some(missing)}")
        if unexpected:
            parts.append(f"unexpected (not in the model): {some(unexpected)}")
        if reshaped:
            parts.append(f"different shapes: {some(reshaped)}")
        raise CheckpointError(f"checkpoint '{folder}' is not of this model; " + "; ".join(parts))


def _check_optimizer(folder: Path, m: Manifest, optimizer: torch.optim.Optimizer) -> None:
    saved = m.engine.get("optimizer", {})
    groups = saved.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint '{folder}' has {len(groups)} optimizer param groups, this optimizer has "
            f"{len(optimizer.param_groups)}; load with load_optimizer_states=False"
        )


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "python": [version, list(mt), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
