"""``zero.Init``: build a model already partitioned, so no rank ever holds all of it.

[Note: partitioned construction]
Inside ``Init``, a parameter is partitioned the moment a module registers it: rank 0's
values are broadcast, each rank keeps its 1/N slice of the flattened parameter (padded,
in the target dtype), and the parameter's data becomes an empty tensor. Initialisation
code runs after registration (``reset_parameters``, a parent's ``self.apply(init_fn)``,
``weight.data.normal_()``), so while the context is active a ``TorchFunctionMode`` (an
official torch extension point: nothing is patched) intercepts every torch call that
touches a partitioned parameter: it gathers that parameter, runs the call on the full
tensor, and partitions the result again, taking rank 0's values. Shape queries answer
with the full shape. At most one parameter is full at a time, so construction peaks at
the shards (2Ψ/N bytes in bf16) plus one parameter.

``remote_device`` says where the slices wait for ``terascale.initialize``: on the
device (``none``), in host memory (``cpu``) or in a swap file on NVMe (``nvme``, under
``offload_param.nvme_path`` of the config). With ``nvme`` construction holds one
parameter at a time whatever the model's size, so a model whose parameters alone exceed
host memory can be built; DeepSpeed's default applies: the config's
``offload_param.device`` when ``remote_device`` is not given.

``terascale.initialize`` then builds its flat groups from these slices, one parameter
at a time (:meth:`Init.full_value`), and takes the parameters over from the context.
Every rank must build the same model (the calls above are collectives).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from terascale.comm import all_gather_flat, init_distributed, ops
from terascale.config import Config
from terascale.offload.aio import AioOptions, AsyncIO
from terascale.offload.probe import aio_options
from terascale.offload.swap import SwapDirectory, round_up
from terascale.zero.gather import owner_of, register_owner, unregister
from terascale.zero.param_attributes import Partition, ZeroParamStatus, expose, withdraw
from terascale.zero.host import map_large_allocations, return_freed_host_memory


@dataclass
class _Slice:
    shape: torch.Size
    shard: torch.Tensor  # this rank's elements of the flattened, padded parameter (empty on NVMe)
    offset: int | None = None  # where the elements are in the NVMe slice file
    shard_numel: int = 0
    index: int = 0  # the parameter's number in partition order (``param.ds_id``)
    gathered: bool = False  # full inside GatheredParameters (``param.ds_status``)


class _NvmeSlices:
    """This rank's parameter slices in one swap file, each at a fixed aligned offset
    (a repartitioned parameter is written over its old slice)."""

    def __init__(self, nvme_path: str, rank: int, aio: AioOptions) -> None:
        self.directory = SwapDirectory(nvme_path, "init", rank)
        self.file = self.directory.file("slices")
        self.aio = AsyncIO(aio, trace_name="terascale::swap")
        self._end = 0
        self.live = 0
        # The directory goes when the last slice is taken over or the Init is dropped.
        self._cleanup = weakref.finalize(self, _NvmeSlices._remove, self.aio, self.directory)

    def store(self, shard: torch.Tensor, offset: int | None) -> int:
        if offset is None:
            offset, self._end = self._end, round_up(self._end + shard.numel() * shard.element_size())
            self.live += 1
        self.aio.sync_write(shard.cpu().contiguous(), self.file, offset)
        return offset

    def load(self, piece: _Slice, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(piece.shard_numel, dtype=dtype)
        self.aio.sync_read(out, self.file, piece.offset)
        return out

    def forget(self) -> None:
        self.live -= 1
        if self.live == 0:
            self._cleanup()

    @staticmethod
    def _remove(aio: AsyncIO, directory: SwapDirectory) -> None:
        aio.close()
        directory.remove()


_SHAPE_QUERIES = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel}
_PASS_THROUGH = {
    torch.Tensor.requires_grad_,
    torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook,
}


class Init:
    """Context manager: modules constructed inside have their parameters partitioned.

    ``config`` (a :class:`Config`, dict or path; DeepSpeed's ``config_dict_or_path`` too)
    supplies the dtype (bf16/fp16 when enabled); ``dtype`` overrides it.
    ``data_parallel_group`` defaults to the world. ``enabled=False`` does nothing.
    """

    def __init__(
        self,
        config: Config | dict | str | None = None,
        *,
        config_dict_or_path: Config | dict | str | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        remote_device: str | None = None,
        enabled: bool = True,
    ) -> None:
        source = config if config is not None else config_dict_or_path
        cfg = Config.load(source) if source is not None else None
        offload = cfg.zero_optimization.offload_param if cfg is not None else None
        if remote_device is None:
            remote_device = offload.device if offload is not None else "none"
        if remote_device not in ("none", "cpu", "nvme"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected 'none', 'cpu' or 'nvme'")
        if remote_device == "nvme" and (offload is None or offload.nvme_path is None):
            raise ValueError(
                "zero.Init(remote_device='nvme') needs a config whose zero_optimization.offload_param "
                "has an nvme_path (the directory for the slice file)"
            )
        self.remote_device = remote_device
        self._nvme_path = offload.nvme_path if remote_device == "nvme" else None
        self._aio = aio_options(cfg.aio, self._nvme_path) if cfg is not None else AioOptions()
        self._nvme: _NvmeSlices | None = None
        self.enabled = enabled
        self.dtype = dtype or (cfg.compute_dtype if cfg is not None else None)
        self._group = data_parallel_group
        self._slices: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> _Slice
        self._next_index = 0
        # A full tensor handed out by ``param.data`` (or a view of one) -> (param, the full tensor).
        self._views: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._hook = None
        self._mode: _PartitionMode | None = None

    # -- the context -------------------------------------------------------------------------

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        ctx = init_distributed()
        self.group = self._group or ctx.dp_group
        self.device = ctx.device
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.remote_device == "nvme" and self._nvme is None:
            map_large_allocations()  # [Note: host memory with an NVMe tier]
            self._nvme = _NvmeSlices(self._nvme_path, dist.get_rank(), self._aio)
        self._hook = nn.modules.module.register_module_parameter_registration_hook(self._on_register)
        self._mode = _PartitionMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- partitioning --------------------------------------------------------------------------

    def _on_register(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None or param in self._slices or owner_of(param) is not None:
            return
        # Our own calls on the parameter must not be intercepted by the mode.
        with torch.no_grad(), torch._C.DisableTorchFunction():
            full = param.detach().to(self.device)
            if self.dtype is not None and full.is_floating_point():
                full = full.to(self.dtype)
            self._partition(param, full.contiguous())

    @torch.no_grad()
    def _partition(
        self, param: nn.Parameter, full: torch.Tensor, offset: int | None = None, index: int | None = None
    ) -> None:
        """Take rank 0's ``full`` value of ``param``; keep this rank's slice (on the remote
        device; at ``offset`` of the slice file when repartitioning); empty the param."""
        if self.world > 1:
            ops.broadcast(full, src=dist.get_global_rank(self.group, 0), group=self.group)
        per_rank = max(1, math.ceil(full.numel() / self.world))
        lo = min(self.rank * per_rank, full.numel())
        hi = min(lo + per_rank, full.numel())
        home = full.device if self.remote_device == "none" else torch.device("cpu")
        shard = torch.zeros(per_rank, dtype=full.dtype, device=home)
        shard[: hi - lo].copy_(full.reshape(-1)[lo:hi])
        if index is None:
            index, self._next_index = self._next_index, self._next_index + 1
        piece = _Slice(full.shape, shard, shard_numel=per_rank, index=index)
        if self._nvme is not None:
            piece.offset = self._nvme.store(shard, offset)
            piece.shard = torch.empty(0, dtype=full.dtype)
        self._slices[param] = piece
        param.data = torch.empty(0, dtype=full.dtype, device=full.device)
        register_owner([param], self)
        expose([param])  # [Note: ZeRO-3 parameter attributes]
        del full, shard
        if home.type == "cpu":
            return_freed_host_memory()

    @torch.no_grad()
    def full_value(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s full value, all-gathered from every rank's slice (collective)."""
        piece = self._slices[param]
        shard = piece.shard if piece.offset is None else self._nvme.load(piece, piece.shard.dtype)
        shard = shard.to(self.device)
        flat = torch.empty(piece.shard_numel * self.world, dtype=shard.dtype, device=self.device)
        if self.world > 1:
            all_gather_flat(flat, shard, self.group)
        else:
            flat.copy_(shard)
        return flat[: math.prod(piece.shape)].view(piece.shape)

    def _repartition(self, param: nn.Parameter, full: torch.Tensor) -> None:
        old = self._slices.pop(param, None)
        unregister([param])
        self._partition(param, full, None if old is None else old.offset, None if old is None else old.index)

    def shape_of(self, param: nn.Parameter) -> torch.Size:
        return self._slices[param].shape

    def zero3_partition(self, param: nn.Parameter) -> Partition:
        """``param.ds_*`` ([Note: ZeRO-3 parameter attributes]): the slice kept here."""
        piece = self._slices[param]
        held = max(0, min(piece.shard_numel, math.prod(piece.shape) - self.rank * piece.shard_numel))
        status = ZeroParamStatus.AVAILABLE if piece.gathered else ZeroParamStatus.NOT_AVAILABLE
        return Partition(piece.shape, status, piece.shard[: min(held, piece.shard.numel())], piece.index)

    def release_ownership(self, param: nn.Parameter) -> None:
        """Forget ``param`` (an engine now owns its storage)."""
        piece = self._slices.pop(param, None)
        unregister([param])
        withdraw([param])  # the engine exposes them again at stage 3
        if piece is not None and piece.offset is not None:
            self._nvme.forget()

    # -- GatheredParameters ----------------------------------------------------------------------

    def gather(self, params: list[nn.Parameter]) -> object:
        with torch._C.DisableTorchFunction():
            for p in params:
                p.data = self.full_value(p)
                self._slices[p].gathered = True
        return None

    def release(self, params: list[nn.Parameter], token: object, modifier_rank: int | None) -> None:
        with torch._C.DisableTorchFunction():
            for p in params:
                full = p.data
                if modifier_rank is not None and self.world > 1:
                    ops.broadcast(full, src=dist.get_global_rank(self.group, modifier_rank), group=self.group)
                if modifier_rank is None:
                    full = self.full_value(p)  # discard local changes
                self._repartition(p, full.contiguous())


class _PartitionMode(TorchFunctionMode):
    """Runs torch calls on partitioned parameters in full (see ``[Note: partitioned construction]``)."""

    def __init__(self, init: Init) -> None:
        super().__init__()
        self.init = init

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        init = self.init
        flat, _ = tree_flatten((args, kwargs))
        params = [t for t in flat if isinstance(t, torch.Tensor) and t in init._slices]
        views = [t for t in flat if isinstance(t, torch.Tensor) and t in init._views]
        if not params and not views:
            return func(*args, **kwargs)
        if func in _PASS_THROUGH:
            return func(*args, **kwargs)
        if params:
            shape = init.shape_of(params[0])
            if func in _SHAPE_QUERIES:
                return getattr(torch.empty(shape, device="meta"), func.__name__)(*args[1:], **kwargs)
            if func == _SHAPE_GET:
                return shape
            if func == _NDIM_GET:
                return len(shape)
            if func == _DATA_GET:
                full = init.full_value(params[0]).clone()
                init._views[full] = (params[0], full)
                return full
            if func == _DATA_SET:
                param, value = args[0], args[1]
                init._repartition(param, value.detach().to(init.device).contiguous())
                return None
            if getattr(func, "__name__", "") in ("__get__", "__set__"):
                return func(*args, **kwargs)  # other attributes (dtype, grad, ...) as they are
        # Any other call: run it on full tensors, then partition what it may have changed.
        for p in params:
            p.data = init.full_value(p)
        try:
            out = func(*args, **kwargs)
        finally:
            for p in params:
                init._repartition(p, p.data.contiguous())
            for v in views:
                p, full = init._views[v]
                init._repartition(p, full.detach().clone())
        if views and isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr():
            init._views[out] = init._views[views[0]]  # e.g. weight.data[idx].zero_()
        return out


_DATA_GET = torch.Tensor.data.__get__
_DATA_SET = torch.Tensor.data.__set__
_SHAPE_GET = torch.Tensor.shape.__get__
_NDIM_GET = torch.Tensor.ndim.__get__


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter that a :class:`Init` partitioned its full value again (collective)."""
    for p in module.parameters():
        owner = owner_of(p)
        if isinstance(owner, Init):
            p.data = owner.full_value(p).to(device=device, dtype=dtype)
            owner.release_ownership(p)
