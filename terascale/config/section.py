"""The base class of every config section, and the dtype spellings sections share."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator

from terascale.config.errors import field_for_key

DtypeName = Literal["fp32", "fp16", "bf16"]

# Every spelling DeepSpeed accepts for a floating-point dtype, mapped to one short name.
_DTYPE_SPELLINGS: dict[str, DtypeName] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}

TORCH_DTYPES: dict[DtypeName, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


class Section(BaseModel):
    """A config object: unknown keys are errors, values are immutable after loading.

    Keys may be given by field name or by alias (DeepSpeed's spelling), as DeepSpeed's own
    config models allow.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _numbers_from_strings(cls, data: Any) -> Any:
        # Published configs write sizes as strings ("5e8"); where a key takes a number and
        # no string, such a string is read as the number it spells (5e8 -> 500000000).
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key, value in data.items():
            if isinstance(value, str):
                kinds = _number_kinds(cls, key)
                if kinds:
                    out[key] = parse_number(value, int in kinds and float not in kinds)
        return out


def normalize_dtype_name(value: Any, *, allow_none: bool = True) -> DtypeName | None:
    """Map a DeepSpeed dtype spelling ('float16', 'torch.bfloat16', ...) to 'fp32'|'fp16'|'bf16'.

    Raises ValueError naming the accepted spellings; pydantic validators turn it into a
    config problem at the field's key path.
    """
    if value is None:
        if allow_none:
            return None
        raise ValueError("expected one of 'fp32', 'fp16', 'bf16', got null")
    if isinstance(value, torch.dtype):
        for name, dtype in TORCH_DTYPES.items():
            if dtype == value:
                return name
    if isinstance(value, str):
        key = value.strip().lower()
        if key == "none" and allow_none:
            return None
        if key in _DTYPE_SPELLINGS:
            return _DTYPE_SPELLINGS[key]
    raise ValueError(
        f"expected one of 'fp32', 'fp16', 'bf16' (or a spelling such as 'float16', "
        f"'bfloat16', 'half'), got {value!r}"
    )


def _annotation_types(annotation: Any) -> set[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {t for arg in typing.get_args(annotation) for t in _annotation_types(arg)}
    return {annotation}


def _number_kinds(model: type[BaseModel], key: str) -> set[type]:
    """{int} / {float} / {int, float} when ``key`` of ``model`` takes numbers and no strings."""
    name = field_for_key(model, key)
    if name is None:
        return set()
    kinds = _annotation_types(model.model_fields[name].annotation)
    if str in kinds or any(typing.get_origin(k) is Literal for k in kinds):
        return set()
    return {k for k in kinds if k in (int, float)}


def parse_number(text: str, integer: bool) -> Any:
    """The number ``text`` spells (``"5e8"``, ``"1_000"``, ``" 0.1 "``), else ``text`` itself
    (validation then reports it)."""
    try:
        number = float(text.strip().replace("_", ""))
    except ValueError:
        return text
    if integer and number.is_integer():
        return int(number)
    return number
