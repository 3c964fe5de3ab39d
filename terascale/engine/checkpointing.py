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

import atexit
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from terascale.checkpoint import client_state as client_data
from terascale.checkpoint.directory import CheckpointDirectory, copy_durably, validate_tag, write_atomic
from terascale.checkpoint.lease import LeaseError, LeaseHeldError, LeaseLostError, LeasePolicy, LeaseSet, job_id
from terascale.checkpoint.integrity import content_problem
from terascale.checkpoint.manifest import MANIFEST, CheckpointError, Manifest, parse_dtype
from terascale.checkpoint.reader import CheckpointReader
from terascale.checkpoint.spans import BUFFER, OPTIM, OptimKey, ParamInfo, Slice, SliceMode, Span
from terascale.checkpoint.writer import shard_file_name, snapshot, staging_pool, write_shard
from terascale.comm import ops as comm_ops
from terascale.config import Config
from terascale.engine.checkpoint_layout import CheckpointLayout
from terascale.engine.checkpoint_records import (aliases, buffer_infos, buffer_slices, check_fits, check_optimizer,
                                                 optim_keys, persistent_buffers, rng_state, set_rng_state)
from terascale.engine.data import DataPosition
from terascale.engine.loss_scaler import LossScaler
from terascale.engine.model_state import ModelState
from terascale.engine.parallel import ParallelLayout
from terascale.engine.train_state import TrainState
from terascale.offload.aio import AioOptions, AsyncIO
from terascale.offload.swap import BufferPool

logger = logging.getLogger("terascale")

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
        self._leases: LeaseSet | None = None  # rank 0's ([Note: checkpoint directory lease])
        self._warned_dirs: set[tuple[str, ...]] = set()  # ranks' differing directories, said once each

    def _writer(self) -> tuple[AsyncIO, BufferPool]:
        # Kept from save to save: a fresh pool's first touch of its pages costs as much as
        # the copy into it. One save uses them at a time; close() gives them back.
        if self._aio is None:
            self._aio, self._pool = AsyncIO(_WRITE_OPTIONS), staging_pool()
        return self._aio, self._pool

    def close(self) -> None:
        """Finish a save in flight, release the writer's threads and staging buffers, and
        the directories' leases."""
        try:
            self.wait()
        finally:
            if self._aio is not None:
                self._aio.close()
            self._aio = self._pool = None
            if self._leases is not None:
                self._leases.release()

    def hand_over(self, successor: Checkpointer, keeps_writing: bool) -> None:
        """Close this checkpointer in favour of ``successor`` (a live resize built it over
        the new groups): a save the resize interrupted is given up (the earlier
        checkpoints stand), and this process's leases go to ``successor`` if it still
        writes for the job (``keeps_writing``: rank 0), else are released."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the save's collectives broke with the old groups
            pass
        leases, self._leases = self._leases, None
        self.close()
        if leases is not None and keeps_writing:
            successor._leases = leases
        elif leases is not None:
            leases.release()

    def _lease_set(self) -> LeaseSet | None:
        """(Rank 0) the leases of the directories this job writes; None with leases off."""
        options = self._config.checkpoint.lease
        if self._leases is None and options.enabled and dist.get_rank() == 0:
            self._leases = LeaseSet(job_id(), dist.get_world_size(), LeasePolicy(options.heartbeat_s, options.expiry_s))
            atexit.register(self._leases.release)  # an ended job frees its directories at once
        return self._leases

    def hold(self, *roots: str | Path) -> None:
        """Take this job's lease on each of ``roots`` now (collective): every rank raises
        LeaseHeldError (a CheckpointError) naming the holder if another live job keeps one."""
        error: str | LeaseError | None = None
        leases = self._lease_set()
        if leases is not None:
            try:
                for root in roots:
                    leases.hold(root, pin=True)
            except LeaseError as exc:
                error = exc
            except OSError as exc:
                # A full disk: nothing can be saved now anyway. Training may go on (its saves
                # take the lease once they can write) unless another live job holds it.
                held = next((h for h in map(leases.live_holder, roots) if h is not None), None)
                if held is not None:
                    error = LeaseHeldError(f"'{roots[0]}' is being written by another job: {held.describe()}")
                else:
                    logger.warning("cannot take the lease of %s now (%s); the next save takes it", roots[0], exc)
        _raise_if_any(error, self.coordination_group(), "cannot write checkpoints")

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
        as they were. ``client_state`` (a dict of data: ``[Note: client state as data]``)
        comes back from :meth:`load`; one that is not data is a ValueError here, on every
        rank, before anything is written.
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
        directory = CheckpointDirectory(self._rank0_dir(save_dir, "save_checkpoint"))
        state, optimizer, module = self._state, self._optimizer, self._module
        layout = self.layout
        described = [s for chunk in state.state_slices(optimizer, SliceMode.DESCRIBE) for s in layout.saved(chunk)]
        buffers = buffer_slices(module) if layout.saves_buffers else []
        described += buffers
        client = self._client_files(client_state if rank == 0 else None, tag, group)
        job = _SaveJob(
            directory=directory, tag=tag, save_latest=save_latest, group=group, described=described,
            info=_RankInfo(rank, world, rng_state(), optim_keys(described), layout.params(), aliases(module),
                           buffer_infos(module) if layout.saves_buffers else {}),
            manifest=self._manifest(tag) if rank == 0 else None,
            client_state=client,
            mirror=None if mirror_to is None else CheckpointDirectory(mirror_to),
        )  # fmt: skip
        if job.manifest is not None and client is not None:
            job.manifest.client_files = client_data.manifest_entries(client)
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

    def _client_files(self, client_state: dict | None, tag: str, group: dist.ProcessGroup) -> dict[str, bytes] | None:
        """(Collective) rank 0's ``client_state`` as the checkpoint's files, serialised now
        (the caller may change the dict or its tensors afterwards). One that is not data
        raises its ValueError on rank 0 and on every other rank, which would otherwise go
        on into the save's collectives without it."""
        files, failure = None, None
        if client_state is not None:
            try:
                files = client_data.to_files(client_state)
            except ValueError as exc:
                failure = exc
        if dist.get_world_size() > 1:
            try:
                _raise_if_any(None if failure is None else str(failure), group, f"saving checkpoint '{tag}' failed")
            except CheckpointError:
                if failure is None:
                    raise
        if failure is not None:
            raise failure
        return files

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
            if isinstance(error, LeaseError):
                raise error  # as it is: a job that lost its directory must stop, not retry
            raise CheckpointError(f"the asynchronous checkpoint save failed: {error}") from error

    def _run_in_background(self, job: _SaveJob) -> None:
        try:
            self._run(job)
        except BaseException as exc:  # surfaces on the next save/load/wait
            self._error = exc
            if job.info.rank == 0:  # said now too: the next save may be far off
                logger.warning("the checkpoint save of '%s' failed: %s", job.tag, exc)
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
                if (leases := self._lease_set()) is not None:
                    leases.hold(directory.root, step=self._train.global_steps)
                directory.prepare(tag)
                for name, data in (job.client_state or {}).items():
                    write_atomic(directory.staging(tag) / name, data)
            except CheckpointError as exc:
                error = exc
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
    ) -> str | LeaseError | None:
        """(Rank 0, once every rank reported) commit ``tag`` in ``directory`` with the
        manifest ``manifest_json()`` unless a rank failed (``error``); on any failure remove
        the staging folder. Returns the error, if any."""
        failure: str | LeaseError | None = error
        if error is None:
            try:
                if self._leases is not None:
                    self._leases.check(directory.root)  # not taken over while the files were written
                directory.commit(tag, manifest_json(), save_latest=save_latest)
                self._prune(directory, tag)
            except LeaseError as exc:
                failure = exc
            except Exception as exc:
                failure = f"committing '{directory.root / tag}': {exc}"
        if failure is not None:
            directory.abort(tag)
        return failure

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
                if (leases := self._lease_set()) is not None:
                    leases.hold(mirror.root, step=self._train.global_steps)
                mirror.prepare(tag)
                for name in client_data.FILES:
                    if (source / name).exists():
                        copy_durably(source / name, mirror.staging(tag) / name)
            except CheckpointError as exc:
                error = exc
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

    def _rank0_dir(self, path: str | Path, call: str) -> str | Path:
        """(Collective) the directory every rank of this save or load uses: ``path``, or
        rank 0's where the ranks passed different ones.

        [Note: ranks that pass different directories]
        A checkpoint is one folder that rank 0 prepares and commits, with one file per rank
        (``[Note: atomic checkpoints]``). Some scripts name that folder on each rank (DeepSpeed's
        HelloDeepSpeed example: a timestamp and a random id per rank, and only rank 0 creates
        it), and DeepSpeed writes each rank's files where that rank said. Here a rank that
        passes a directory other than rank 0's writes into rank 0's instead, so the
        checkpoint is whole there, and rank 0 warns once, naming the other ranks' directories;
        a load does the same, so such a script resumes whether it passes rank 0's directory on
        every rank or each rank its own again. Paths are compared absolute (a relative one
        from each rank's working directory), and a rank uses rank 0's absolute path, which
        must be reachable from it (a shared filesystem mounted at the same place)."""
        world = dist.get_world_size()
        if world == 1:
            return path
        paths: list[Any] = [None] * world
        comm_ops.all_gather_object(paths, os.path.abspath(path), group=self.coordination_group())
        if len(set(paths)) == 1:
            return path
        others = tuple(f"rank {r}: '{p}'" for r, p in enumerate(paths) if p != paths[0])
        if dist.get_rank() == 0 and (call, paths[0], *others) not in self._warned_dirs:
            self._warned_dirs.add((call, paths[0], *others))
            logger.warning(
                "%s: the ranks passed different directories; every rank uses rank 0's '%s' (passed by the "
                "others: %s), so the checkpoint is one whole folder there", call, paths[0], ", ".join(others),
            )
        return paths[0]

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
            engine=self.training_record(),
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
        verify_content: bool | None = None,
        read_client_state: bool = False,
        allow_pickled_client_state: bool | None = None,
    ) -> tuple[str | None, Any]:
        """Load checkpoint ``load_dir/<tag>`` (default: the one ``latest`` names; ``load_dir``
        may also be the checkpoint folder itself) on this rank's layout, whatever the
        saving one was.

        Collective. Each rank reads just the spans it holds. ``load_module_only`` restores
        only parameters and buffers (optimizer, scheduler, counters, RNG and data position
        are left as they are); ``data_position=False`` leaves the data loader's position as
        it is (a rollback past bad data). ``verify_content`` (default
        ``checkpoint.verify_content``): first compare the files' checksums, each rank a part
        of the files, and raise CheckpointError naming a corrupted one on every rank
        (``[Note: checkpoint checksums]``). ``read_client_state``: read the client state too
        (else it is returned as None and its files are not opened); before anything is
        loaded, so a checkpoint whose client state is refused changes nothing. A pickled one
        (checkpoints before ``[Note: client state as data]``) is refused unless
        ``allow_pickled_client_state`` (default ``checkpoint.allow_pickled_client_state``).
        Returns ``(path, client_state)``, or ``(None, None)`` with a warning when
        ``load_dir`` has no ``latest`` and no tag was given (as DeepSpeed does, so a script
        can always try to resume).
        """
        self.wait()
        folder = CheckpointDirectory.find(self._rank0_dir(load_dir, "load_checkpoint"), tag)
        if folder is None:
            logger.warning("no checkpoint to load: '%s' has no 'latest' file", load_dir)
            return None, None
        with_optim = load_optimizer_states and not load_module_only
        buffers = persistent_buffers(self._module)
        with CheckpointReader(folder) as reader:
            m = reader.manifest
            if self._config.checkpoint.verify_content if verify_content is None else verify_content:
                self._verify_content(folder, m)
            check_fits(folder, m, self.layout.params(), buffers, self.layout.all_names(set(buffers)))
            _note_sequence_parallel(m, self._config.sp_size)
            client = self._client_state(folder, m, allow_pickled_client_state) if read_client_state else None
            saved_keys = None
            if with_optim:
                check_optimizer(folder, m, self._optimizer)
                saved_keys = {
                    k.removeprefix(OPTIM): OptimKey(parse_dtype(v["dtype"]), bool(v["scalar"])) for k, v in m.optim_keys.items()
                }
            for chunk in self._state.state_slices(self._optimizer, SliceMode.LOAD, saved_keys):
                for span, t in chunk:
                    self.layout.read(reader, span, t)
            self.layout.done()
            if with_optim:
                self.layout.rank_local_dropped(reader)
            for name, b in buffers.items():
                reader.read_into(Span(BUFFER, name, 0, b.numel()), b.data)
        if not load_module_only:
            self.restore_record(m.engine, optimizer=with_optim, scheduler=load_lr_scheduler_states,
                          data_position=data_position)  # fmt: skip
            rank = dist.get_rank()
            if rank < len(m.rng):
                set_rng_state(m.rng[rank])
        return str(folder), client


    def _client_state(self, folder: Path, m: Manifest, allow_pickled: bool | None) -> Any:
        """The client state saved in ``folder`` ({} when none). A pickled one, as
        checkpoints before ``[Note: client state as data]`` hold it, only when allowed:
        unpickling runs whatever code the file names."""
        state = client_data.read(folder, m.client_files)
        if state is not None:
            return state
        pickled = folder / client_data.PICKLED_FILE
        if not pickled.exists():
            return {}
        if not (self._config.checkpoint.allow_pickled_client_state if allow_pickled is None else allow_pickled):
            raise CheckpointError(
                f"checkpoint '{folder}' holds its client state as a pickle ({client_data.PICKLED_FILE}), and pickled "
                "client state can run arbitrary code when loaded; pass allow_pickled_client_state=True to "
                "engine.load_checkpoint (or set checkpoint.allow_pickled_client_state in the config) only for a "
                "checkpoint you trust"
            )
        return torch.load(pickled, weights_only=False)

    def _verify_content(self, folder: Path, m: Manifest) -> None:
        """Compare this rank's part of ``folder``'s files with their checksums; every rank
        raises if any part differs (collective: ``[Note: checkpoint checksums]``)."""
        if all(f.checksum is None for f in m.files):  # an older checkpoint: the same on every rank
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        problem = content_problem(folder, m.files[rank::world])
        _raise_if_any(problem, self.coordination_group(), f"cannot load checkpoint '{folder}' (load an earlier one)")

    # -- the training record -------------------------------------------------------------------

    def training_record(self) -> dict[str, Any]:
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
                # Tensor options (the 1-bit optimizers' exp_avg_mask) are the script's, set
                # again by it, as DeepSpeed keeps the one the script passes over a loaded one.
                "param_groups": [{k: v for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)}
                                 for g in optimizer.param_groups],
            },
            "sampler": self._data.state_dict(),
        }

    def restore_record(self, record: dict[str, Any], *, optimizer: bool, scheduler: bool, data_position: bool) -> None:
        """Restore :meth:`training_record`'s ``record``; the optimizer's options, the
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
    client_state: dict[str, bytes] | None  # rank 0's client-state files, by name
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


def _raise_if_any(error: str | LeaseError | None, group: dist.ProcessGroup, what: str) -> None:
    """Agree over ``group`` on rank 0's (or any rank's) error; every rank raises it. A
    LeaseError stays one everywhere (its own class): a job refused its directory stops,
    where a failed write may be retried."""
    sent = None if error is None else (type(error).__name__ if isinstance(error, LeaseError) else None, str(error))
    errors: list[Any] = [None] * dist.get_world_size()
    comm_ops.all_gather_object(errors, sent, group=group)
    found = [e for e in errors if e]
    if found:
        lease = next((kind for kind, _ in found if kind), None)
        kind = {c.__name__: c for c in (LeaseError, LeaseHeldError, LeaseLostError)}.get(lease or "", CheckpointError)
        raise kind(f"{what}: {'; '.join(text for _, text in found)}")


def _note_sequence_parallel(m: Manifest, sp: int) -> None:
    """Say when a checkpoint saved at another sequence-parallel size loads: its states are
    not split by sequence (every rank of a sequence group holds the same parameters, sharded
    over all ranks like data-parallel ones: [Note: sequence-parallel groups]), so they
    reshard onto this layout as they would across data-parallel sizes."""
    config = m.config or {}
    saved = max(int(config.get("sequence_parallel_size", 1)), int((config.get("sequence_parallel") or {}).get("size", 1)))
    if saved != sp and dist.get_rank() == 0:
        logger.info(
            "checkpoint '%s' was saved at sequence-parallel size %d and loads at %d: model and optimizer states are "
            "not split by sequence, so they reshard over this run's %d rank(s) like data-parallel states",
            m.tag, saved, sp, dist.get_world_size(),
        )
