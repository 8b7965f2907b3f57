"""``--config FILE``: a YAML mapping of a command's flags, the same keys as the flags themselves.

Contract:
- A key is a flag's long name with or without its dashes, ``-`` or ``_`` alike (``max-num-seqs``,
  ``max_num_seqs``); a positional takes its own name (``trace``). Its value is what the flag would
  take: a string is parsed as on the command line, a list fills a repeatable flag, ``true``
  sets a switch.
- Flags given on the command line win over the file; the file wins over the defaults.
- A key that names no flag of the command, a value outside a flag's choices, or a file that is
  not a mapping is a usage error naming the file and the key (argparse's exit 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

CONFIG_FLAG = "--config"


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        CONFIG_FLAG,
        metavar="FILE",
        default=None,
        help="YAML file of this command's flags (keys: the flags' names); flags given win",
    )


def apply_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Read ``--config FILE`` from `argv` (if any) and make its keys `parser`'s defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(CONFIG_FLAG, default=None)
    path = pre.parse_known_args(list(argv))[0].config
    if path is None:
        return
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"{CONFIG_FLAG} {path}: {exc}")
    if not isinstance(data, dict):
        parser.error(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values")
    actions = {_key(a.dest): a for a in parser._actions if a.dest not in ("help", "config")}
    for option_action in parser._actions:
        for option in option_action.option_strings:
            if option.startswith("--"):
                actions.setdefault(_key(option), option_action)
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        action = actions.get(_key(str(key)))
        if action is None:
            parser.error(f"{CONFIG_FLAG} {path}: {key!r} is not a flag of this command")
        if action.choices is not None and value not in action.choices:
            parser.error(f"{CONFIG_FLAG} {path}: {key}: {value!r} is not one of {action.choices}")
        if not action.option_strings and action.nargs is None:  # a positional the file gives
            action.nargs = "?"
        action.required = False  # the file gave it
        defaults[action.dest] = value
    parser.set_defaults(**defaults)


def _key(name: str) -> str:
    return name.lstrip("-").replace("-", "_")
