"""Parameters used outside their owner's forward: explicit registration and read detection.

DeepSpeed's API: ``register_external_parameter(module, parameter)`` says that
``module``'s forward (and so its backward) uses ``parameter``, which another module
owns; at ZeRO-3 the parameter is then gathered whenever ``module`` runs. It is usually
called in the model's ``__init__``, before any engine exists, so the registration is
kept where DeepSpeed keeps it: in a ``_external_params`` dict on the module instance
(``id(param) -> param``). A live engine is told at once as well (the parameter's owner,
found in the [Note: owner table], has the gather schedule), so a registration made after
``terascale.initialize`` counts from the module's next forward.

Most such reads need no registration: they are detected as they happen, see [Note:
parameters read outside their owner] in :mod:`terascale.zero.schedule`, which this
module serves with :class:`ReadHookedParameters`.

[Note: reading module._parameters]
``nn.Module.__getattr__`` finds a parameter with ``self._parameters[name]``, so a
subclass of ``dict`` installed as one module *instance*'s ``_parameters`` sees every
``module.weight`` read, which is where the code that uses a weight without calling its
module (``nn.MultiheadAttention`` with ``out_proj.weight``, a block called through
``.forward``) touches it. This is DeepSpeed's ``ZeROOrderedDict``. It patches no torch
function and no class: only the stage-3 engine's own modules get it, while the engine
lives, and :func:`restore_parameters` puts a plain dict back on ``engine.destroy()``. It
changes nothing else: the module's other code reaches the dict through ``items()``,
``values()``, ``in`` and assignment (``named_parameters``, ``state_dict``, ``to``,
``register_parameter``), which it inherits unchanged; copies and pickles of the module
get a plain dict (``__reduce_ex__``), not a copy of the engine. A module whose
``_parameters`` is not a plain dict (another library's) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from terascale.zero.gather import owner_of

REGISTRY = "_external_params"  # DeepSpeed's attribute name (see the module docstring)


class ExternalParameterError(ValueError, RuntimeError):
    """A misuse of the external-parameter API: a ValueError, and the RuntimeError
    DeepSpeed raises, so either ``except`` clause catches it."""


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` with ``module``: at ZeRO-3, whenever ``module``'s forward runs
    (and before its backward), ``parameter``'s group is all-gathered as well, on every rank.
    Needed only when ``module`` reaches the parameter around ``nn.Module`` attributes (a
    reference kept in a plain attribute or container); ``module.other.weight`` reads are
    detected without it. A no-op for parameters no stage-3 engine shards."""
    if not isinstance(parameter, nn.Parameter):
        raise ExternalParameterError(
            f"register_external_parameter needs an nn.Parameter, got {type(parameter).__name__}"
        )
    module.__dict__.setdefault(REGISTRY, {})[id(parameter)] = parameter
    schedule = getattr(owner_of(parameter), "schedule", None)
    if schedule is not None:
        schedule.add_external(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (reads detected at run time stay)."""
    if not isinstance(parameter, nn.Parameter):
        raise ExternalParameterError(
            f"unregister_external_parameter needs an nn.Parameter, got {type(parameter).__name__}"
        )
    registry = module.__dict__.get(REGISTRY, {})
    if id(parameter) not in registry:
        raise ExternalParameterError(f"the parameter is not a registered external parameter of {type(module).__name__}")
    del registry[id(parameter)]
    schedule = getattr(owner_of(parameter), "schedule", None)
    if schedule is not None:
        schedule.remove_external(module, parameter)


def registered_external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered on ``module`` itself (not its children)."""
    return list(module.__dict__.get(REGISTRY, {}).values())


class ReadHookedParameters(dict):
    """A module's ``_parameters`` that calls ``on_read(param)`` on every ``module.name``
    read of a parameter (see [Note: reading module._parameters])."""

    __slots__ = ("on_read",)

    def __init__(self, params: dict, on_read: Callable[[nn.Parameter], None]) -> None:
        super().__init__(params)
        self.on_read = on_read

    def __getitem__(self, key: str) -> nn.Parameter | None:
        param = dict.__getitem__(self, key)
        if param is not None:
            self.on_read(param)
        return param

    def __reduce_ex__(self, protocol: object) -> tuple:
        return dict, (dict(self),)


def hook_parameter_reads(module: nn.Module, on_read: Callable[[nn.Parameter], None]) -> bool:
    """Install :class:`ReadHookedParameters` on ``module`` (only); False if its
    ``_parameters`` is not a plain dict and it was left alone."""
    params = module.__dict__.get("_parameters")
    if type(params) is not dict:
        return False
    module.__dict__["_parameters"] = ReadHookedParameters(params, on_read)
    return True


def restore_parameters(module: nn.Module) -> None:
    """Put a plain dict with ``module``'s current parameters back (undoes :func:`hook_parameter_reads`)."""
    params = module.__dict__.get("_parameters")
    if type(params) is ReadHookedParameters:
        module.__dict__["_parameters"] = dict(params)
