"""Named chat templates (tokenizer_config.json's list form, GGUF's tokenizer.chat_template.<name>): the default
one renders chats, the "tool_use" one a chat with tools, as transformers picks them; the server does the same and
detects the tool-call parser from the template tools use."""

from __future__ import annotations

import json

from cvllm.engine.config import EngineConfig
from cvllm.server.args import ServerArgs
from cvllm.server.state import ServerState
from cvllm.testing.fakes import FakeClient, call
from cvllm.testing.tokenizer import write_tiny_tokenizer
from cvllm.tokenizer import Tokenizer

DEFAULT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
TOOL_USE = ("<tools>{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}</tools>" + DEFAULT
            + "{# the model answers <tool_call>...</tool_call> #}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HI = [{"role": "user", "content": "hi"}]


def model_dir(tmp_path):
    write_tiny_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [{"name": "default", "template": DEFAULT}, {"name": "tool_use", "template": TOOL_USE}]
    config_file.write_text(json.dumps(config))
    return tmp_path


def test_the_tool_use_template_renders_chats_with_tools(tmp_path):
    tokenizer = Tokenizer.from_dir(model_dir(tmp_path))
    assert tokenizer.chat_template == DEFAULT and tokenizer.named_templates == {"tool_use": TOOL_USE}
    assert tokenizer.apply_chat_template(HI) == "<user>hi"
    assert tokenizer.apply_chat_template(HI, tools=TOOLS) == "<tools>get_weather</tools><user>hi"
    assert tokenizer.apply_chat_template(HI, tools=TOOLS, chat_template=DEFAULT) == "<user>hi"   # asked for


def test_the_server_renders_requests_with_tools_with_it(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    from cvllm.testing.checkpoints import BASE_CONFIG

    path = model_dir(tmp_path)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **BASE_CONFIG}))
    save_file({"unused": np.zeros(1, np.float32)}, str(path / "model.safetensors"))
    state = ServerState.open(ServerArgs(engine=EngineConfig(model=str(path))))
    assert state.tool_parser == "hermes"   # from the tool_use template, which the default one is not
    ids = state.tokenizer.encode("ok", add_special_tokens=False)
    state.client = FakeClient([ids], finish="length")
    for body, prompt in (({}, "<user>hi"), ({"tools": TOOLS}, "<tools>get_weather</tools><user>hi")):
        reply = call(state, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": len(ids), **body})
        assert reply.status_code == 200, reply.text
        assert state.tokenizer.decode(state.client.prompts[-1], skip_special_tokens=False) == prompt
