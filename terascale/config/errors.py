"""Config errors: one :class:`ConfigError` that lists every problem, each naming its key path.

pydantic reports problems as ``(loc, type, input)`` records. :func:`from_validation_error`
turns them into one line per problem, phrased in terms of the user's JSON keys, and for an
unknown key suggests the nearest valid key *at the same depth* by walking ``loc`` through
the schema's model classes.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError

from terascale.errors import UsageError


class ConfigError(UsageError):
    """A config a user wrote is invalid or asks for something unavailable (a ValueError,
    and an AssertionError as DeepSpeed's config checks are: [Note: refusals DeepSpeed asserts]).

    ``problems`` holds one line per problem; the message lists them all so a user can fix
    every mistake in one pass.
    """

    def __init__(self, problems: str | Sequence[str], *, source: str | None = None) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        assert self.problems, "ConfigError needs at least one problem"
        self.source = source
        where = f" ({source})" if source else ""
        if len(self.problems) == 1:
            message = f"invalid terascale config{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"invalid terascale config{where}, {len(self.problems)} problems:\n{lines}"
        super().__init__(message)


def key_names(model: type[BaseModel]) -> list[str]:
    """Every key a JSON object may use for ``model``: field names and their aliases."""
    names: list[str] = []
    for name, field in model.model_fields.items():
        names.append(name)
        if field.alias:
            names.append(field.alias)
        if isinstance(field.validation_alias, str):
            names.append(field.validation_alias)
        elif isinstance(field.validation_alias, AliasChoices):
            names.extend(c for c in field.validation_alias.choices if isinstance(c, str))
    return list(dict.fromkeys(names))


def field_for_key(model: type[BaseModel], key: str) -> str | None:
    """The field of ``model`` that JSON key ``key`` sets (by name or any alias), or None."""
    for name, field in model.model_fields.items():
        if key == name or key == field.alias or key == field.validation_alias:
            return name
        alias = field.validation_alias
        if isinstance(alias, AliasChoices) and key in alias.choices:
            return name
    return None


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as ``Optional[OffloadConfig]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = submodel(arg)
            if found is not None:
                return found
    return None


def _model_at(root: type[BaseModel], loc: Iterable[str | int]) -> type[BaseModel] | None:
    """The model class that validates the object at ``loc`` (None inside loose dicts)."""
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        name = field_for_key(model, part)
        if name is None:
            return None
        model = submodel(model.model_fields[name].annotation)
    return model


def _path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _unknown_key(root: type[BaseModel], loc: Sequence[str | int]) -> str:
    key = loc[-1]
    parent = _model_at(root, loc[:-1])
    if parent is None or not isinstance(key, str):
        return "unknown key"
    same = field_for_key(parent, key)
    if same is not None:
        # The key is valid, so pydantic refused it because another spelling of the same
        # setting (an alias) was given too.
        spellings = [k for k in key_names(parent) if field_for_key(parent, k) == same and k != key]
        return f"duplicate of {', '.join(repr(s) for s in spellings)} (same setting); keep one"
    match = difflib.get_close_matches(key, key_names(parent), n=1, cutoff=0.6)
    if match:
        return f"unknown key; did you mean {match[0]!r}?"
    valid = ", ".join(sorted(n for n in key_names(parent)))
    return f"unknown key; valid keys here: {valid}"


_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean (true or false)",
    "bool_parsing": "a boolean (true or false)",
    "string_type": "a string",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "a list",
    "path_type": "a path string",
}

_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


def _describe(root: type[BaseModel], err: dict[str, Any]) -> str:
    kind = err["type"]
    loc = err["loc"]
    value = err.get("input")
    if kind == "extra_forbidden":
        return _unknown_key(root, loc)
    if kind == "missing":
        return "required key is missing"
    if kind in _EXPECTED:
        hint = ""
        if value == "auto":
            hint = " ('auto' stands for a whole value, not a part of one; give a value)"
        return f"expected {_EXPECTED[kind]}, got {_show(value)}{hint}"
    if kind in _BOUNDS:
        bound = next(iter(err.get("ctx", {}).values()), "?")
        return f"expected a value {_BOUNDS[kind]} {bound}, got {_show(value)}"
    if kind == "literal_error":
        choices = err.get("ctx", {}).get("expected", "")
        return f"expected one of {choices}, got {_show(value)}"
    if kind in ("value_error", "assertion_error"):
        msg = str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
        return msg
    return f"{err['msg']} (got {_show(value)})"


def from_validation_error(
    root: type[BaseModel],
    error: ValidationError,
    *,
    source: str | None = None,
    extra: Sequence[str] = (),
) -> ConfigError:
    """One :class:`ConfigError` listing every problem in ``error``, each as ``path: message``.

    ``extra`` adds problems found outside pydantic (duplicates are dropped).
    """
    problems: list[str] = []
    for err in error.errors():
        path = _path(err["loc"])
        text = _describe(root, err)
        problems.append(f"{path}: {text}" if path else text)
    problems.extend(extra)
    return ConfigError(list(dict.fromkeys(problems)), source=source)
