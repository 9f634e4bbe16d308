"""Prompt logprobs: which rows of a flat batch score prompt tokens, and recording their entries."""

from __future__ import annotations

import itertools

import torch

from cvllm.engine.scheduler import ScheduledBatch
from cvllm.outputs import Logprob


def prompt_logprob_rows(batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
    """Which scheduled sequences need prompt logprobs, and their rows in the flat batch."""
    scoring = [i for i, seq in enumerate(batch.seqs) if seq.wants_prompt_logprobs]
    if not scoring:
        return [], None
    starts = [0, *itertools.accumulate(batch.num_tokens)]
    return scoring, torch.cat([torch.arange(starts[i], starts[i + 1]) for i in scoring])


def record_prompt_logprobs(batch: ScheduledBatch, scoring: list[int], logits: torch.Tensor) -> None:
    """The logits at position a score prompt token a + 1; entries are appended in order, so a
    sequence recomputed after preemption does not record a position twice."""
    offset = 0
    for i in scoring:
        seq, n = batch.seqs[i], batch.num_tokens[i]
        rows = logits[offset:offset + n]
        offset += n
        first = seq.num_computed_tokens              # absolute position of rows[0]
        targets = range(max(first + 1, len(seq.prompt_logprobs)), min(first + n + 1, seq.num_prompt_tokens))
        if not targets:
            continue
        rows = rows[targets.start - 1 - first: targets.stop - 1 - first].log_softmax(dim=-1)
        ids = torch.tensor(seq.token_ids[targets.start:targets.stop], device=rows.device)
        chosen = rows.gather(1, ids[:, None])[:, 0].tolist()
        k = seq.sampling_params.prompt_logprobs
        top_lp, top_ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
        for token, lp, t_ids, t_lps in zip(ids.tolist(), chosen, top_ids.tolist(), top_lp.tolist()):
            entry = {tid: Logprob(v, rank) for rank, (tid, v) in enumerate(zip(t_ids, t_lps), 1)}
            entry.setdefault(token, Logprob(lp, None))
            seq.prompt_logprobs.append(entry)
