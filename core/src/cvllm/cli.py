"""The ``cvllm`` command. Each subcommand is a pair of small functions: ``_add_<name>`` declares
its arguments and ``_run_<name>`` does the work and returns the exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from cvllm import plugins

Command = Callable[[argparse.Namespace], int]


def _add_plugins(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plugins", help="list installed plugins and what each registered",
        description="List the loaded plugins (built-in and entry-point ones) and, per hook, the names "
                    "each registered. Exits 1 if two plugins register the same name.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=_run_plugins)


def _run_plugins(args: argparse.Namespace) -> int:
    report = plugins.plugin_report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format_plugin_report(report), end="")
    problems = plugins.registry_problems()
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _format_plugin_report(report: list[dict]) -> str:
    lines = []
    for entry in report:
        if entry["builtin"]:
            origin = "built in"
        elif entry["distribution"]:
            origin = f"{entry['distribution']} {entry['version']}"
        else:
            origin = "registered at run time"
        lines.append(f"{entry['name']} ({origin})")
        if entry["error"]:
            lines.append(f"  failed to load: {entry['error']}")
        for hook in entry["hooks"]:
            lines.append(f"  {hook}")
            for name, target in entry["registered"].get(hook, {}).items():
                lines.append(f"    {name} = {target}")
    return "\n".join(lines) + "\n" if lines else "no plugins loaded\n"


# Later subcommands (chat, bench, convert) add one _add_<name> function here.
_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_plugins,)


def _version() -> str:
    try:
        return metadata.version("cvllm")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cvllm", description="cvllm: LLM inference with plugins")
    parser.add_argument("--version", action="version", version=f"cvllm {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Command | None = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run(args)
    except BrokenPipeError:  # `cvllm plugins | head`: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
