"""TinyGPT served by cvllm against the plain-torch reference in cvllm_example.reference."""

import pytest
import torch

from cvllm import LLM, SamplingParams, plugins
from cvllm_example import plugin
from cvllm_example.reference import TinyGPTReference
from cvllm_example.testing import make_checkpoint

PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 10, 11], [100, 3, 42, 42, 7, 1, 64, 90, 12, 13, 14, 15, 16, 17]]
MAX_TOKENS = 16


@pytest.fixture(autouse=True)
def example_plugin_only(monkeypatch):
    # Load no installed entry points and register this package's hooks by hand, so the test
    # behaves the same whether or not the package is installed.
    monkeypatch.setenv("CVLLM_PLUGINS", "")
    plugins.reset_plugins()
    plugins.get_plugin_manager().register(plugin, name="example")
    yield
    plugins.reset_plugins()


@pytest.fixture(autouse=True)
def one_thread():
    # The model is tiny: extra threads only add synchronisation, which on a busy machine costs seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_architecture_is_registered_as_a_lazy_string():
    assert plugins.architectures().owner("TinyGPTForCausalLM") == "example"
    assert plugins.architectures().spec("TinyGPTForCausalLM") == "cvllm_example.model:TinyGPTForCausalLM"


def test_greedy_generation_matches_the_reference(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "tinygpt", seed=0)
    # block_size 4: every sequence spans several KV blocks, so paging is exercised
    llm = LLM(model=str(checkpoint), dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)

    reference = TinyGPTReference.from_checkpoint(checkpoint)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = reference.greedy(prompt, MAX_TOKENS)
        # far from ties, so a different token means a real bug rather than rounding
        assert min(expected.margins) > 1e-3
        completion = output.outputs[0]
        assert completion.token_ids == expected.token_ids
        logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
        assert logprobs == pytest.approx(expected.logprobs, abs=1e-4)
