"""DeepSpeed-format hostfiles and ``--include``/``--exclude`` resource filters.

A hostfile lists the machines of a job, one per line, with the number of
accelerator slots each offers::

    # comment
    worker-0 slots=8
    worker-1 slots=8   # trailing comments are allowed

A resource filter selects slots from that pool with DeepSpeed's syntax
``NODE_SPEC[@NODE_SPEC ...]`` where ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``;
a bare ``NAME`` means every slot of that host.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["filter_hosts", "parse_hostfile", "read_hostfile"]

_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\d+)$")


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Parse hostfile ``text`` into ``{hostname: slots}`` in file order.

    Blank lines and ``#`` comments (whole-line or trailing) are ignored.
    Raises ``ValueError`` naming ``source`` and the 1-based line number for a
    malformed line, a host listed twice, a host with zero slots, or a file
    that lists no host at all.
    """
    hosts: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if match is None:
            raise ValueError(
                f"{source}, line {lineno}: expected 'HOSTNAME slots=N', got {raw.strip()!r}"
            )
        host, slots = match["host"], int(match["slots"])
        if host in hosts:
            raise ValueError(
                f"{source}, line {lineno}: host {host!r} is listed more than once; "
                "keep one line per host"
            )
        if slots < 1:
            raise ValueError(
                f"{source}, line {lineno}: host {host!r} has slots={slots}; "
                "use a positive number or remove the line"
            )
        hosts[host] = slots
    if not hosts:
        raise ValueError(f"{source} lists no hosts; add lines of the form 'HOSTNAME slots=N'")
    return hosts


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read hostfile {str(path)!r}: {exc.strerror or exc}") from exc
    return parse_hostfile(text, source=str(path))


def _parse_node_spec(spec: str, hosts: Mapping[str, int], flag: str) -> tuple[str, list[int] | None]:
    """Split one ``NAME[:SLOT,...]`` spec; ``None`` slots means the whole host."""
    if not spec:
        raise ValueError(f"{flag}: empty host entry; separate hosts with a single '@'")
    # A name that is itself a host (e.g. an IPv6 address containing ':') is a whole-host spec.
    if spec in hosts:
        return spec, None
    if ":" not in spec:
        raise ValueError(f"{flag}: host {spec!r} is not in the hostfile (hosts: {', '.join(hosts)})")
    host, slot_text = spec.rsplit(":", 1)
    if host not in hosts:
        raise ValueError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(hosts)})")
    slots: list[int] = []
    for item in slot_text.split(","):
        try:
            slot = int(item)
        except ValueError:
            raise ValueError(
                f"{flag}: slot {item!r} of host {host!r} is not an integer; "
                "write slots as HOST:0,1,2"
            ) from None
        if not 0 <= slot < hosts[host]:
            raise ValueError(
                f"{flag}: host {host!r} has no slot {slot} "
                f"(the hostfile gives it slots 0..{hosts[host] - 1})"
            )
        slots.append(slot)
    return host, slots


def _dedupe(items: list[int]) -> list[int]:
    return list(dict.fromkeys(items))


def filter_hosts(
    hosts: Mapping[str, int], include: str = "", exclude: str = ""
) -> dict[str, list[int]]:
    """Select slots from the pool ``hosts`` (``{hostname: slot count}``).

    With neither filter every slot of every host is used. ``include`` starts
    from nothing and adds the named hosts/slots (slots keep the order given,
    duplicates dropped); ``exclude`` starts from everything and removes them.
    Hosts left with no slot are dropped; the result follows hostfile order.
    Raises ``ValueError`` when both filters are given, a host or slot is not in
    the pool, or nothing is left.
    """
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive; give only one")
    if not include and not exclude:
        return {host: list(range(n)) for host, n in hosts.items()}

    flag = "--include" if include else "--exclude"
    chosen: dict[str, list[int]]
    if include:
        chosen = {}
        for spec in include.split("@"):
            host, slots = _parse_node_spec(spec, hosts, flag)
            # Repeated mentions of a host accumulate rather than overwrite.
            chosen.setdefault(host, []).extend(range(hosts[host]) if slots is None else slots)
    else:
        chosen = {host: list(range(n)) for host, n in hosts.items()}
        for spec in exclude.split("@"):
            host, slots = _parse_node_spec(spec, hosts, flag)
            drop = set(range(hosts[host]) if slots is None else slots)
            chosen[host] = [s for s in chosen[host] if s not in drop]

    result = {
        host: _dedupe(chosen[host]) for host in hosts if host in chosen and chosen[host]
    }
    if not result:
        raise ValueError(f"{flag} {include or exclude!r} leaves no slots to run on")
    return result
