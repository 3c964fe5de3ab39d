"""``add_config_arguments``: the command-line flags a training script needs for its config."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class _StoreUnderBothNames(argparse.Action):
    """Store an option under its terascale and its DeepSpeed attribute name at once.

    Scripts written for DeepSpeed read ``args.deepspeed`` / ``args.deepspeed_config``;
    terascale reads ``args.terascale`` / ``args.config``. Whichever spelling the user
    typed, both attributes see it. ``switch=True`` makes a store-true flag.
    """

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, names: tuple[str, str], switch: bool = False, **kwargs: Any
    ) -> None:
        if switch:
            kwargs.update(nargs=0, default=False)
        super().__init__(option_strings, dest, **kwargs)
        self.names = names
        self.switch = switch

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        for name in self.names:
            setattr(namespace, name, True if self.switch else values)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add terascale's flags to ``parser`` and return it.

    ``--config`` (alias ``--deepspeed_config``, as in DeepSpeed scripts) is the config path,
    stored in both ``args.config`` and ``args.deepspeed_config``; ``--terascale`` /
    ``--deepspeed`` are store-true switches a script may use to turn terascale on, stored
    in both ``args.terascale`` and ``args.deepspeed``.
    """
    group = parser.add_argument_group("terascale", "terascale configuration")
    switch = dict(action=_StoreUnderBothNames, names=("terascale", "deepspeed"), switch=True)
    group.add_argument("--terascale", dest="terascale", help="enable terascale (same as --deepspeed)", **switch)
    group.add_argument(
        "--deepspeed",
        dest="deepspeed",
        help="enable terascale; accepted so DeepSpeed launch commands run unchanged",
        **switch,
    )
    group.add_argument(
        "--config",
        "--deepspeed_config",
        dest="config",
        action=_StoreUnderBothNames,
        names=("config", "deepspeed_config"),
        type=str,
        default=None,
        help="path to a terascale / DeepSpeed JSON config file",
    )
    parser.set_defaults(deepspeed_config=None)
    return parser
