"""Host buffers that the NVMe tier reads into and writes from.

[Note: huge-page I/O buffers]
An ``O_DIRECT`` request moves data straight between the device and the caller's pages, so
the kernel pins those pages and hands the device one segment per physically contiguous
run. Ordinary 4 KiB pages make a 1 MiB request 256 segments, more than a block queue
takes at once (virtio-blk here: ``max_segments`` 254), and the request is split in two;
a 4 MiB request becomes five. Buffers on 2 MiB transparent huge pages are one segment
per 2 MiB, so large requests reach the device whole and pinning them is cheaper.
Measured on this machine's disk (``bench/aio.py --sweep``): 8 threads of 1 MiB writes
went from 2.01 to 2.28 GB/s and reads from 2.04 to 2.52 GB/s, and only with huge pages
do 4 MiB requests pay off (writes 2.83, reads 2.71 GB/s).

:func:`aligned_empty` therefore maps buffers of 2 MiB or more as anonymous memory,
aligned to 2 MiB and advised ``MADV_HUGEPAGE`` (honoured where transparent huge pages
are ``always`` or ``madvise``, the usual settings; elsewhere they are ordinary pages and
everything still works). Smaller buffers and page-locked ones (``pin_memory``, for
copies to a GPU) come from torch's allocator, over-allocated to a 4 KiB boundary.
"""

from __future__ import annotations

import mmap

import torch

ALIGNMENT = 4096  # bytes; a multiple of every logical block size O_DIRECT may need
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)


def round_up(n: int, multiple: int = ALIGNMENT) -> int:
    return (n + multiple - 1) // multiple * multiple


def aligned_empty(numel: int, dtype: torch.dtype, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised 1-D host tensor whose data starts on an ``ALIGNMENT`` boundary and
    whose storage extends to a whole number of ``ALIGNMENT`` blocks past it, so that it
    can be read or written with ``O_DIRECT``. From 2 MiB up it lies on transparent huge
    pages (see [Note: huge-page I/O buffers]); ``pin_memory`` page-locks it instead, for
    copies to an accelerator."""
    nbytes = round_up(max(numel, 1) * dtype.itemsize)
    if pin_memory or nbytes < HUGE_PAGE or _MADV_HUGEPAGE is None or _ANONYMOUS is None:
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
        shift = (-raw.data_ptr()) % ALIGNMENT
    else:
        raw = _huge_page_bytes(nbytes)
        shift = (-raw.data_ptr()) % HUGE_PAGE
    return raw[shift : shift + nbytes].view(dtype)[:numel]


def _huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a fresh anonymous mapping of at least ``nbytes`` from a 2 MiB
    boundary. The tensor keeps the mapping alive; it is unmapped when the last view goes."""
    size = round_up(nbytes, HUGE_PAGE) + HUGE_PAGE  # room to start on a 2 MiB boundary
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _ANONYMOUS)
    try:
        region.madvise(_MADV_HUGEPAGE)
    except OSError:  # transparent huge pages compiled out: ordinary pages then
        pass
    return torch.frombuffer(region, dtype=torch.uint8)


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s data starts on a 2 MiB boundary (for tests and reports)."""
    return tensor.data_ptr() % HUGE_PAGE == 0
