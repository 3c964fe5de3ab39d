"""The error terascale raises for a program's misuse of its API.

[Note: refusals DeepSpeed asserts]
DeepSpeed checks many misuses of its API with ``assert`` (``initialize`` without a model,
``no_sync()`` at ZeRO stage 2, ``backward`` on an engine without an optimizer, a config
whose batch sizes disagree), so programs and test suites written for it catch
AssertionError. terascale reports a user's mistake as a ValueError whose message says
what to change. :class:`UsageError` is both, so code written with either habit catches
it; invariants of terascale's own stay plain ``assert``.
"""

from __future__ import annotations


class UsageError(ValueError, AssertionError):
    """A call or config that terascale refuses (see [Note: refusals DeepSpeed asserts])."""
