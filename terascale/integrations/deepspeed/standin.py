"""terascale standing in for DeepSpeed: ``TERASCALE_AS_DEEPSPEED=1`` makes ``import deepspeed``
(and every ``deepspeed.X`` path and the installed-distribution metadata version checks read)
resolve to terascale, so tools that import DeepSpeed themselves (the Hugging Face Trainer,
``accelerate launch``, TRL, ...) train on terascale unchanged.

[Note: the stand-in switch]
- Where it runs: terascale's wheel installs ``terascale-standin.pth`` in site-packages (an
  editable install too: ``setup.py``). Python runs its one line at every start; with the
  variable unset or ``0`` that line is one dictionary lookup and imports nothing. With it set,
  it calls :func:`install`, which puts one finder first on ``sys.meta_path``. ``terascale run
  --as-deepspeed`` sets the variable for every rank.
- What it serves: ``deepspeed`` is a module of its own (:class:`_Root`: terascale's names plus
  DeepSpeed's ``__version__`` family, so ``deepspeed.__version__`` compares as a DeepSpeed
  release while ``terascale.__version__`` stays terascale's); ``deepspeed.X`` is the module
  ``terascale.X``, which terascale's own finder builds from the names map where no file
  provides it ([Note: DeepSpeed's module paths]). One map serves ``import terascale as
  deepspeed`` and the stand-in alike.
- The metadata: the same finder answers ``importlib.metadata`` for the distribution
  ``deepspeed`` (METADATA with :data:`VERSION`, ``top_level.txt``), so ``version("deepspeed")``,
  ``packages_distributions()`` and the tools' ``is_deepspeed_available()`` see it. Nothing named
  deepspeed is written anywhere.
- A real DeepSpeed in the same environment: the two cannot both be ``deepspeed``; the first
  ``import deepspeed`` raises ImportError naming both (and ``terascale run --as-deepspeed``
  refuses to start), rather than one silently shadowing the other.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import types
from collections.abc import Iterator
from typing import Any

ENV_VAR = "TERASCALE_AS_DEEPSPEED"
# The DeepSpeed release whose API the names map follows; the local part says what it really is.
DEEPSPEED_API_VERSION = "0.19.8"


def _terascale_version() -> str:
    from terascale import __version__

    return __version__


VERSION = f"{DEEPSPEED_API_VERSION}+terascale.{_terascale_version()}"


def enabled(environ: Any = None) -> bool:
    """Whether the switch is on in ``environ`` (default ``os.environ``)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def real_deepspeed() -> str | None:
    """Where a real DeepSpeed is installed on this ``sys.path`` (its package folder or its
    distribution), or None."""
    spec = importlib.machinery.PathFinder.find_spec("deepspeed")
    if spec is not None:
        return spec.origin or ", ".join(spec.submodule_search_locations or ()) or "deepspeed"
    for dist in importlib.metadata.MetadataPathFinder.find_distributions(
            importlib.metadata.DistributionFinder.Context(name="deepspeed")):  # fmt: skip
        return f"{dist.metadata['Name']} {dist.version} ({dist.locate_file('')})"
    return None


def conflict_message(where: str) -> str:
    return (f"{ENV_VAR}=1 asks for terascale as `deepspeed`, but a real DeepSpeed is installed in this environment "
            f"({where}). Only one can be `deepspeed`: uninstall DeepSpeed (pip uninstall deepspeed) to run on "
            f"terascale, or unset {ENV_VAR} to run on DeepSpeed.")  # fmt: skip


class _Root(types.ModuleType):
    """The module ``deepspeed``: terascale's names, DeepSpeed's version attributes."""

    def __getattr__(self, name: str) -> Any:
        import terascale

        return getattr(terascale, name)

    def __dir__(self) -> list[str]:
        import terascale

        return sorted({*super().__dir__(), *dir(terascale)})

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickled by name, as a plain module is: cloudpickle (Ray sends a training function
        # with its globals so) looks modules up by their exact type, and would otherwise try
        # to pickle this one's contents.
        return importlib.import_module, (self.__name__,)


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if self.target == "terascale":
            return _Root(spec.name, "terascale standing in for DeepSpeed (TERASCALE_AS_DEEPSPEED=1)")
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if isinstance(module, _Root):
            major, minor, patch = DEEPSPEED_API_VERSION.split(".")
            module.__dict__.update(__version__=VERSION, __version_major__=int(major),
                                   __version_minor__=int(minor), __version_patch__=int(patch),
                                   __git_hash__="terascale", __git_branch__="terascale",
                                   __path__=[], __terascale__=True)  # fmt: skip
            return
        # deepspeed.X is terascale.X: the import system returns what sys.modules holds.
        sys.modules[module.__name__] = importlib.import_module(self.target)

    def get_code(self, fullname: str) -> types.CodeType | None:
        """``python -m deepspeed.X`` runs ``terascale.X``'s own code."""
        spec = importlib.util.find_spec(self.target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "get_code"):
            return spec.loader.get_code(self.target)
        return None


class _Distribution(importlib.metadata.Distribution):
    """The installed-distribution record of ``deepspeed`` that version checks read."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {VERSION}\n"
                    "Summary: terascale standing in for DeepSpeed (TERASCALE_AS_DEEPSPEED=1)\n")  # fmt: skip
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path: Any) -> pathlib.Path:
        return pathlib.Path(__file__).resolve().parents[2] / str(path)


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` and ``deepspeed.*`` as terascale, and the ``deepspeed`` distribution."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if fullname == "deepspeed":
            where = real_deepspeed()
            if where is not None:
                raise ImportError(conflict_message(where), name=fullname)
        target_name = "terascale" + fullname[len("deepspeed"):]
        spec = importlib.util.find_spec(target_name)  # ModuleNotFoundError (with the reason) for refused paths
        if spec is None:
            return None
        is_package = fullname == "deepspeed" or spec.submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, _Alias(target_name), is_package=is_package)

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == "deepspeed":
            yield _Distribution()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedFinder())


def uninstall() -> None:
    """Remove the finder and every ``deepspeed`` module it served (for tests)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, DeepSpeedFinder)]
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]


def _startup() -> None:
    """What ``terascale-standin.pth`` runs when the variable is set to anything but ``0``: the
    .pth's one test is the cheapest; :func:`enabled` has the last word ("false", "off", ...)."""
    if enabled():
        install()
