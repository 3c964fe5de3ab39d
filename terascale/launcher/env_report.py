"""``terascale env``: what is installed and usable on this machine.

Every probe is isolated: a missing package, a broken CUDA driver or an
unwritable directory shows up as a value in the table, never as a crash.
"""

from __future__ import annotations

import mmap
import os
import platform
import sys
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

__all__ = ["collect_env", "format_table", "odirect_status", "print_env"]

OPTIONAL_PACKAGES = ("numpy", "pydantic", "safetensors", "psutil", "tqdm", "transformers", "deepspeed", "triton")
_BLOCK = 4096


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def odirect_status(directory: str | Path = ".") -> str:
    """Whether a file in ``directory`` can be written with ``O_DIRECT`` (NVMe offload needs it)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return "no (this platform has no O_DIRECT)"
    path = Path(directory, f".terascale_odirect_probe_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | flag, 0o600)
    except OSError as exc:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
        return f"no ({exc.strerror or exc})"
    try:
        # O_DIRECT needs a block-aligned buffer; an anonymous mmap is page aligned.
        with mmap.mmap(-1, _BLOCK) as buf:
            os.write(fd, buf)
        return "yes"
    except OSError as exc:
        return f"no ({exc.strerror or exc})"
    finally:
        os.close(fd)
        try:
            path.unlink()
        except OSError:
            pass


def _torch_rows() -> list[tuple[str, str]]:
    try:
        import torch
    except Exception as exc:  # any failure to import is a fact to report
        return [("torch", f"not importable ({type(exc).__name__}: {exc})")]
    rows = [("torch", torch.__version__), ("torch CUDA build", str(torch.version.cuda or "none"))]
    hip = getattr(torch.version, "hip", None)
    if hip:
        rows.append(("torch HIP build", str(hip)))

    def cuda_rows() -> list[tuple[str, str]]:
        if not torch.cuda.is_available():
            return [("CUDA available", "no")]
        count = torch.cuda.device_count()
        out = [("CUDA available", "yes"), ("CUDA devices", str(count))]
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            out.append((f"  cuda:{i}", f"{props.name}, {_gib(props.total_memory)}"))
        return out

    def nccl_rows() -> list[tuple[str, str]]:
        version = torch.cuda.nccl.version()
        text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        return [("NCCL version", text)]

    def backend_rows() -> list[tuple[str, str]]:
        import torch.distributed as dist

        if not dist.is_available():
            return [("distributed backends", "torch.distributed unavailable")]
        checks = {
            "gloo": dist.is_gloo_available,
            "nccl": dist.is_nccl_available,
            "mpi": dist.is_mpi_available,
            "ucc": getattr(dist, "is_ucc_available", lambda: False),
        }
        return [("distributed backends", ", ".join(f"{k}={'yes' if f() else 'no'}" for k, f in checks.items()))]

    rows += _guard("CUDA", cuda_rows)
    if torch.version.cuda:
        rows += _guard("NCCL version", nccl_rows)
    rows += _guard("distributed backends", backend_rows)
    return rows


def _host_rows() -> list[tuple[str, str]]:
    rows = [("CPU cores (logical)", str(os.cpu_count() or "unknown"))]
    if hasattr(os, "sched_getaffinity"):
        rows.append(("CPU cores usable", str(len(os.sched_getaffinity(0)))))
    try:
        import psutil
    except ImportError:
        rows.append(("memory", "unknown (psutil not installed)"))
        return rows
    physical = psutil.cpu_count(logical=False)
    if physical:
        rows.insert(1, ("CPU cores (physical)", str(physical)))
    mem = psutil.virtual_memory()
    rows.append(("memory", f"{_gib(mem.total)} total, {_gib(mem.available)} available"))
    return rows


def _guard(label: str, probe: Callable[[], list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """Run ``probe``; turn any exception into a row instead of letting it escape."""
    try:
        return probe()
    except Exception as exc:
        return [(label, f"error ({type(exc).__name__}: {exc})")]


def collect_env() -> list[tuple[str, str]]:
    """Gather ``(name, value)`` rows describing this machine; never raises."""
    rows: list[tuple[str, str]] = []
    rows += _guard("terascale", lambda: [("terascale", _terascale_version())])
    rows += _guard("python", lambda: [("python", f"{platform.python_version()} ({sys.executable})")])
    rows += _guard("platform", lambda: [("platform", platform.platform())])
    rows += _guard("torch", _torch_rows)
    rows += _guard("CPU", _host_rows)
    rows += _guard("O_DIRECT in cwd", lambda: [("O_DIRECT in cwd", odirect_status(os.getcwd()))])
    for name in OPTIONAL_PACKAGES:
        rows += _guard(name, lambda name=name: [(name, _package_version(name))])
    return rows


def _terascale_version() -> str:
    # From the installed distribution's metadata: importing terascale itself
    # would pull in the whole library just to print a string.
    try:
        return metadata.version("terascale")
    except metadata.PackageNotFoundError:
        return "unknown"


def format_table(rows: list[tuple[str, str]]) -> str:
    """Render rows as ``name  value`` lines with the names padded to one width."""
    width = max((len(name) for name, _ in rows), default=0)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def print_env() -> int:
    """Print the environment table to stdout; returns the exit code 0."""
    print(format_table(collect_env()))
    return 0
