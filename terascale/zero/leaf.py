"""ZeRO-3 leaf modules: a module whose parameters are gathered as one unit when it starts.

[Note: leaf modules]
A mixture of experts runs, on each rank, only the experts its tokens are routed to. Were
every expert a group of its own, ranks routing differently would all-gather different
groups - collectives that do not match, so a hang or, worse, shards mixed between
experts. Marking the MoE block a *leaf* (DeepSpeed's ``set_z3_leaf_modules``) makes the
wrap policy give it one group holding every parameter under it and wrap nothing inside
it (:func:`terascale.zero.wrap.wrapped_modules`): the whole block is gathered when its
forward starts, on every rank alike, whichever experts then run, and no gather hooks
run for the modules inside (their parameter reads find the group gathered). The same
helps models with very fine-grained modules. Experts that got no gradient on a rank
leave the block's group gathered until backward ends there; the gradient reductions
keep one order on every rank whatever each computed ([Note: sharded gradients]).

The mark is DeepSpeed's: a ``_z3_leaf`` attribute on the module *instance*. It must exist
before ``terascale.initialize`` (which reads it to plan the groups), when no engine exists
to hold it; it belongs to that one module, not to its class or to a process-wide table;
and DeepSpeed's own code and models written for it set and read ``_z3_leaf`` directly, so
a module marked either way is a leaf to both. Nothing is attached to parameters.

DeepSpeed also treats the mixture-of-experts blocks of Hugging Face's Mixtral, Qwen2-MoE
and Qwen3-MoE as leaves unless its config says otherwise (``zero_optimization.leaf_module``,
default ``classes``): :data:`DEFAULT_LEAF_MODULE_CLASSES`, which ``WrapPolicy.leaf_classes``
applies without marking the modules; a module whose mark was set to False stays no leaf.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from terascale.zero.gather import owner_of

logger = logging.getLogger("terascale")

_FLAG = "_z3_leaf"

# DeepSpeed's default zero_optimization.leaf_module.classes: blocks that run experts by routing.
DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is marked a leaf (see [Note: leaf modules])."""
    return bool(getattr(module, _FLAG, False))


def is_leaf(module: nn.Module, classes: Sequence[type | str] = ()) -> bool:
    """Whether ``module`` is marked a leaf, or is an instance of one of ``classes`` (classes
    or class names) and not marked otherwise (``_z3_leaf = False``)."""
    flag = getattr(module, _FLAG, None)
    if flag is not None:
        return bool(flag)
    return any(_matches(module, c) for c in classes)


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    """Mark ``module`` alone a leaf (``flag=True``) or not."""
    setattr(module, _FLAG, bool(flag))
    _warn_if_planned([module])


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked leaves, in module order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _matches(module: nn.Module, spec: type | str) -> bool:
    cls = type(module)
    if isinstance(spec, type):
        return isinstance(module, spec)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark_classes(
    model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    if isinstance(classes, (str, type)) or not all(isinstance(c, (type, str)) for c in classes):
        raise ValueError(f"leaf_module_classes must be a list of module classes or class names, got {classes!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {list(classes)} found in model {type(model).__name__}")
    for m in found:
        setattr(m, _FLAG, flag)
    if flag:
        _warn_if_planned(found)
    return found


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of ``model`` that is an instance of one of ``leaf_module_classes``
    (classes, or class names plain or qualified with their module) a leaf: at ZeRO-3 its
    parameters are gathered as one unit when its forward starts, and no hooks go inside
    it (see [Note: leaf modules]). Call it before ``terascale.initialize``. Returns the
    marked modules; raises ValueError when none matches and ``raise_if_not_found``."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for the modules of these classes; returns them."""
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules named ``module_names`` (as ``named_modules`` names them); returns
    the marked modules and the names that matched none."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    for m in found:
        setattr(m, _FLAG, flag)
    if flag:
        _warn_if_planned(found)
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose ``named_modules`` name ends with one of the suffixes; returns
    the marked modules (each once) and the suffixes that matched none."""
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        found.update((id(m), m) for m in hits)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {type(model).__name__}")
    for m in found.values():
        setattr(m, _FLAG, flag)
    if flag:
        _warn_if_planned(list(found.values()))
    return list(found.values()), missing


def _warn_if_planned(modules: Sequence[nn.Module]) -> None:
    # The groups are planned once, in terascale.initialize; a mark made after it changes nothing.
    for m in modules:
        if any(owner_of(p) is not None and hasattr(owner_of(p), "schedule") for p in m.parameters()):
            logger.warning(
                "set_z3_leaf_modules on %s after terascale.initialize has no effect: mark leaf modules "
                "before initialize",
                type(m).__name__,
            )
            return
