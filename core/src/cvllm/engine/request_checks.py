"""What a request must satisfy before the engine takes it: the server's 400s, raised before anything is allocated."""

from __future__ import annotations

from cvllm.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """A request's ValueError (the server's 400) before anything is allocated for it."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > vocab_size:
            raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}")
    if len(prompt_token_ids) > max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than the maximum model "
                         f"length {max_model_len}")
