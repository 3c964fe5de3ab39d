"""Stand-ins for DeepSpeed's functions and classes that terascale does not provide.

[Note: refused when used, not when imported]
Programs, tools and test suites import DeepSpeed's modules when they are imported
themselves, often for one optional path they may never take: a class to test with
``isinstance``, a decorator, a type for a hint, a helper of one code path. So every module
and every function or class (private ones too) that DeepSpeed has imports on terascale
(``deepspeed_modules.json.gz``, listed from DeepSpeed's package by
``tools/deepspeed_module_names.py``). A name terascale provides is terascale's object (the
names map, ``names.py``); any other is a stand-in class made here that raises
:class:`NotProvidedError`, with the reason, when it is called or instantiated (a subclass of
it too); reading an attribute of it raises AttributeError with the same reason.
``isinstance(x, stand_in)`` is False, so ``isinstance(engine.optimizer,
DeepSpeedZeroOptimizer)`` takes the branch a program has for other optimizers.

Names DeepSpeed does not have stay AttributeError / ModuleNotFoundError, so ``hasattr``
and ``try: import`` probes answer as they would against DeepSpeed. Module-level constants
get no stand-in on purpose: a stand-in for a value would compare unequal without a word,
where a missing one fails at the import that needs it.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

_LISTING = Path(__file__).with_name("deepspeed_modules.json.gz")


class NotProvidedError(NotImplementedError):
    """A DeepSpeed function or class that terascale does not provide was used."""


@functools.cache
def _listing() -> dict[str, Any]:
    return json.loads(gzip.decompress(_LISTING.read_bytes()))


def has_module(path: str) -> bool:
    """DeepSpeed has module ``deepspeed.<path>``."""
    return path in _listing()["modules"]


def is_package(path: str) -> bool:
    prefix = f"{path}." if path else ""
    return any(p.startswith(prefix) and p != path for p in _listing()["modules"])


def defines(path: str, name: str) -> bool:
    """DeepSpeed's module ``path`` defines function or class ``name``."""
    return name in _listing()["modules"].get(path, ())


def taken_from(path: str, name: str) -> str | None:
    """Where DeepSpeed's module ``path`` imports ``name`` from (``"module.path:name"``), if it does."""
    return _listing()["imported"].get(path, {}).get(name)


def names(path: str) -> list[str]:
    return [*_listing()["modules"].get(path, ()), *_listing()["imported"].get(path, {})]


class _Unprovided(type):
    """The metaclass of the stand-ins: using one raises its reason."""

    __refusal__: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotProvidedError(cls.__refusal__)

    def __getattr__(cls, name: str) -> Any:  # only for names the class does not have
        # AttributeError, so hasattr and getattr(..., default) (introspection, probes) still work.
        raise AttributeError(f"{name}: {cls.__refusal__}")

    def __repr__(cls) -> str:
        return f"<stand-in for {cls.__module__}.{cls.__qualname__}: not provided by terascale>"


def is_stand_in(obj: object) -> bool:
    return isinstance(obj, _Unprovided)


@functools.cache
def stand_in(path: str, name: str, reason: str | None) -> type:
    """The one stand-in for ``deepspeed.<path>.<name>`` (the same object at every import)."""
    full = ".".join(p for p in ("deepspeed", path, name) if p)
    why = reason or ("DeepSpeed's own, with no terascale counterpart (docs/deepspeed_names.md lists what "
                     "terascale provides)")  # fmt: skip
    namespace = {"__refusal__": f"{full}: {why}", "__module__": ".".join(p for p in ("deepspeed", path) if p),
                 "__qualname__": name, "__doc__": f"Not provided by terascale: {why}"}  # fmt: skip
    return _Unprovided(name, (), namespace)
