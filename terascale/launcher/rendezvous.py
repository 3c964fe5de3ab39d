"""The c10d rendezvous settings ``terascale run`` gives torchrun: fast recovery, no split jobs.

[Note: rendezvous settings]
Across nodes torchrun's agents meet in a c10d rendezvous; its settings decide two things
that pull against each other.

* How fast a job re-forms after a node is lost. The survivors' workers fail within a
  fraction of a second (their peer's connections close), but the survivors' agents may
  form the next round only once the lost node counts as dead: its last keep-alive is
  older than ``keep_alive_interval * keep_alive_max_attempt``. Then the round waits
  ``last_call_timeout`` for more nodes before it starts at the smaller world. torch's
  defaults (5 s x 3 attempts, last call 30 s) cost about 45 s of silence per node loss.
* Whether a job can split. A live node whose keep-alives are late by more than that
  expiry is taken for dead; a node that joins then can form a round of its own while the
  late node's workers go on in the old one (torch's agents watch only for nodes waiting
  to join, not for a newer round): two jobs, both writing checkpoints. The expiry must
  stay well above any pause an agent's keep-alive thread can see.

terascale's defaults: keep-alive every 1 s, dead after 5 missed (5 s; an agent is an
almost idle process whose keep-alive thread wakes each second, so a 5 s pause means a
machine in trouble), last call 2 s (how long a formed quorum waits for stragglers: at job
start a node that arrives later is admitted by a restart of the workers, which costs a
few seconds but no work). A node loss then costs about 5 + 2 s before the new round plus
the workers' start and resume. Settings below the safe floor (fewer than 3 attempts, or
an expiry under 4 s) are refused: they let one slow keep-alive split the job. Whatever
the settings, the checkpoint directory's lease ([Note: checkpoint directory lease]) keeps
a second formation from writing.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

__all__ = ["DEFAULTS", "MIN_ATTEMPTS", "MIN_EXPIRY_S", "format_conf", "parse_conf", "rendezvous_conf"]

DEFAULTS: Mapping[str, int] = {"keep_alive_interval": 1, "keep_alive_max_attempt": 5, "last_call_timeout": 2}
MIN_ATTEMPTS = 3
MIN_EXPIRY_S = 4
# What torch's c10d rendezvous reads from --rdzv_conf (values are whole seconds or counts).
_INTEGER_KEYS = frozenset({
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt", "read_timeout",
})  # fmt: skip
_OTHER_KEYS = frozenset({"is_host", "store_type"})
_KEYS = sorted(_INTEGER_KEYS | _OTHER_KEYS)


def parse_conf(spec: str | None) -> dict[str, str]:
    """``"k=v,k=v"`` (torchrun's ``--rdzv_conf`` syntax) as a dict; ValueError for a pair
    without ``=`` or a key torch's c10d rendezvous does not read (naming the nearest)."""
    conf: dict[str, str] = {}
    for pair in (spec or "").split(","):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise ValueError(f"--rdzv_conf {spec!r}: write KEY=VALUE pairs separated by commas, got {pair!r}")
        if key not in _KEYS:
            near = difflib.get_close_matches(key, _KEYS, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else f"; known keys: {', '.join(_KEYS)}"
            raise ValueError(f"--rdzv_conf: unknown key '{key}'{hint}")
        conf[key] = value.strip()
    return conf


def format_conf(conf: Mapping[str, object]) -> str:
    return ",".join(f"{k}={v}" for k, v in conf.items())


def rendezvous_conf(spec: str | None) -> str:
    """The ``--rdzv_conf`` value for torchrun: the user's ``spec`` over :data:`DEFAULTS`.

    Raises ValueError for a non-integer or non-positive timing, and for keep-alive
    settings that can split a job (``keep_alive_max_attempt`` < 3, or an expiry
    ``keep_alive_interval * keep_alive_max_attempt`` under 4 s): see [Note: rendezvous
    settings].
    """
    conf: dict[str, object] = dict(DEFAULTS)
    for key, value in parse_conf(spec).items():
        if key in _INTEGER_KEYS:
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"--rdzv_conf {key}={value}: torch reads it as whole seconds (an integer)") from None
            if number < 1:
                raise ValueError(f"--rdzv_conf {key}={value}: must be at least 1")
            conf[key] = number
        else:
            conf[key] = value
    interval, attempts = int(conf["keep_alive_interval"]), int(conf["keep_alive_max_attempt"])  # type: ignore[call-overload]
    if attempts < MIN_ATTEMPTS or interval * attempts < MIN_EXPIRY_S:
        raise ValueError(
            f"--rdzv_conf keep_alive_interval={interval},keep_alive_max_attempt={attempts}: a node would count "
            f"as dead after {interval * attempts} s without a keep-alive, and one late keep-alive could split the "
            f"job in two (each training and saving on its own). Use keep_alive_max_attempt >= {MIN_ATTEMPTS} and "
            f"keep_alive_interval * keep_alive_max_attempt >= {MIN_EXPIRY_S} s (default "
            f"{DEFAULTS['keep_alive_interval']} s x {DEFAULTS['keep_alive_max_attempt']})"
        )
    return format_conf(conf)
