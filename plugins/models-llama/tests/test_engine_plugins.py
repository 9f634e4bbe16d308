"""What plugins add to a running engine, on a tiny Llama: a named logits processor changes the output of the
requests that name it and of no other, and a backend's ``prepare`` runs once per forward pass."""

from __future__ import annotations

import pytest

from cvllm import LLM, SamplingParams, plugins
from cvllm.backends.cpu import CpuBackend
from cvllm.engine.logits_processors import LogitsProcessor
from cvllm.engine.model_runner import ModelRunner
from cvllm.testing import make_checkpoint
from cvllm.testing.plugins import registers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FORCED = 42


class ForceToken(LogitsProcessor):
    def apply(self, logits, rows):
        logits[:, FORCED] = logits.max(dim=-1).values + 1.0
        return logits


class PreparedOnce(CpuBackend):
    name = "prepared-once"
    passes: list[int] = []   # block size of each prepared context

    def prepare(self, ctx):
        assert ctx.backend_data is None, "prepared twice"
        PreparedOnce.passes.append(ctx.block_size)
        super().prepare(ctx)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins-llama")
    make_checkpoint(path, "llama", seed=5)
    return path


@pytest.fixture
def plugin():
    pm = plugins.get_plugin_manager()
    added = registers("register_samplers", ("force42", ForceToken))
    backend = registers("register_backends", ("prepared-once", PreparedOnce))
    pm.register(added, name="test-processors")
    pm.register(backend, name="test-backend")
    yield
    pm.unregister(added)
    pm.unregister(backend)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_logits_processor_changes_only_the_output_of_its_request(model_dir, plugin, async_scheduling):
    llm = LLM(model=str(model_dir), dtype="float32", block_size=16, max_num_seqs=8, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 9, 200, 31], [77, 3, 18], [101, 102, 103, 104, 105])]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logits_processors=["force42"])
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)

    def tokens(params: list[SamplingParams]) -> list[list[int]]:
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]

    baseline = tokens([plain, plain, sampled])
    assert FORCED not in baseline[1], "the test needs a prompt whose own output differs from the forced one"
    mixed = tokens([plain, forced, sampled])   # one batch: the processor sees the middle request's row only
    assert mixed[1] == [FORCED] * 6
    assert mixed[0] == baseline[0] and mixed[2] == baseline[2]
    assert llm.llm_engine.async_scheduling == async_scheduling


def test_the_backend_prepares_each_forward_pass_once(model_dir, plugin, monkeypatch):
    runs = []
    real_run = ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, *args, **kw: runs.append(1) or real_run(self, *args, **kw))
    PreparedOnce.passes.clear()
    llm = LLM(model=str(model_dir), backend="prepared-once", dtype="float32", block_size=16, max_num_seqs=4,
              max_num_batched_tokens=16)
    runs.clear()
    out = llm.generate([{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [8, 9]}],
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert llm.llm_engine.backend.name == "prepared-once"
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]
    assert len(runs) > 3 and PreparedOnce.passes == [16] * len(runs)   # chunked prefill, then decodes
