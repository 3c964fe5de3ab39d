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
