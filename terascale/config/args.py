"""``add_config_arguments``: the command-line flags a training script needs for its config."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class _EnableEngine(argparse.Action):
    """``--terascale`` and ``--deepspeed`` are one switch: either sets both attributes.

    Scripts written for DeepSpeed test ``args.deepspeed``; terascale scripts may test
    ``args.terascale``; both must see the flag whichever spelling the user typed.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        namespace.terascale = True
        namespace.deepspeed = True


class _ConfigPath(argparse.Action):
    """``--config`` and ``--deepspeed_config`` store the path in both attributes.

    DeepSpeed scripts read ``args.deepspeed_config``; terascale reads ``args.config``.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        namespace.config = values
        namespace.deepspeed_config = values


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add terascale's flags to ``parser`` and return it.

    ``--config`` (alias ``--deepspeed_config``, as in DeepSpeed scripts) is the config path,
    stored in both ``args.config`` and ``args.deepspeed_config``; ``--terascale`` / ``--deepspeed`` are store-true switches a
    script may use to turn terascale on, stored in both ``args.terascale`` and
    ``args.deepspeed``.
    """
    group = parser.add_argument_group("terascale", "terascale configuration")
    group.add_argument(
        "--terascale",
        action=_EnableEngine,
        dest="terascale",
        help="enable terascale (same as --deepspeed)",
    )
    group.add_argument(
        "--deepspeed",
        action=_EnableEngine,
        dest="deepspeed",
        help="enable terascale; accepted so DeepSpeed launch commands run unchanged",
    )
    group.add_argument(
        "--config",
        "--deepspeed_config",
        dest="config",
        action=_ConfigPath,
        type=str,
        default=None,
        help="path to a terascale / DeepSpeed JSON config file",
    )
    parser.set_defaults(deepspeed_config=None)
    return parser
