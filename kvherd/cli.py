"""The `kvherd` command line: one entry point, one module per subcommand.

Each subcommand lives in the package that owns it and exposes ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only for the command being run (and for its ``--help``), so
``kvherd sim`` never loads torch and ``kvherd --help`` starts instantly. Every command but ``serve``
and ``up`` (whose files also list instances and keys) takes ``--config FILE``, its flags as YAML
(`kvherd.cli_config`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvherd import __version__
from kvherd.cli_config import CONFIG_FLAG, add_config_flag, apply_config

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("instance_agent.generate_cli", "generate text with the built-in paged engine"),
    "agent": ("instance_agent.agent_cli", "run an instance agent (OpenAI API + KV events)"),
    "profile": (
        "instance_agent.profile_cli",
        "measure the engine's step time and fit a latency model",
    ),
    "serve": ("scheduler.serve_cli", "run the KV-aware reverse proxy in front of a fleet"),
    "up": ("scheduler.up_cli", "start N local agents and the proxy in one command"),
    "sim": ("simulator.sim_cli", "simulate a trace on a fleet, policies side by side"),
    "plan": ("simulator.plan_cli", "search the cheapest fleet that meets SLOs on a trace"),
    "replay": ("simulator.replay_cli", "replay a trace against an OpenAI-compatible endpoint"),
}


def _build_parser(command: str | None, argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvherd",
        description="KV-cache-aware cluster scheduler for LLM serving fleets.",
    )
    parser.add_argument("--version", action="version", version=f"kvherd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        cmd_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:  # only the chosen command's module is imported
            importlib.import_module(module_name).add_arguments(cmd_parser)
            if not any(CONFIG_FLAG in a.option_strings for a in cmd_parser._actions):
                add_config_flag(cmd_parser)
                apply_config(cmd_parser, argv)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = _build_parser(command if command in COMMANDS else None, args_list)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
