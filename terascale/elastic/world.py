"""The process groups of one membership epoch, from the job's store.

A rank started by the live elastic agent ([Note: the live elastic agent]) has no
``RANK`` or ``WORLD_SIZE``: it joins the job's membership ([Note: membership epochs])
and the epoch it lands in gives both. Each epoch's default group is initialised over
its own prefix of the job's store, so a new epoch never meets the old one's keys.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from terascale.elastic.membership import (
    ENV_LAST_CALL,
    ENV_MAX,
    ENV_MIN,
    ENV_NODE,
    ENV_RUN_ID,
    ENV_STORE,
    Epoch,
    Membership,
    Timing,
)

ENV_EXPIRY = "TERASCALE_ELASTIC_EXPIRY"
ENV_TIMEOUT = "TERASCALE_ELASTIC_COLLECTIVE_TIMEOUT"  # seconds a collective may wait for a peer
DEFAULT_COLLECTIVE_TIMEOUT_S = 30.0


def started_live() -> bool:
    """Whether a live elastic agent started this process."""
    return bool(os.environ.get(ENV_STORE))


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT_S)))


def connect() -> Membership:
    """Join the job whose store the environment names (as a new member)."""
    host, _, port = os.environ[ENV_STORE].rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    expiry = float(os.environ.get(ENV_EXPIRY, Timing.expiry))
    timing = Timing(interval=min(Timing.interval, expiry / 4), expiry=expiry,
                    last_call=float(os.environ.get(ENV_LAST_CALL, Timing.last_call)))  # fmt: skip
    return Membership(
        store, os.environ[ENV_RUN_ID], os.environ[ENV_NODE],
        min_members=int(os.environ[ENV_MIN]), max_members=int(os.environ[ENV_MAX]), timing=timing,
    )  # fmt: skip


def init_epoch_group(membership: Membership, epoch: Epoch, backend: str) -> None:
    """Initialise the default process group of ``epoch`` (collective over its members)."""
    assert not dist.is_initialized()
    os.environ["RANK"] = str(epoch.rank_of(membership.id))
    os.environ["WORLD_SIZE"] = str(epoch.world_size)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"epoch{epoch.number}/", membership.store),
        rank=epoch.rank_of(membership.id),
        world_size=epoch.world_size,
        timeout=collective_timeout(),
    )


def leave_epoch_group() -> None:
    """Destroy every process group of the epoch this process leaves."""
    if dist.is_initialized():
        dist.destroy_process_group()
