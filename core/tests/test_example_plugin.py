"""End to end: the example third-party plugin (examples/cvllm-example-plugin), installed with pip
into a temporary directory, is discovered through its entry point and serves its own model.

Everything runs in subprocesses whose PYTHONPATH starts with that directory, because entry points
are discovered from what is installed when the process starts.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "cvllm-example-plugin"
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 10, 11], [100, 3, 42, 42, 7, 1, 64, 90, 12, 13, 14, 15, 16, 17]]
MAX_TOKENS = 16

PLUGINS_COMMAND = textwrap.dedent("""
    import sys
    from cvllm.cli import main
    code = main(sys.argv[1:])
    # listing plugins must not import the model module behind a lazy registration
    print("imported model module:", "cvllm_example.model" in sys.modules)
    sys.exit(code)
""")

GENERATE = textwrap.dedent("""
    import json, sys
    import cvllm_example
    from cvllm import LLM, SamplingParams, plugins
    from cvllm_example.reference import TinyGPTReference
    from cvllm_example.testing import make_checkpoint

    checkpoint_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    path = make_checkpoint(checkpoint_dir, seed=0)
    llm = LLM(model=str(path), dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = [out.outputs[0] for out in llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)]
    reference = TinyGPTReference.from_checkpoint(path)
    expected = [reference.greedy(ids, max_tokens) for ids in prompts]
    print(json.dumps({
        "package_file": cvllm_example.__file__,
        "owner": plugins.architectures().owner("TinyGPTForCausalLM"),
        "cvllm": [out.token_ids for out in outputs],
        "cvllm_logprobs": [[entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids)] for out in outputs],
        "reference": [ref.token_ids for ref in expected],
        "reference_logprobs": [ref.logprobs for ref in expected],
        "min_margin": min(min(ref.margins) for ref in expected),
    }))
""")

LOAD_ARCHITECTURE = textwrap.dedent("""
    import sys
    from cvllm import LLM
    from cvllm.plugins import RegistryError
    from cvllm_example.testing import make_checkpoint

    path = make_checkpoint(sys.argv[1], seed=0, architectures=[sys.argv[2]])
    try:
        LLM(model=str(path), dtype="float32", block_size=4)
    except RegistryError as exc:
        print(exc)
    else:
        print("loaded")
""")


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """A directory holding the example package as pip installs it (code plus dist-info with the
    entry point)."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip(f"pip is not available in {sys.executable}, so the example plugin cannot be installed")
    root = tmp_path_factory.mktemp("example_plugin")
    # pip builds in the source tree (build/, *.egg-info); build from a copy so the checkout, which
    # others may be working in, stays untouched.
    source = root / "source"
    shutil.copytree(EXAMPLE_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    return site


def run_python(site: Path, script: str, *args: str, plugins_allowed: str | None = None,
               ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CVLLM_PLUGINS", "CVLLM_TRACE_HOOKS")}
    if plugins_allowed is not None:
        env["CVLLM_PLUGINS"] = plugins_allowed
    env["PYTHONPATH"] = os.pathsep.join([str(site), *(p for p in sys.path if p)])
    # The model is tiny: extra threads only add synchronisation, which on a busy machine (tests
    # running in parallel) turns a sub-second generation into many seconds.
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_cvllm_plugins_lists_the_example_plugin_and_its_architecture(example_site):
    result = run_python(example_site, PLUGINS_COMMAND, "plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("example (cvllm-example-plugin 0.1.0)")
    assert lines[start + 1:start + 3] == [
        "  register_architectures",
        "    TinyGPTForCausalLM = cvllm_example.model:TinyGPTForCausalLM",
    ]
    assert "imported model module: False" in lines

    result = run_python(example_site, PLUGINS_COMMAND, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout[:result.stdout.rindex("imported model module")])
    (entry,) = [entry for entry in report if entry["name"] == "example"]
    assert entry["distribution"] == "cvllm-example-plugin"
    assert entry["hooks"] == ["register_architectures"]
    assert entry["registered"] == {
        "register_architectures": {"TinyGPTForCausalLM": "cvllm_example.model:TinyGPTForCausalLM"}}
    assert entry["error"] is None


def test_greedy_generation_matches_the_reference_token_for_token(example_site, tmp_path):
    result = run_python(example_site, GENERATE, str(tmp_path / "tinygpt"), json.dumps(PROMPTS), str(MAX_TOKENS))
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    # the model came from the pip-installed copy, through its entry point
    assert Path(found["package_file"]).is_relative_to(example_site)
    assert found["owner"] == "example"
    # the reference's choices are far from ties, so any difference is a bug, not rounding
    assert found["min_margin"] > 1e-3
    assert [len(ids) for ids in found["cvllm"]] == [MAX_TOKENS] * len(PROMPTS)
    assert found["cvllm"] == found["reference"]
    for got, want in zip(found["cvllm_logprobs"], found["reference_logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_allowlist_without_the_plugin_leaves_its_architecture_unknown(example_site, tmp_path):
    result = run_python(example_site, PLUGINS_COMMAND, "plugins", plugins_allowed="")
    assert result.returncode == 0, result.stderr
    assert "TinyGPTForCausalLM" not in result.stdout
    assert not [line for line in result.stdout.splitlines() if line.startswith("example ")]

    result = run_python(example_site, LOAD_ARCHITECTURE, str(tmp_path / "a"), "TinyGPTForCausalLM",
                        plugins_allowed="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("unknown architecture 'TinyGPTForCausalLM'; registered: none "
                                     "(install a plugin that provides it)")


def test_unknown_architecture_error_lists_the_registered_names(example_site, tmp_path):
    result = run_python(example_site, LOAD_ARCHITECTURE, str(tmp_path / "b"), "NoSuchForCausalLM",
                        plugins_allowed="example")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("unknown architecture 'NoSuchForCausalLM'; registered: TinyGPTForCausalLM "
                                     "(install a plugin that provides it)")
