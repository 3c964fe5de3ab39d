"""``planner``: the memory planner's settings (terascale's own section, not DeepSpeed's).

```json
"planner": {"enabled": true, "margin": 0.1, "host_memory": "8GiB", "device_memory": "40GiB",
            "disk_space": "100GiB", "disk_bandwidth": 2.0, "refuse_explicit": true}
```

* ``enabled``: choose the ``"auto"`` values the planner owns ([Note: planned values] in
  ``terascale.plan.apply``) and check explicit settings against the machine at
  ``terascale.initialize``. Off: ``"auto"`` in ``zero_optimization`` means DeepSpeed's
  default, as before the planner, and nothing is checked.
* ``margin``: the share of each limit kept free (0.1: a plan fits when its predicted peak
  is at most 90% of the memory there is).
* ``host_memory``, ``device_memory``, ``disk_space``: caps that make the planner see a
  smaller machine (host memory of the node, memory of one device, free space at the NVMe
  path), as bytes or a size (``"4GiB"``, ``"512MB"``, ``"2e9"``). The planner takes the
  smaller of a cap and what the machine has (available memory, a cgroup's limit, the
  process's address-space limit).
* ``disk_bandwidth``: the NVMe path's speed in GB/s, instead of measuring it.
* ``refuse_explicit``: refuse at ``initialize`` an explicit setting whose model states
  alone cannot fit (a ValueError naming the category and by how much).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from terascale.config.section import Section

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """Bytes from a number or a size string (``"4GiB"``, ``"512 MB"``, ``"2e9"``).

    Raises ValueError naming the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes or a string such as '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str) and _SIZE.match(value):
        text, unit = _SIZE.match(value).groups()
        number = float(text)
    else:
        raise ValueError(f"expected a size in bytes or a string such as '4GiB' or '512MB', got {value!r}")
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    if number <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return int(number * factor)


ByteSize = Annotated[int, BeforeValidator(parse_bytes)]


class PlannerConfig(Section):
    """``planner``: see the module docstring."""

    enabled: bool = True
    margin: float = Field(0.1, ge=0.0, lt=1.0)
    host_memory: ByteSize | None = None
    device_memory: ByteSize | None = None
    disk_space: ByteSize | None = None
    disk_bandwidth: float | None = Field(None, gt=0.0)  # GB/s
    refuse_explicit: bool = True
