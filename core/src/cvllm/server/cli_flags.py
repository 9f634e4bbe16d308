"""``cvserve``'s flags: the argparse parser (candle-vllm's short names, vLLM's long ones), grouped as
``cvserve --help`` shows them. ``cvllm.server.cli`` turns the parsed flags into ``ServerArgs``."""

from __future__ import annotations

import argparse
import json

from cvllm.pooling import TASKS
from cvllm.sampling_defaults import GENERATION_CONFIG_MODES

MIB = 1 << 20


class CliError(ValueError):
    """A flag combination cvserve cannot run with; the message is shown to the user as is."""


# -- flags ---------------------------------------------------------------------------------------

_DESCRIPTION = """\
Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
/health, /metrics ...), with a chat page for browsers at /. Flags take candle-vllm's short names (--w, --m,
--p ...) and vLLM's long names (--model, --port ...); giving both spellings of one setting with different
values is an error.
docs/cli.md has the full table, with the defaults per backend."""

_EPILOG = """\
examples:
  cvserve --w ./my-model                              a Hugging Face model directory
  cvserve --w ./models --f smollm2.Q4_1.gguf          one GGUF file in a directory (cvllm-gguf plugin)
  cvserve --f ./models/smollm2.Q4_1.gguf              the same file by its path (candle-vllm's form)
  cvserve --m Qwen/Qwen3-0.6B --download              fetch from the Hugging Face hub (cached afterwards)
  cvserve --model Qwen/Qwen3-0.6B --port 8000 --api-key secret --served-model-name qwen
  curl http://127.0.0.1:2000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi"}]}'"""

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DTYPES = ("auto", "f32", "f16", "bf16", "float32", "float16", "bfloat16")


class _OneValue(argparse.Action):
    """``store``, except that two spellings of one setting (``--p`` and ``--port``) given different
    values is an error rather than a silent last-one-wins."""

    def __call__(self, parser, namespace, values, option_string=None):
        spelled = namespace.__dict__.setdefault("_spelled", {})
        earlier = spelled.get(self.dest)
        if earlier is not None and earlier[0] != option_string and earlier[1] != values:
            parser.error(f"{earlier[0]} {earlier[1]} and {option_string} {values} disagree; give one of them")
        spelled[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)


def _checked(convert, check, what: str):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    parse.__name__ = what  # argparse names the type in its messages
    return parse


_positive_int = _checked(int, lambda v: v > 0, "a positive integer")
_non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
_port = _checked(int, lambda v: 0 <= v <= 65535, "a port number (0-65535)")
_nonzero_port = _checked(int, lambda v: 0 < v <= 65535, "a port number (1-65535)")   # a peer's: 0 means none
_fraction = _checked(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
_seconds = _checked(float, lambda v: v > 0, "a positive number of seconds")
_seconds_or_off = _checked(float, lambda v: v >= 0, "a number of seconds (0: off)")


def _device_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected device ids such as 0 or 0,1, got {text!r}") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct device ids such as 0 or 0,1, got {text!r}")
    return ids


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): 16M, 1G, 65536."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    body = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = units.get(body[-1:], 1)
    try:
        value = int(float(body[:-1] if scale > 1 else body) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 16M or 1048576, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def parse_name_list(values: list[str] | None, default: list[str]) -> list[str]:
    """CORS lists: repeated values, comma-separated, or vLLM's JSON spelling '["a", "b"]'."""
    if values is None:
        return list(default)
    names: list[str] = []
    for value in values:
        text = value.strip()
        if text.startswith("["):
            try:
                names.extend(str(item) for item in json.loads(text))
                continue
            except (ValueError, TypeError):
                raise CliError(f"expected a JSON list of strings, got {value!r}") from None
        names.extend(part.strip() for part in text.split(",") if part.strip())
    return names


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--w", metavar="PATH", help="local model: a Hugging Face model directory or a weight file")
    g.add_argument("--m", metavar="ORG/NAME",
                   help="Hugging Face repo id (a local path works too); with --w, the name the model is served as")
    g.add_argument("--model", metavar="PATH_OR_ID", help="vLLM's spelling: a local path or a repo id")
    g.add_argument("--f", metavar="FILE", help="one weight file inside the directory or repo, e.g. model.Q4_K_M.gguf; "
                                               "without --w/--m/--model, the path of a weight file")
    g.add_argument("--download", action="store_true",
                   help="allow downloading --m/--model from the Hugging Face hub (default: the local cache only)")
    g.add_argument("--revision", metavar="REV", help="hub branch, tag or commit (default: main)")
    g.add_argument("--dtype", type=str.lower, choices=DTYPES, default="auto", metavar="DTYPE",
                   help=f"{'|'.join(DTYPES)} (default: auto = the checkpoint's)")
    g.add_argument("--isq", metavar="TYPE",
                   help="quantize the weights while loading: GGUF types q4k, q8_0 ... (cvllm-gguf plugin), gptq "
                        "(4-bit round-to-nearest, groups of 128; cvllm-quant-marlin) or fp8 (cvllm-quant-fp8)")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="name(s) clients use in 'model' (default: the repo id, or the path's last component)")
    g.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a 'model' that is not a served name (vLLM's rule; default: any name "
                        "means the served model, as candle-vllm and llama.cpp do)")
    g.add_argument("--chat-template", metavar="FILE_OR_TEXT", help="a Jinja chat template replacing the model's")
    g.add_argument("--reasoning-parser", metavar="NAME",
                   help="how to split <think> text into reasoning_content (default: the model's own)")
    g.add_argument("--task", choices=TASKS, default="auto",
                   help="auto: generation, and /v1/embeddings where the checkpoint declares a sentence-transformers "
                        "pooling (modules.json); embed: /v1/embeddings on any model (the declared pooling, else the "
                        "last token's hidden state, L2-normalised), generation still served; generate: no "
                        "/v1/embeddings (default: auto)")
    g.add_argument("--tool-call-parser", metavar="NAME",
                   help="how to read tool calls out of the model's text: hermes, mistral, llama3_json, deepseek_v3 "
                        "or a plugin's (default: the one the chat template's tool-call format calls for)")


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--h", "--host", dest="host", action=_OneValue, default="127.0.0.1", metavar="HOST",
                   help="address to listen on (default: 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--p", "--port", dest="port", action=_OneValue, type=_port, default=2000, metavar="PORT",
                   help="port to listen on (default: 2000)")
    g.add_argument("--max-queue", type=_non_negative_int, default=1024, metavar="N",
                   help="requests waiting beyond the running ones before answering 429 (default: 1024)")
    g.add_argument("--max-body-size", type=_size, default=16 << 20, metavar="SIZE",
                   help="largest request body, e.g. 16M (default: 16M; larger → 413)")
    g.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="S",
                   help="seconds to let in-flight requests finish on SIGTERM/Ctrl-C (default: 30)")
    g.add_argument("--startup-timeout", type=_seconds, metavar="S",
                   help="seconds to wait for the model to load before giving up (default: no limit)")
    g.add_argument("--max-restarts", type=_non_negative_int, default=3, metavar="N",
                   help="restart a dead engine core up to N times within 10 minutes, then exit non-zero so a "
                        "supervisor takes over (default: 3; 0: exit at the first death)")
    g.add_argument("--engine-hang-timeout", type=_seconds_or_off,
                   default=60.0, metavar="S",
                   help="kill and restart an engine core that has requests in flight but has made no progress for "
                        "S seconds (default: 60; 0: never)")
    g.add_argument("--log", "--log-level", dest="log_level", action=_OneValue, nargs="?", const="debug",
                   type=str.lower, choices=LOG_LEVELS, default="info", metavar="LEVEL",
                   help=f"{'|'.join(LOG_LEVELS)} (default: info; --log alone: debug)")
    g.add_argument("--no-ui", action="store_true", help="do not serve the chat page at / (default: served)")
    g.add_argument("--ui-server", action="store_true",
                   help="serve the chat page on its own port (--ui-port; default: the API's port + 1) instead of at /")
    g.add_argument("--ui-port", type=_port, metavar="PORT", help="the chat page's own port (implies --ui-server)")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine", "KV cache size precedence: --num-kv-blocks > --mem > --kv-fraction "
                                            "> --gpu-memory-utilization")
    g.add_argument("--backend", metavar="NAME", help="cpu, cuda, ... (default: the available backend of highest "
                                                     "priority: cuda, then cpu)")
    g.add_argument("--d", type=_device_ids, metavar="IDS", help="device ids, e.g. 0 or 0,1 (one per tensor-parallel "
                                                                "rank: 0,1 = tensor parallelism over 2; CPU only now)")
    g.add_argument("--tensor-parallel-size", type=_positive_int, metavar="N", help="vLLM's spelling of the device "
                                                                                   "count (default: 1)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM's: MoE experts split whole over the tensor-parallel ranks (E / N each; N must divide E) "
                        "instead of each expert sharded over them; attention stays tensor-parallel (default: off)")
    g.add_argument("--num-experts-offload-per-rank", type=int, default=0, metavar="K",
                   help="candle-vllm's: K experts of every MoE layer in host memory, copied to the device when routed "
                        "(for models whose experts do not fit; costs the copies and CUDA graphs; default: 0)")
    g.add_argument("--multithread", action="store_true",
                   help="candle-vllm's one-thread-per-device debug mode; accepted, but ranks run as processes "
                        "(the start-up log says why)")
    g.add_argument("--mem", type=_positive_int, metavar="MB", help="KV cache size in MiB")
    g.add_argument("--kv-fraction", type=_fraction, metavar="F",
                   help="KV cache size as a share of the memory free after loading the weights")
    g.add_argument("--gpu-memory-utilization", type=_fraction, metavar="F",
                   help="vLLM's: weights + KV cache use at most this share of the device's total memory")
    g.add_argument("--num-kv-blocks", type=_positive_int, metavar="N", help="KV cache size in blocks")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                   help="KV cache element type: auto (the model's) or fp8 (e4m3 with per-layer scales: twice the "
                        "tokens; scales from each layer's first prefill, see docs/cli.md)")
    g.add_argument("--fp8-kvcache", dest="kv_cache_dtype", action="store_const", const="fp8",
                   help="candle-vllm's spelling of --kv-cache-dtype fp8")
    g.add_argument("--block-size", type=_positive_int, default=16, metavar="N",
                   help="tokens per KV block, a power of two (default: 16)")
    g.add_argument("--max-num-seqs", type=_positive_int, metavar="N",
                   help="sequences running at once (default: 16 on CPU, 256 on CUDA)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, metavar="N",
                   help="token budget of one step (default: the backend's; 2048 on CPU)")
    g.add_argument("--max-model-len", type=_positive_int, metavar="N",
                   help="longest prompt + output (default: the model's context, capped to the KV pool)")
    g.add_argument("--prefill-chunk-size", type=_non_negative_int, default=0, metavar="N",
                   help="most prompt tokens one sequence computes per step (default: 0 = the step budget)")
    g.add_argument("--disable-prefix-cache", "--no-enable-prefix-caching", dest="disable_prefix_cache",
                   action="store_true", help="do not reuse the KV cache of shared prompt prefixes")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous one's tokens are read back, so host work overlaps "
                        "the GPU's (default: on, except on the CPU backend)")
    g.add_argument("--speculative-config", type=_json_object, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4}\' (docs/speculative.md)')
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: launch every decode step's kernels one by one (default: graphs on CUDA)")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling (default: 0)")
    g.add_argument("--fake-step-ms", type=float, metavar="MS",
                   help="benchmarking only: load no model; each engine step takes MS milliseconds and yields "
                        "fixed tokens (measures everything around the model)")


def _add_multi_node_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-node", "parsed and checked, but more than one node is not supported yet; "
                                                "unset flags come from torchrun's or mpirun's environment")
    g.add_argument("--num-nodes", type=_positive_int, metavar="N", help="nodes taking part (default: 1)")
    g.add_argument("--node-rank", type=_non_negative_int, metavar="I", help="this node's rank, 0..N-1 (default: 0)")
    g.add_argument("--master-addr", metavar="HOST", help="node 0's address as every node reaches it")
    g.add_argument("--master-port", type=_nonzero_port,
                   metavar="PORT", help="node 0's port for the process group")


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling defaults", "used when a request leaves the field out; they win over "
                                                       "the model's defaults")
    g.add_argument("--generation-config", choices=GENERATION_CONFIG_MODES, default="auto",
                   help="auto: the model's sampling defaults (generation_config.json; a GGUF's general.sampling.*, "
                        "else llama.cpp's); vllm: ignore them, use vLLM's plain defaults below (default: auto)")
    g.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default: 1.0)")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass (default: 1.0)")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (default: 0 = off)")
    g.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P × the top probability (default: 0)")
    g.add_argument("--frequency-penalty", type=float, metavar="X", help="-2..2, over the output (default: 0)")
    g.add_argument("--presence-penalty", type=float, metavar="X", help="-2..2, over the output (default: 0)")
    g.add_argument("--repetition-penalty", "--penalty", dest="repetition_penalty", action=_OneValue, type=float,
                   metavar="X", help="> 0, over prompt and output; 1 = off (default: 1.0)")


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security")
    g.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                        "(default: $CVLLM_API_KEY, else none)")
    g.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                   help="CORS origins allowed to call the API, e.g. http://localhost:3000 (default: none)")
    g.add_argument("--allowed-methods", nargs="+", metavar="METHOD", help="CORS methods (default: *)")
    g.add_argument("--allowed-headers", nargs="+", metavar="HEADER", help="CORS headers (default: *)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and auth headers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cvserve", description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_flags(parser)
    _add_server_flags(parser)
    _add_engine_flags(parser)
    _add_multi_node_flags(parser)
    _add_sampling_flags(parser)
    _add_security_flags(parser)
    return parser


# -- flags → ServerArgs --------------------------------------------------------------------------


def ui_settings(ns: argparse.Namespace) -> dict:
    """ServerArgs' ``ui`` and ``ui_port`` from --no-ui, --ui-server and --ui-port."""
    if ns.no_ui and (ns.ui_server or ns.ui_port is not None):
        raise CliError("--no-ui turns the chat page off, --ui-server and --ui-port serve it; give one of them")
    if ns.no_ui:
        return {"ui": False}
    if not ns.ui_server and ns.ui_port is None:
        return {}
    port = ns.ui_port if ns.ui_port is not None else (ns.port + 1 if ns.port else 0)
    if port > 65535:
        raise CliError(f"--ui-server: the API's port + 1 ({port}) is not a port; give --ui-port PORT")
    if port and port == ns.port:
        raise CliError(f"--ui-port {port} is the API's port too; give another (default: the API's port + 1)")
    return {"ui_port": port}


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
