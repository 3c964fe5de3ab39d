"""Host memory hygiene for the moments ZeRO frees a lot of it at once."""

from __future__ import annotations

import ctypes
import sys


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def return_freed_host_memory() -> None:
    """Ask glibc to give freed heap pages back to the OS.

    Full parameters freed after sharding sit between small tensors that stay, and glibc
    keeps such holes (its mmap threshold grows after the first large free): without this
    a process that just sharded its model looks as large as if it had not.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc malloc.h)
_NVME_MMAP_THRESHOLD = 1 << 20
_HEAP_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold
# A rank computing on the CPU keeps the fixed threshold only with this much on NVMe.
BOUNDED_HOST_MIN_NVME_BYTES = 512 << 20


def map_large_allocations() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own mapping, returned
    to the OS when freed (process-wide; idempotent).

    [Note: host memory with an NVMe tier]
    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB),
    after which such blocks come from the heap, and the heap keeps what it once held: an
    NVMe-offloaded step allocates and frees gigabytes of transient tensors of a few MiB
    (gradients, widened chunks, gathered groups, a first step's fresh optimizer state), so
    RSS ratchets up to a multiple of the buffers the tiers really hold (measured: +700 MiB
    for the 42M-parameter model of tests/test_offload_memory.py, whose buffers are 20 MiB,
    about the size of its states). A fixed threshold keeps RSS at what is live, for a page
    fault per fresh page of each mapped block. The threshold is 1 MiB, not lower: model-state
    transients are larger (that model's are 2 MiB; its growth stays at 31 MiB, as with 64
    KiB), while the many smaller activation tensors keep coming from the heap (4 MiB let
    that model's RSS ratchet by 560 MiB).

    Where the model computes on the CPU, its activations and gradients come from the same
    allocator, and the faults cost the compute: on the 16.8M-parameter GPT of
    bench/step_time.py a 64 KiB threshold made the step 35% slower and 1 MiB about 20%,
    once its I/O was hidden. There a ratchet of about the states' size is the cheaper
    price while the states are small, so construction (zero.Init, the engine) maps large
    blocks, and an engine whose rank holds under ``BOUNDED_HOST_MIN_NVME_BYTES`` on NVMe
    then gives the heap its large blocks back (:func:`reuse_large_allocations`). On an
    accelerator the compute's tensors are its caching allocator's, and the threshold only
    touches host-side ones: it stays. Without an NVMe tier the allocator is left as it is.
    The setting is process-wide: the engine built last decides. A model built before the
    engine came from the heap while the threshold was still dynamic, and its full tensors,
    freed at sharding, leave holes there that the steps' small transients spread over; so
    with an NVMe tier the engine also trims the heap after steps 1, 2, 4, 8, ...
    (``ShardedState.step``).
    """
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _NVME_MMAP_THRESHOLD)


def reuse_large_allocations() -> None:
    """Let the heap serve (and keep for reuse) blocks up to 32 MiB again, as glibc does
    after warming up (see [Note: host memory with an NVMe tier])."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _HEAP_MMAP_THRESHOLD)
