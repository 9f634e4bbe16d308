"""Messages between the API process and the engine-core process (msgspec, one encoder each way).

API → core: ``AddRequest``, ``AbortRequests``, ``Shutdown``, ``EmbedRequest``, drained once per step.
core → API: ``Ready`` once, then one ``StepOutputs`` per step carrying every request's new
tokens; ``Embeddings`` when an embedding request is done; ``RequestFailed`` when a step raised (only that step's
requests fail); ``CoreDead`` when the core cannot go on (startup failure, device error).
"""

from __future__ import annotations

import msgspec

from cvllm.pooling import PoolingConfig
from cvllm.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams   # a Struct: decoding it in the core runs its validation again (see reject_command)
    # a request carried over from a core that died (server/supervisor.py): by completion index, the output tokens
    # already streamed to the client, which the new core continues; completions left out had ended. None: a new one
    resumed: dict[int, list[int]] | None = None


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]
    # only these completions (by index of n) of each request: a stop string ended them while their siblings go
    # on. None (and a message without the field): the whole requests.
    indices: list[int] | None = None


class Shutdown(msgspec.Struct, tag=True):
    pass


class EmbedRequest(msgspec.Struct, tag=True):
    """Embed ``prompts`` (answered by one ``Embeddings``, or ``RequestFailed``); run between generation steps."""
    request_id: str
    prompts: list[list[int]]
    pooling: PoolingConfig
    dimensions: int | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Raw log-softmax of one generated token: the sampled token's, and the top-k."""
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class SeqDelta(msgspec.Struct, array_like=True):
    """What one completion (``index`` of n) of a request gained this step."""
    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | None = None        # the stop token id that matched
    num_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, with the first delta, when asked
    num_cached_tokens: int = 0            # prompt tokens that were prefix-cache hits; once, with the first delta


class CoreStats(msgspec.Struct):
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    spec_draft_tokens: int = 0       # speculative decoding: drafts verified, accepted, and verifications
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0


class StepOutputs(msgspec.Struct, tag=True):
    deltas: list[SeqDelta]
    stats: CoreStats


class RequestFailed(msgspec.Struct, tag=True):
    request_ids: list[str]
    message: str
    invalid_request: bool = False   # rejected at admission (bad params, prompt too long): a client error


class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    backend: str
    dtype: str
    max_num_seqs: int
    vocab_size: int
    # for /v1/embeddings: the pooling the checkpoint declares (None: none), its embedding size, and the Matryoshka
    # dimensions config.json lists (pooling.py)
    pooling: PoolingConfig | None = None
    hidden_size: int = 0
    matryoshka_dimensions: list[int] | None = None


class CoreDead(msgspec.Struct, tag=True):
    message: str


class Embeddings(msgspec.Struct, tag=True):
    """An ``EmbedRequest``'s vectors, one per prompt in order: little-endian float32 bytes (what base64 encodes)."""
    request_id: str
    vectors: list[bytes]


ToCore = AddRequest | AbortRequests | Shutdown | EmbedRequest
FromCore = Ready | StepOutputs | RequestFailed | CoreDead | Embeddings


def reject_command(data: bytes, error: msgspec.ValidationError) -> RequestFailed:
    """The answer to a command the core could not decode because its sampling parameters fail validation there
    (the API process checked them with the same rules, so only a difference between the two processes, such as a
    logits processor whose plugin loaded in one only, gets here): that request fails, and the core goes on."""
    command = msgspec.msgpack.decode(data)
    if not (isinstance(command, dict) and command.get("type") == "AddRequest"
            and isinstance(command.get("request_id"), str)):
        raise error   # not a request: the two sides disagree on the protocol
    return RequestFailed([command["request_id"]], str(error), invalid_request=True)
