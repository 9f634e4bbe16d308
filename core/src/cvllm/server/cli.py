"""The ``cvserve`` command: flags (candle-vllm's short names and vLLM's long ones) → ``ServerArgs``
→ ``cvllm.server.run.serve``. docs/cli.md is the table of every flag; ``cvserve --help`` says the same."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cvllm import hub
from cvllm.engine.config import EngineConfig
from cvllm.sampling_params import SamplingParams
from cvllm.server.args import ServerArgs
from cvllm.server.cli_flags import MIB, CliError, build_parser, parse_name_list, ui_settings
from cvllm.server.listen import AddressError, check_address

logger = logging.getLogger("cvllm.cvserve")


def _resolve_model(ns: argparse.Namespace) -> tuple[str, list[str]]:
    """(path the engine opens, served names implied by how the model was named)."""
    if ns.w and ns.model and not _same_path(ns.w, ns.model):
        raise CliError(f"--w {ns.w} and --model {ns.model} name different models; give one of them")
    if not ns.w and ns.m and ns.model and ns.m != ns.model:
        raise CliError(f"--m {ns.m} and --model {ns.model} name different models; give one of them")
    source = ns.w or ns.model or ns.m
    if source is None and ns.f:
        return _weight_file(ns.f), []
    if source is None:
        return _demo_model()
    # With --w, candle-vllm's --m is the model's name rather than where it comes from.
    implied_names = [ns.m] if ns.w and ns.m else []
    path = Path(source).expanduser()
    if path.exists():  # a local path wins over a repo id of the same spelling
        if ns.f:
            if not path.is_dir():
                raise CliError(f"--f {ns.f} names a file inside a directory, but {path} is a file")
            path = path / ns.f
            if not path.exists():
                raise CliError(f"--f {ns.f}: no such file in {path.parent}")
        if path.suffix.lower() == ".gguf":
            _check_gguf_reader(str(path))
        return str(path), implied_names
    if ns.w:
        raise CliError(f"--w {ns.w}: no such file or directory")
    try:
        path = hub.resolve(source, ns.f, download=ns.download, revision=ns.revision)
    except hub.HubError as exc:
        raise CliError(str(exc)) from None
    if path.suffix.lower() == ".gguf":
        _check_gguf_reader(f"{source}/{path.name}")
    # A snapshot directory is named by its commit hash: serve the repo id instead, as vLLM does.
    return str(path), implied_names or [source]


def _weight_file(name: str) -> str:
    """candle-vllm's README form ``--f /path/model.gguf``: with no --w/--m to be inside of, --f is the
    file's own path (served under its file name, as candle-vllm names it)."""
    path = Path(name).expanduser()
    if not path.is_file():
        raise CliError(f"--f {name}: no such file (with no --w or --m, --f is the path of a weight file)")
    if path.suffix.lower() == ".gguf":
        _check_gguf_reader(str(path))
    return str(path)


def _demo_model() -> tuple[str, list[str]]:
    """No model named: the demo model (SmolLM2-135M-Instruct Q4_1 GGUF), fetched into the cache the first time."""
    _check_gguf_reader("the demo model")
    from cvllm import demo

    try:
        path = demo.demo_model_path()
    except demo.DemoModelError as exc:
        raise CliError(str(exc)) from None
    logger.info("no model given (--w PATH or --m ORG/NAME): serving the demo model %s", path)
    return str(path), [demo.DEMO_NAME]


def _check_gguf_reader(what: str) -> None:
    """A .gguf file needs the cvllm-gguf plugin: say so now rather than fail inside the engine (the
    plugin registers the "gguf" quantizer alongside its checkpoint reader)."""
    from cvllm import plugins

    if "gguf" not in plugins.quantizers():
        raise CliError(f"{what} is a GGUF file, which needs the cvllm-gguf plugin: install it "
                       "(pip install -e ./plugins/quant-gguf), or serve another model with --w PATH")


def _same_path(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _tensor_parallel(ns: argparse.Namespace, num_nodes: int) -> dict:
    """EngineConfig's tensor_parallel_size (all ranks, on all nodes) and device_ids (a node's): one rank per device
    of --d on each node (candle-vllm), or --tensor-parallel-size ranks in all (vLLM), taking each node's first
    devices. On the CPU, --d 0,1 means two ranks (processes)."""
    devices = ns.d or []
    size = ns.tensor_parallel_size
    if devices and size is not None and size != len(devices) * num_nodes:
        raise CliError(f"--d {','.join(map(str, devices))} is {len(devices)} device(s) on each of {num_nodes} "
                       f"node(s), but --tensor-parallel-size is {size}")
    return {"tensor_parallel_size": size or len(devices) * num_nodes or num_nodes,
            "device_ids": tuple(devices) or None}


def node_settings(ns: argparse.Namespace):
    """The multi-node settings (NodeSettings): the flags, else torchrun's / mpirun's variables."""
    from cvllm.engine.tensor_parallel import multinode

    names = ("num_nodes", "node_rank", "master_addr", "master_port")
    given = {name for name in names if getattr(ns, name) is not None}
    flags = multinode.NodeSettings(**{name: getattr(ns, name) for name in given}, source="flags")
    try:
        settings = multinode.merge(flags, multinode.from_launcher_env(), given)
        multinode.check_values(settings)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if settings.num_nodes > 1 and not (settings.master_addr and settings.master_port):
        raise CliError(f"--num-nodes {settings.num_nodes} needs --master-addr and --master-port (node 0's address "
                       "and a free port there, the same on every node)")
    return settings


def _node_fields(settings) -> dict:
    return {name: getattr(settings, name) for name in ("num_nodes", "node_rank", "master_addr", "master_port")}


def _log_multithread(ns: argparse.Namespace) -> None:
    if ns.multithread:
        # torch.distributed keeps one default process group per process, and threads would share one interpreter's
        # GIL for the Python between kernels: one thread per rank is neither possible nor faster, so ranks stay
        # processes (the engine's process is rank 0).
        logger.info("--multithread: running each tensor-parallel rank as its own process instead (torch.distributed "
                    "has one process group per process, and threads would share the GIL)")


def _kv_memory(ns: argparse.Namespace) -> dict:
    """EngineConfig fields for the KV pool size. Precedence: --num-kv-blocks > --mem > --kv-fraction
    > --gpu-memory-utilization; the losers are reported, never silently dropped."""
    given = [(flag, value) for flag, value in (
        ("--num-kv-blocks", ns.num_kv_blocks), ("--mem", ns.mem), ("--kv-fraction", ns.kv_fraction),
        ("--gpu-memory-utilization", ns.gpu_memory_utilization)) if value is not None]
    if not given:
        return {}
    (winner, value), ignored = given[0], given[1:]
    if ignored:
        logger.warning("%s %s sets the KV cache size; ignoring %s", winner, value,
                       ", ".join(f"{flag} {v}" for flag, v in ignored))
    if winner == "--num-kv-blocks":
        return {"num_kv_blocks": value}
    if winner == "--mem":
        return {"kv_cache_memory": value * MIB}
    if winner == "--kv-fraction":
        return {"kv_fraction": value}
    return {"gpu_memory_utilization": value}


def _quantization(ns: argparse.Namespace) -> dict:
    if ns.isq is None:
        return {}
    from cvllm import plugins
    from cvllm.layers.quantization import isq_quantizer

    quantizers = plugins.quantizers()
    if isq_quantizer(ns.isq, quantizers) not in quantizers:
        raise CliError(f"--isq {ns.isq}: in-situ quantization needs the cvllm-gguf plugin "
                       f"(quantizers installed: {', '.join(quantizers.names()) or 'none'})")
    return {"isq": ns.isq}


def _check_backend(name: str | None) -> None:
    if name is None:
        return
    from cvllm import plugins

    names = plugins.backends().names()
    if name not in names:
        raise CliError(f"--backend {name}: no such backend; installed: {', '.join(names)}")


def _check_chat_template(template: str | None) -> None:
    if template is None or "{{" in template or "{%" in template:
        return  # the template text itself
    if not Path(template).expanduser().is_file():
        raise CliError(f"--chat-template {template}: no such file (and not template text either)")


def _default_sampling(ns: argparse.Namespace) -> dict:
    names = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
             "repetition_penalty")
    defaults = {name: getattr(ns, name) for name in names if getattr(ns, name) is not None}
    try:
        SamplingParams(**defaults)  # the same validation a request's values get
    except ValueError as exc:
        raise CliError(f"bad sampling default: {exc}") from None
    return defaults


def _engine_config(ns: argparse.Namespace, model: str) -> EngineConfig:
    _check_backend(ns.backend)
    nodes = node_settings(ns)
    fields = dict(
        **_tensor_parallel(ns, nodes.num_nodes), **_node_fields(nodes),
        model=model, dtype=ns.dtype, backend=ns.backend, block_size=ns.block_size, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens, max_model_len=ns.max_model_len,
        prefill_chunk_size=ns.prefill_chunk_size, enable_prefix_caching=not ns.disable_prefix_cache, seed=ns.seed,
        fake_step_ms=ns.fake_step_ms, enforce_eager=ns.enforce_eager, async_scheduling=ns.async_scheduling,
        enable_expert_parallel=ns.enable_expert_parallel, kv_cache_dtype=ns.kv_cache_dtype,
        num_experts_offload_per_rank=ns.num_experts_offload_per_rank, speculative_config=ns.speculative_config,
    )
    _log_multithread(ns)
    fields.update(_kv_memory(ns))
    fields.update(_quantization(ns))
    try:
        return EngineConfig(**fields)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    """Check the parsed flags against each other and turn them into ``ServerArgs`` (resolving
    ``--m org/name`` through the Hugging Face cache)."""
    _check_chat_template(ns.chat_template)
    default_sampling = _default_sampling(ns)
    model, implied_names = _resolve_model(ns)
    engine = _engine_config(ns, model)
    api_key = ns.api_key if ns.api_key is not None else os.environ.get("CVLLM_API_KEY")
    return ServerArgs(
        engine=engine, host=ns.host, port=ns.port,
        served_model_names=ns.served_model_name or implied_names, strict_model_name=ns.strict_model_name,
        api_key=api_key or None, chat_template=ns.chat_template, max_queue=ns.max_queue,
        max_body_bytes=ns.max_body_size, cors_allow_origins=parse_name_list(ns.allowed_origins, []),
        cors_allow_credentials=ns.allow_credentials, cors_allow_methods=parse_name_list(ns.allowed_methods, ["*"]),
        cors_allow_headers=parse_name_list(ns.allowed_headers, ["*"]), shutdown_timeout=ns.shutdown_timeout,
        max_restarts=ns.max_restarts, engine_hang_timeout=ns.engine_hang_timeout,
        default_sampling=default_sampling, generation_config=ns.generation_config,
        reasoning_parser=ns.reasoning_parser, tool_call_parser=ns.tool_call_parser, log_level=ns.log_level,
        startup_timeout=ns.startup_timeout, task=ns.task, **ui_settings(ns),
    )


def build_server_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse ``argv`` and build the ``ServerArgs``; raises ``CliError`` (or SystemExit from argparse)."""
    return server_args_from(build_parser().parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        nodes = node_settings(ns)
    except CliError as exc:
        print(f"cvserve: error: {exc}", file=sys.stderr)
        return 2
    if nodes.node_rank > 0:   # not node 0: no model to resolve, no HTTP; this node's ranks, until they end
        from cvllm.engine.tensor_parallel.node import run_node

        try:
            return run_node(nodes)
        except (RuntimeError, ValueError) as exc:   # node 0 not reached in time, or its settings disagree
            print(f"cvserve: error: node {nodes.node_rank}: {exc}", file=sys.stderr)
            return 1
    try:
        # the address first: a port in use should not wait for the model to be resolved, fetched or loaded
        check_address(ns.host, ns.port)
        ui_port = ui_settings(ns).get("ui_port")
        if ui_port:
            check_address(ns.host, ui_port)
        args = server_args_from(ns)
    except (AddressError, CliError) as exc:
        print(f"cvserve: error: {exc}", file=sys.stderr)
        return 2
    # Imported here, not at the top: parsing and --help stay fast and testable without the server stack.
    run = importlib.import_module("cvllm.server.run")
    return run.serve(args)


if __name__ == "__main__":
    sys.exit(main())
