"""cvserve's flags → ServerArgs: defaults, aliases, precedence, conflicts and errors (no server is started)."""

from __future__ import annotations

import logging

import pytest

from cvllm.engine.config import EngineConfig
from cvllm.hookspecs import hookimpl
from cvllm.plugins import get_plugin_manager, reset_plugins
from cvllm.server.cli import MIB, CliError, build_server_args, main


def test_defaults_for_a_local_model(model_dir):
    args = build_server_args(["--w", str(model_dir)])
    assert (args.host, args.port, args.api_key, args.served_model_names) == ("127.0.0.1", 2000, None, [])
    assert (args.max_queue, args.max_body_bytes, args.shutdown_timeout, args.log_level) == (1024, 16 << 20, 30.0,
                                                                                           "info")
    assert (args.cors_allow_origins, args.cors_allow_methods, args.default_sampling) == ([], ["*"], {})
    # Per-backend defaults are left to the engine (None), the rest are EngineConfig's own.
    assert args.engine == EngineConfig(model=str(model_dir))


def test_vllm_long_names(model_dir):
    args = build_server_args([
        "--model", str(model_dir), "--port", "8000", "--host", "0.0.0.0", "--tensor-parallel-size", "1",
        "--max-model-len", "4096", "--max-num-batched-tokens", "1024", "--max-num-seqs", "8",
        "--served-model-name", "a", "b", "--dtype", "BF16", "--block-size", "32", "--prefill-chunk-size", "256",
        "--no-enable-prefix-caching", "--backend", "cpu", "--seed", "7", "--max-queue", "5",
        "--max-body-size", "1M", "--shutdown-timeout", "2.5", "--startup-timeout", "60",
        "--reasoning-parser", "deepseek_r1"])
    e = args.engine
    assert (args.port, args.host, args.served_model_names) == (8000, "0.0.0.0", ["a", "b"])
    assert (e.model, e.max_model_len, e.max_num_batched_tokens, e.max_num_seqs) == (str(model_dir), 4096, 1024, 8)
    assert (e.dtype, e.block_size, e.prefill_chunk_size, e.enable_prefix_caching) == ("bf16", 32, 256, False)
    assert (e.backend, e.seed) == ("cpu", 7)
    assert (args.max_queue, args.max_body_bytes, args.shutdown_timeout, args.startup_timeout) == (5, MIB, 2.5, 60.0)
    assert args.reasoning_parser == "deepseek_r1"


@pytest.mark.parametrize("argv, message", [
    (["--p", "1", "--port", "2"], "--p 1 and --port 2 disagree"),
    (["--h", "0.0.0.0", "--host", "::"], "--h 0.0.0.0 and --host :: disagree"),
    (["--penalty", "1.1", "--repetition-penalty", "1.2"], "--penalty 1.1 and --repetition-penalty 1.2 disagree"),
    (["--log", "--log-level", "info"], "--log debug and --log-level info disagree"),
    (["--p", "70000"], "a port number"),
    (["--dtype", "int8"], "invalid choice"),
    (["--d", "0,0"], "distinct device ids"),
    (["--kv-fraction", "1.5"], "a fraction in (0, 1]"),
    (["--mem", "0"], "a positive integer"),
    (["--max-body-size", "lots"], "a size such as 16M"),
    (["--mod", "x"], "unrecognized arguments"),  # no abbreviations: --mod is not --model
])
def test_usage_errors(argv, message, model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        build_server_args(["--w", str(model_dir), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_same_value_under_both_spellings_is_fine(model_dir):
    args = build_server_args(["--w", str(model_dir), "--p", "8000", "--port", "8000", "--h", "::", "--host", "::"])
    assert (args.port, args.host) == (8000, "::")


def test_log_levels(model_dir):
    assert build_server_args(["--w", str(model_dir), "--log"]).log_level == "debug"
    assert build_server_args(["--w", str(model_dir), "--log", "warning"]).log_level == "warning"
    assert build_server_args(["--w", str(model_dir), "--log-level", "ERROR"]).log_level == "error"


def test_kv_size_precedence(model_dir, caplog):
    w = ["--w", str(model_dir)]
    with caplog.at_level(logging.WARNING, logger="cvllm.cvserve"):
        e = build_server_args([*w, "--mem", "512", "--kv-fraction", "0.5", "--gpu-memory-utilization", "0.9"]).engine
    assert (e.kv_cache_memory, e.kv_fraction, e.num_kv_blocks) == (512 * MIB, None, None)
    assert "ignoring --kv-fraction 0.5, --gpu-memory-utilization 0.9" in caplog.text
    e = build_server_args([*w, "--kv-fraction", "0.5", "--gpu-memory-utilization", "0.9"]).engine
    assert (e.kv_cache_memory, e.kv_fraction) == (None, 0.5)
    e = build_server_args([*w, "--num-kv-blocks", "64", "--mem", "512"]).engine
    assert (e.num_kv_blocks, e.kv_cache_memory) == (64, None)


def test_gpu_memory_utilization_passes_through(model_dir):
    e = build_server_args(["--w", str(model_dir), "--gpu-memory-utilization", "0.9"]).engine
    assert (e.gpu_memory_utilization, e.kv_fraction, e.kv_cache_memory) == (0.9, None, None)


def test_fake_step_ms_passes_through(model_dir):
    assert build_server_args(["--w", str(model_dir), "--fake-step-ms", "5"]).engine.fake_step_ms == 5.0


def test_expert_parallelism_is_off_unless_asked(model_dir):
    w = ["--w", str(model_dir), "--tensor-parallel-size", "2"]
    assert build_server_args(w).engine.enable_expert_parallel is False
    assert build_server_args([*w, "--enable-expert-parallel"]).engine.enable_expert_parallel is True


def test_expert_offload_flag(model_dir):
    w = ["--w", str(model_dir)]
    assert build_server_args(w).engine.num_experts_offload_per_rank == 0
    assert build_server_args([*w, "--num-experts-offload-per-rank", "4"]).engine.num_experts_offload_per_rank == 4


def test_devices_and_tensor_parallelism(model_dir):
    w = ["--w", str(model_dir)]
    assert build_server_args([*w, "--d", "0"]).engine.model == str(model_dir)
    assert build_server_args([*w, "--d", "0"]).engine.tensor_parallel_size == 1
    assert build_server_args([*w, "--d", "0,1"]).engine.tensor_parallel_size == 2   # candle-vllm's spelling
    assert build_server_args([*w, "--tensor-parallel-size", "4"]).engine.tensor_parallel_size == 4
    assert build_server_args([*w, "--d", "0,1", "--tensor-parallel-size", "2"]).engine.tensor_parallel_size == 2
    with pytest.raises(CliError, match="is 2 device\\(s\\) on each of 1 node\\(s\\), but --tensor-parallel-size is 1"):
        build_server_args([*w, "--d", "0,1", "--tensor-parallel-size", "1"])
    # any devices, in the order given: rank r runs on the r-th (Backend.bind_device)
    assert build_server_args([*w, "--d", "3"]).engine.device_ids == (3,)
    engine = build_server_args([*w, "--d", "2,1"]).engine
    assert (engine.tensor_parallel_size, engine.device_ids) == (2, (2, 1))
    assert build_server_args([*w, "--tensor-parallel-size", "2"]).engine.device_ids is None


class _Quantizers:
    @hookimpl
    def register_quantizers(self, register):
        register("isq", "cvllm_fake_gguf:Quantizer")


def test_isq_needs_a_quantizer_plugin(model_dir, monkeypatch):
    # only the llama plugin: an installed cvllm-gguf would register the real "isq" quantizer
    monkeypatch.setenv("CVLLM_PLUGINS", "llama")
    reset_plugins()
    w = ["--w", str(model_dir), "--isq", "q4k"]
    with pytest.raises(CliError, match="in-situ quantization needs the cvllm-gguf plugin"):
        build_server_args(w)
    plugin = _Quantizers()
    get_plugin_manager().register(plugin, name="fake-gguf")
    try:
        assert build_server_args(w).engine.isq == "q4k"
    finally:
        get_plugin_manager().unregister(plugin)
        monkeypatch.delenv("CVLLM_PLUGINS")
        reset_plugins()


def test_sampling_defaults(model_dir):
    args = build_server_args(["--w", str(model_dir), "--temperature", "0.2", "--top-p", "0.9", "--top-k", "40",
                              "--min-p", "0.05", "--frequency-penalty", "0.5", "--presence-penalty", "-0.5",
                              "--penalty", "1.1"])
    assert args.default_sampling == {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                                     "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1}
    with pytest.raises(CliError, match=r"top_p must be in \(0, 1\]"):
        build_server_args(["--w", str(model_dir), "--top-p", "1.5"])
    with pytest.raises(CliError, match="temperature must be >= 0"):
        build_server_args(["--w", str(model_dir), "--temperature", "-1"])


def test_engine_config_errors_are_cli_errors(model_dir):
    with pytest.raises(CliError, match="block_size must be a power of two, got 24"):
        build_server_args(["--w", str(model_dir), "--block-size", "24"])
    with pytest.raises(CliError, match="--backend nosuch: no such backend; installed: .*cpu"):
        build_server_args(["--w", str(model_dir), "--backend", "nosuch"])


def test_api_key_from_flag_or_environment(model_dir, monkeypatch):
    monkeypatch.delenv("CVLLM_API_KEY", raising=False)
    assert build_server_args(["--w", str(model_dir)]).api_key is None
    monkeypatch.setenv("CVLLM_API_KEY", "from-env")
    assert build_server_args(["--w", str(model_dir)]).api_key == "from-env"
    assert build_server_args(["--w", str(model_dir), "--api-key", "flag"]).api_key == "flag"


def test_cors_lists(model_dir):
    args = build_server_args(["--w", str(model_dir), "--allowed-origins", "http://a,http://b", '["http://c"]',
                              "--allowed-methods", "GET", "POST", "--allow-credentials"])
    assert args.cors_allow_origins == ["http://a", "http://b", "http://c"]
    assert (args.cors_allow_methods, args.cors_allow_headers, args.cors_allow_credentials) == (["GET", "POST"],
                                                                                               ["*"], True)


def test_chat_template_file_or_text(model_dir, tmp_path):
    text = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert build_server_args(["--w", str(model_dir), "--chat-template", text]).chat_template == text
    template = tmp_path / "t.jinja"
    template.write_text(text)
    assert build_server_args(["--w", str(model_dir), "--chat-template", str(template)]).chat_template == str(template)
    with pytest.raises(CliError, match="--chat-template nope.jinja: no such file"):
        build_server_args(["--w", str(model_dir), "--chat-template", "nope.jinja"])


def test_strict_model_name_flag(model_dir):
    assert build_server_args(["--w", str(model_dir)]).strict_model_name is False
    assert build_server_args(["--w", str(model_dir), "--strict-model-name"]).strict_model_name is True


def test_help_documents_the_groups(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for heading in ("model:", "server:", "engine:", "sampling defaults:", "security:", "examples:"):
        assert heading in out
    assert "--num-kv-blocks > --mem > --kv-fraction > --gpu-memory-utilization" in out
