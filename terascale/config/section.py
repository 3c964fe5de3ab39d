"""The base class of every config section, and the dtype spellings sections share."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

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
