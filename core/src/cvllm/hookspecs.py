"""The hooks a cvllm plugin may implement.

A plugin is a module (or any object) whose functions are decorated with ``@hookimpl`` and named
after one of the hooks below. pluggy calls hooks with keyword arguments and an implementation may
accept fewer arguments than the spec lists, so hooks can grow without breaking old plugins.

The ``register_*`` hooks hand the plugin a ``register(name, target)`` callback. ``target`` should be
a lazy ``"module:Attribute"`` string so that discovering plugins imports no model or kernel code;
cvllm imports it only when the name is used.
"""

import pluggy

hookspec = pluggy.HookspecMarker("cvllm")
hookimpl = pluggy.HookimplMarker("cvllm")


@hookspec
def register_architectures(register):
    """register_architectures(register)

    Register model classes by the Hugging Face ``architectures`` name found in config.json::

        register("LlamaForCausalLM", "cvllm_llama.llama:LlamaForCausalLM")

    Also register each GGUF ``general.architecture`` alias the class serves (``"llama"``).
    """


@hookspec
def register_backends(register):
    """register_backends(register)

    Register hardware backends by device name::

        register("cpu", "cvllm.backends.cpu:CpuBackend")

    The backend class answers ``is_available()`` cheaply, without initialising the device.
    """


@hookspec
def register_quantizers(register):
    """register_quantizers(register)

    Register quantization methods keyed by the checkpoint's ``quant_method`` (from
    ``quantization_config`` in config.json) or by file format name::

        register("gguf", "cvllm_gguf.checkpoint:gguf_linear_methods")

    The target is called as ``target(checkpoint, dtype)`` on a model built on the meta device and
    returns a ``LinearMethodFactory`` (``cvllm.layers.quantization``): ``factory(layer_name,
    source_names)`` gives each linear layer its ``LinearMethod``, or None to leave it unquantized.
    """


@hookspec
def register_converters(register):
    """register_converters(register)

    Register checkpoint converters for ``cvllm convert SRC OUT --to NAME``: the target is called as
    ``target(src, out, options)`` with the source checkpoint directory, the output directory (a Path each) and a
    dict of the command's options (``bits``, ``group_size``, ``sym``; None where not given), and writes a checkpoint
    that ``cvserve --w OUT`` serves::

        register("gptq", "cvllm_marlin.convert:convert_to_gptq")
    """


@hookspec
def register_samplers(register):
    """register_samplers(register)

    Register named logits processors, which a request applies by naming them in
    ``SamplingParams.logits_processors`` (the HTTP API's ``logits_processors`` field): subclasses of
    ``cvllm.engine.logits_processors.LogitsProcessor``, made once per name as ``Class(vocab_size=..., device=...)``
    and called once a step as ``apply(logits[b, V], rows) -> logits`` on the rows of the requests that named
    them (docs/plugins.md)::

        register("no_digits", "my_plugin.processors:NoDigits")
    """


@hookspec
def register_tool_parsers(register):
    """register_tool_parsers(register)

    Register tool-call parsers by name, for ``cvserve --tool-call-parser NAME`` (and the chat template's format):
    the target is called with no arguments once per response choice and returns an object with
    ``feed(text) -> (content, calls)`` and ``finish() -> (content, calls)``, ``calls`` a list of
    ``cvllm.server.tool_calls.ParsedCall`` (docs/plugins.md)::

        register("my_format", "my_plugin.tools:MyParser")
    """


@hookspec
def register_gguf_architectures(register):
    """register_gguf_architectures(register)

    Register, per GGUF ``general.architecture`` name, the adapter that maps its metadata to a
    Hugging Face config and its tensors to the model's parameter names (q/k un-permute, tied
    embeddings), so GGUF support for a model family ships with that family's plugin. The target is a
    ``cvllm.gguf_adapter.GGUFArchitecture``::

        register("llama", "cvllm_llama.gguf_adapter:LLAMA")
    """


@hookspec(firstresult=True)
def open_checkpoint(path):
    """open_checkpoint(path)

    Return a ``Checkpoint`` for the local path ``path`` (a ``str``) if this plugin can read it,
    else None. The first non-None answer wins; the built-in Hugging Face directory reader runs
    last, so a plugin may claim a file format (``.gguf``) or a directory layout of its own.
    """
