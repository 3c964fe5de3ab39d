"""Reading a config source into a plain dict: a dict, a JSON/hjson file or string, base64 JSON.

DeepSpeed reads its configs with ``hjson``, so published ``ds_config.json`` files may carry
``//`` and ``#`` comments or trailing commas; they load here too. Strict JSON is tried
first (it is faster and its errors are precise); hjson only when JSON refuses the text.
Two equal keys in one object are an error, as in DeepSpeed: a user who wrote both meant
one of them.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson

from terascale.config.errors import ConfigError


def read_source(source: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[dict[str, Any], str | None]:
    """``source`` as a dict, and a label for messages (the file name, or None).

    Raises ConfigError when the file is missing, the text is neither JSON nor hjson, a key
    is given twice in one object, or the top level is not an object.
    """
    label: str | None = None
    if isinstance(source, Mapping):
        data: Any = dict(source)
    elif isinstance(source, os.PathLike):
        label = os.fspath(source)
        data = _read_file(Path(source))
    elif isinstance(source, str):
        data, label = _parse_string(source)
    else:
        raise ConfigError(f"expected a path, a dict, a JSON string or a Config, got {type(source).__name__}")
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be a JSON object, got {type(data).__name__}", source=label)
    return data, label


def _duplicate_keys_refused(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{key}: given twice in the same JSON object; keep one")
        out[key] = value
    return out


def _loads(text: str, label: str | None) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_duplicate_keys_refused)
    except ConfigError as err:
        raise ConfigError(err.problems, source=label) from None
    except json.JSONDecodeError as err:
        json_error = f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
    try:
        # Comments, trailing commas, unquoted keys: what DeepSpeed's own reader accepts.
        return hjson.loads(text, object_pairs_hook=_duplicate_keys_refused)
    except ConfigError as err:
        raise ConfigError(err.problems, source=label) from None
    except (hjson.HjsonDecodeError, ValueError):
        raise ConfigError(f"{json_error} (nor hjson, which DeepSpeed also reads)", source=label) from None


def _read_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    return _loads(path.read_text(encoding="utf-8"), str(path))


def _parse_string(text: str) -> tuple[Any, str | None]:
    """Parse a JSON string, a path to a JSON file, or base64 JSON; return (data, label)."""
    stripped = text.strip()
    if stripped.startswith("{"):
        return _loads(stripped, None), None
    if os.path.exists(text):
        return _read_file(Path(text)), text
    try:
        decoded = base64.urlsafe_b64decode(stripped.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        decoded = ""
    if decoded.strip().startswith("{"):
        return _loads(decoded, "base64 config"), "base64 config"
    raise ConfigError(f"config file {text!r} does not exist (and the string is not JSON or base64 JSON)")
