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


def map_large_allocations() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own mapping, returned
    to the OS when freed (process-wide; idempotent).

    [Note: host memory with an NVMe tier]
    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB),
    after which such blocks come from the heap, and the heap keeps what it once held: an
    NVMe-offloaded step allocates and frees gigabytes of transient tensors of a few MiB
    (gradients, widened chunks, gathered groups, a first step's fresh optimizer state), so
    RSS ratchets up to a multiple of the buffers the tiers really hold (measured: +700 MiB
    for the 42M-parameter model of tests/test_offload_memory.py, whose buffers are 20 MiB).
    A fixed threshold keeps RSS at what is live, for a page fault per fresh page of each
    mapped block. The threshold is 1 MiB, not lower: model-state transients are larger
    (that model's are 2 MiB; its growth stays at 31 MiB, as with 64 KiB), while the
    many smaller activation tensors of a forward and backward keep coming from the heap
    without faults. On the 16.8M-parameter GPT of bench/step_time.py, computing on this
    CPU, a 64 KiB threshold made the step 35% slower, once its I/O was hidden, and 1 MiB
    about 15% (4 MiB let the memory test's RSS ratchet by 560 MiB). Called when a tier on
    NVMe is created; without an NVMe tier the allocator is left as it is. (On a GPU the
    compute's tensors are the caching allocator's, and this touches only host-side ones.)
    """
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _NVME_MMAP_THRESHOLD)
