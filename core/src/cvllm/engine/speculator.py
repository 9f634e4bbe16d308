"""The engine's speculation, step by step: drafts proposed before scheduling, fitted to what was scheduled, taken
off the sequences once launched, verified when the step's tokens are read back (speculative.py says how a verify
step is exact); and, with async scheduling, the next step launched on a guess of the in-flight step's outcome.

Asynchronous speculative steps (n-gram method). A verify step yields 1..K + 1 tokens, so the step after it depends
on how many drafts were accepted, and its drafts on the tokens themselves: the host cannot build it before the
verify step's tokens are read back, and a synchronous step costs the host's work plus the device's. So while
verify step t runs on the device, ``guess`` assumes its outcome: every draft accepted, then the bonus token the
n-gram lookup predicts after them (the token that followed the matched text; where the lookup finds none, the bonus
stays on the device and step t + 1 reads it there as an async decode does). Step t + 1 is scheduled, drafted and
launched on that guess, exactly as the synchronous path would after that outcome; then t is read back and
``settle`` checks the guess per sequence. Right: t + 1 stands, and the host's work overlapped the device's.
Wrong: that sequence's rows of t + 1 are void (computed for nothing, dropped when read back), its state is rolled
back to t's real outcome (``num_computed_tokens`` lowered: the KV t + 1 wrote past it is overwritten later, in
stream order) and its seeded generator to its state before t + 1's draws; its next step is then proposed from the
real tokens. So every step's drafts are the ones the synchronous path proposes (greedy output is the same token for
token, sampled output has the target's distribution, and a seeded request makes the same draws), except that a
sequence whose bonus token could not be guessed starts drafting one step later (never for seeded sampled ones:
for them the step runs synchronously instead). Guessing pays only when it is nearly always right (a void step costs
a device step, a right guess saves only the host's gap between two): a sequence whose guesses held less often than
GUESS_MIN_RATE lately, or whose last verify step rejected a draft, sits the next step out and runs synchronously.

The guessed tokens never reach ``token_ids`` outside ``LLMEngine.step`` (``detach`` takes them off once the step
is launched, before the scheduler registers prefix-cache blocks), so output and the prefix cache only see verified
tokens. The draft-model method stays synchronous (its drafts need the last token on the device and host both).
"""

from __future__ import annotations

from cvllm.engine.guesses import GUESS_MIN_RATE, Guess, score_guess
from cvllm.engine.ngram_device import pad_drafts
from cvllm.engine.sequence import Sequence, SequenceStatus
from cvllm.engine.speculative import (
    MIN_PROPOSALS,
    REPROBE_TOKENS,
    TOKEN_BYTES,
    SpeculativeConfig,
    accepted,
    draft_length,
    lookup_ngram,
    token_bytes,
)


class Speculator:
    def __init__(self, config: SpeculativeConfig, scheduler, max_model_len: int, propose_drafts=None,
                 draft_token_cost: float = 0.0):
        """``propose_drafts(seqs, ks) -> drafts``: the draft model's greedy proposals (the executor's; draft_model
        method only). ``draft_token_cost``: the config's, else the backend's (speculative.draft_length)."""
        self.config, self.scheduler, self.max_model_len = config, scheduler, max_model_len
        self.draft_token_cost = config.draft_token_cost if config.draft_token_cost is not None else draft_token_cost
        self.propose_drafts = propose_drafts
        self.stats = scheduler.stats
        self._drafted: list[Sequence] = []   # the sequences given drafts this step (fit looks at them only)
        self.pending: dict[int, Guess] = {}   # seq_id -> its guess, from ``guess`` until ``settle`` (one step() call)
        self._held: list[tuple[Sequence, int]] = []   # (sequence, its num_inflight) left out of the next step
        self.unused: dict[int, list[int | None]] = {}   # seq_id -> the guess not launched on (held), to score it
        # drafts looked up on the device and verify steps launched a step behind (``lag``); set by the engine where
        # the backend, the executor and async scheduling allow it
        self.device_drafts = False
        self._lagged: list[tuple[Sequence, int]] = []   # (sequence, its num_inflight) set up by ``lag``

    @property
    def active(self) -> bool:
        """Small enough a batch that speculation pays (past it the batch fills the device by itself)."""
        return len(self.scheduler.running) <= self.config.disable_by_batch_size

    @property
    def overlaps(self) -> bool:
        """Whether a verify step may stay in flight while the next one is launched (async scheduling)."""
        return self.config.method == "ngram"

    def budget(self, seq: Sequence, num_tokens: int, proposed: int, accepted_: int, rejections: int) -> int:
        """How many drafts ``seq`` may verify next, were it ``num_tokens`` long with that record so far (drafts
        proposed and accepted, verify steps that rejected one): 0 for rows whose processing depends on the tokens
        before each position; as many as pay for their cost (draft_length); and so that the chunk stays inside the
        context and every accepted draft and the bonus token fit in max_tokens."""
        params, spec = seq.sampling_params, self.config
        num_output = num_tokens - seq.num_prompt_tokens
        if (seq.grammar is not None or params.needs_penalties or params.logits_processors
                or (params.min_tokens and num_output < params.min_tokens)
                or (self._below_floor(proposed, accepted_) and not self._reprobes(seq, num_tokens))):
            return 0
        # with device drafts every drafting sequence verifies K: lagged steps need K each, and the host's time they
        # take off every step is worth more than the few drafts draft_length would leave out (a draft costs ~4% of a
        # step on a GPU)
        k = spec.num_speculative_tokens if self.device_drafts else \
            draft_length(accepted_, rejections, self.draft_token_cost, spec.num_speculative_tokens)
        k = min(k, self.max_model_len - num_tokens - 1)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - num_output - 1)
        return max(k, 0)

    def _below_floor(self, proposed: int, accepted_: int) -> bool:
        return proposed >= MIN_PROPOSALS and accepted_ < self.config.min_acceptance_rate * proposed

    @staticmethod
    def _reprobes(seq: Sequence, num_tokens: int) -> bool:
        """Whether a step from ``num_tokens`` tries ``seq``'s drafts again, REPROBE_TOKENS after the floor stopped
        them (``settle`` then starts its record afresh)."""
        return seq.spec_stopped_at is not None and num_tokens >= seq.spec_stopped_at + REPROBE_TOKENS

    def propose(self) -> None:
        """Drafts for the running sequences whose every token is on the host, appended to their tokens."""
        spec = self.config
        if not self.active:
            return
        wanted = []   # (seq, k): the sequences that draft this step
        for seq in self.scheduler.running:
            if (seq.num_computed_tokens != len(seq.token_ids) - 1 or seq.num_inflight
                    or seq.seq_id in self.pending):
                continue
            k = self.budget(seq, len(seq.token_ids), seq.spec_proposed, seq.spec_accepted, seq.spec_rejections)
            if k >= 1:
                wanted.append((seq, k))
        if spec.method == "ngram":
            proposals = [lookup_ngram(verified_bytes(seq), k, spec.prompt_lookup_min, spec.prompt_lookup_max)
                         for seq, k in wanted]
        else:
            # the draft model writes its KV at the verify chunk's positions (draft_model.py), so their blocks are
            # taken now (the scheduler would take them for the chunk anyway); no room: that sequence does not draft
            bm = self.scheduler.block_manager
            wanted = [(seq, k) for seq, k in wanted if bm.grow(seq, len(seq.token_ids) + k)]
            proposals = self.propose_drafts([seq for seq, _ in wanted], [k for _, k in wanted]) if wanted else []
        most = spec.num_speculative_tokens
        for (seq, k), drafts in zip(wanted, proposals):
            if self.device_drafts and k == most:   # a step the device may go on from: K drafts each (pad_drafts)
                drafts = pad_drafts(drafts, seq.token_ids[-1], k)
            self._add_drafts(seq, drafts)

    def _add_drafts(self, seq: Sequence, drafts: list[int]) -> None:
        if drafts:
            seq.token_ids.extend(drafts)
            seq.num_drafts = len(drafts)
            self._drafted.append(seq)

    def guess(self, prev) -> bool:
        """Set the sequences of ``prev`` (the step in flight) up for the next step as if ``prev``'s outcome were the
        guessed one, drafts included; False, with nothing changed, where the next step must wait for ``prev``'s
        tokens (the draft-model method while speculation is active, structured output beside drafts). A sequence
        not worth a guess sits the next step out (``hold``)."""
        if not self.overlaps:
            return not self.active
        if prev.feed is not None:
            return self.lag(prev)
        drafting = self.active
        if self.device_drafts and drafting and self._all_draft_k():
            return False   # rather than guess, read it back: the next step verifies K drafts each, then lagged ones
        if (drafting or prev.speculative) and any(seq.grammar is not None for seq in self.scheduler.running):
            return False   # (their matchers read the last step back mid-launch, before detach: LLMEngine._launch)
        for seq, _, _, drafts in prev.rows():
            if seq.seq_id in prev.void or seq.status is not SequenceStatus.RUNNING:
                continue
            k, base = len(drafts), len(seq.token_ids)
            if k and seq.spec_rejected:   # its drafts were rejected last time: likely again, and the guess wrong
                self.hold(seq)
                continue
            bonus, more = None, []
            # (the guess: all k accepted, so its record then is k more proposed and accepted, no rejection more)
            budget = self.budget(seq, base + k + 1, seq.spec_proposed + k, seq.spec_accepted + k,
                                 seq.spec_rejections) if drafting else 0
            if budget:
                bonus, more = self._lookup_after(seq, drafts, budget)
                if bonus is None and seq.generator is not None and not seq.sampling_params.greedy:
                    self.hold(seq)   # the synchronous path's drafts for it depend on the bonus token: wait for it
                    continue
            if not k and bonus is None:
                continue   # an async decode: its next input is read on the device
            if seq.spec_guess_rates[k > 0] < GUESS_MIN_RATE:   # its guesses fail too often to pay: wait for the
                self.unused[seq.seq_id] = drafts + [bonus]   # outcome, scored all the same, so that guessing
                self.hold(seq)                               # resumes in a stretch where it would hold
                continue
            state = seq.generator.get_state() if seq.generator is not None else None
            self.pending[seq.seq_id] = Guess(seq, drafts + [bonus], base, seq.num_inflight, state)
            seq.token_ids.extend(drafts)
            seq.num_computed_tokens = base + k   # (the last token and the drafts: computed by prev)
            if bonus is not None:   # known on the host, so nothing of this sequence is left in flight for the next
                seq.token_ids.append(bonus)
                seq.num_inflight = 0
                self._add_drafts(seq, more)
        return True

    def lag(self, prev) -> bool:
        """Set every running sequence up to verify K drafts whose every input the device computes from ``prev``'s
        outcome (ngram_device.py): the next step is built a step behind and launched before ``prev`` is read back,
        with no guess. False, with nothing changed but blocks, where some sequence cannot (it is not in ``prev``, it
        does not draft K now, or its context would run out), or a request could start now: ``prev`` is read back
        first.

        A lagged sequence's verified tokens are all computed (``prev``'s chunk starts at its last one), so a chunk of
        K + 1 tokens from there is scheduled, each one a row the device fills; its blocks cover the furthest the chunk
        may reach, ``prev`` having accepted all its drafts."""
        scheduler, most = self.scheduler, self.config.num_speculative_tokens
        config = scheduler.config
        # (a request that could start now is prefilled after reading prev back; one waiting for a free slot is not)
        startable = scheduler.waiting and len(scheduler.running) < config.max_num_seqs
        if (not self.active or startable or prev.void
                or len(scheduler.running) * (most + 1) > config.max_num_batched_tokens
                or 0 < config.prefill_chunk_size <= most):   # (every chunk whole: the device fills K + 1 rows each)
            return False
        in_prev = {seq.seq_id for seq in prev.sampling}
        for seq in scheduler.running:
            num_tokens = len(seq.token_ids)
            if (seq.seq_id not in in_prev or seq.num_computed_tokens != num_tokens
                    or num_tokens + 2 * most + 2 > self.max_model_len
                    or self.budget(seq, num_tokens + most + 1, seq.spec_proposed + most, seq.spec_accepted + most,
                                   seq.spec_rejections) < most):
                return False
        bm = scheduler.block_manager
        if not all(bm.grow(seq, len(seq.token_ids) + 2 * most + 1) for seq in scheduler.running):
            return False
        for seq in scheduler.running:
            self._lagged.append((seq, seq.num_inflight))
            seq.num_inflight = most + 1   # (for the scheduler: the chunk's tokens; fit sets it back)
            seq.num_drafts = most
        return True

    def _all_draft_k(self) -> bool:
        """Whether every running sequence would verify K drafts after the step in flight (its one token)."""
        most = self.config.num_speculative_tokens
        return all(seq.grammar is None and self.budget(seq, seq.num_tokens, seq.spec_proposed, seq.spec_accepted,
                                                       seq.spec_rejections) == most
                   for seq in self.scheduler.running)

    def _lookup_after(self, seq: Sequence, drafts: list[int], budget: int) -> tuple[int | None, list[int]]:
        """The bonus token the n-gram lookup predicts after ``seq``'s tokens and ``drafts`` (None: no match), and up
        to ``budget`` drafts after it. The assumed tokens go on the sequence's lookup bytes for the searches and come
        off again (copying the bytes would cost more than searching them, on a long sequence)."""
        spec = self.config
        data = verified_bytes(seq)
        verified = len(data)
        data += token_bytes(drafts)
        try:
            # (a guess, checked before it counts: the shortest match is allowed, it is right more often)
            hit = lookup_ngram(data, 1, 1, spec.prompt_lookup_max)
            if not hit:
                return None, []
            data += token_bytes(hit)
            return hit[0], lookup_ngram(data, budget, spec.prompt_lookup_min, spec.prompt_lookup_max)
        finally:
            del data[verified:]

    def hold(self, seq: Sequence) -> None:
        """Leave ``seq`` out of the next step: with no token in flight to compute, the scheduler skips it (fit sets
        it back); it runs again once the step in flight is read back."""
        self._held.append((seq, seq.num_inflight))
        seq.num_inflight = 0

    def fit(self, batch) -> None:
        """Drafts of sequences the scheduler left out (or preempted) are dropped; a chunk the token budget cut
        keeps the drafts it holds, so that the sequence still samples. A guessed sequence left out is set back."""
        scheduled = {seq.seq_id: i for i, seq in enumerate(batch.seqs)}
        for seq, num_inflight in self._held:
            seq.num_inflight = num_inflight
        self._held = []
        for seq, num_inflight in self._lagged:
            seq.num_inflight = num_inflight
            if seq.seq_id not in scheduled:
                seq.num_drafts = 0
        batch.lagged = bool(self._lagged) and bool(batch.seqs)
        self._lagged = []
        for seq_id, guess in list(self.pending.items()):
            if seq_id not in scheduled:
                self._unguess(guess)
        if self._drafted:
            self._fit_drafts(batch, scheduled)
        most = self.config.num_speculative_tokens
        batch.device_drafts = (self.device_drafts and bool(batch.seqs) and not self.pending and self.active
                               and len(batch.sample_indices) == len(batch.seqs)
                               and all(seq.num_drafts == most and n == most + 1
                                       for seq, n in zip(batch.seqs, batch.num_tokens)))

    def _fit_drafts(self, batch, scheduled: dict[int, int]) -> None:
        changed = False
        drafted, self._drafted = self._drafted, []
        for seq in drafted:   # (running, or preempted by this schedule)
            i = scheduled.get(seq.seq_id)
            keep = 0 if i is None else batch.num_tokens[i] - 1
            if keep < seq.num_drafts:
                del seq.token_ids[len(seq.token_ids) - seq.num_drafts + keep:]
                if i is not None and keep == 0:   # its chunk is its last token alone: a plain decode now
                    batch.num_draft_chunk_tokens -= 1
                    batch.num_prefill_tokens -= 1
                    batch.num_decodes += 1
                seq.num_drafts = keep
                changed = True
        if changed:
            batch.sample_indices = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                                    if seq.num_computed_tokens + n == seq.num_tokens]

    def _unguess(self, guess: Guess) -> None:
        seq = guess.seq
        del seq.token_ids[guess.base:]
        seq.num_drafts = 0
        seq.num_inflight = guess.num_inflight
        if seq.status is SequenceStatus.RUNNING:   # (a preempted one recomputes from 0)
            seq.num_computed_tokens = guess.base
        del self.pending[seq.seq_id]

    def detach(self, step) -> None:
        """Once ``step`` is launched (before the scheduler registers its prefix-cache blocks): each sequence's
        drafts move from its tokens onto the step, and a guessed sequence's assumed tokens come off (``settle``
        puts the real ones on). A lagged step's drafts are on the device only: they come with its readback."""
        if step.lagged:
            return
        drafts = []
        for j, seq in enumerate(step.sampling):
            k = step.num_drafts[j] if step.num_drafts else 0
            drafts.append(seq.token_ids[len(seq.token_ids) - k:] if k else [])
            guess = self.pending.get(seq.seq_id)
            if guess is not None and guess.step is None:
                del seq.token_ids[guess.base:]
                seq.num_inflight = guess.num_inflight
                guess.step = step
            elif k:
                del seq.token_ids[-k:]
        if step.num_drafts:
            step.drafts = drafts

    def settle(self, seq: Sequence, drafts: list[int], targets: list[int]) -> list[int]:
        """A read-back sequence's new tokens: its accepted drafts and the target's token after them (``targets``
        itself without drafts). Keeps its accepted drafts' KV, and checks the guess the next step was launched on."""
        tokens = targets
        a = 0
        if drafts:
            a = accepted(drafts, targets)
            tokens = targets[:a + 1]
            if self._reprobes(seq, len(seq.token_ids)):   # (a step launched before the floor stopped it is not)
                seq.spec_proposed = seq.spec_accepted = seq.spec_rejections = 0
                seq.spec_stopped_at = None
            seq.spec_proposed += len(drafts)
            seq.spec_accepted += a
            seq.spec_rejected = a < len(drafts)
            seq.spec_rejections += seq.spec_rejected
            if seq.spec_stopped_at is None and self._below_floor(seq.spec_proposed, seq.spec_accepted):
                seq.spec_stopped_at = len(seq.token_ids)
            self.stats.spec_draft_tokens += len(drafts)
            self.stats.spec_accepted_tokens += a
            self.stats.spec_verifications += 1
        guess = self.pending.pop(seq.seq_id, None)
        unused = self.unused.pop(seq.seq_id, None)
        if unused is not None:
            score_guess(seq, len(unused) > 1, Guess.matches(unused, tokens))
        running = seq.status is SequenceStatus.RUNNING
        if guess is None:
            if running:
                seq.num_computed_tokens += a   # the last token and the accepted drafts are in the cache
        elif guess.holds(tokens):
            self.stats.spec_guesses += 1
            score_guess(seq, len(guess.expected) > 1, True)
        elif guess.step is not None:   # the next step was launched on a wrong guess: its rows of it are void
            score_guess(seq, len(guess.expected) > 1, False)
            self.stats.spec_guesses += 1
            self.stats.spec_guess_misses += 1
            guess.step.void.add(seq.seq_id)
            seq.num_inflight -= 1
            if running:
                seq.num_computed_tokens = guess.base + len(tokens) - 1
            if guess.generator_state is not None:
                seq.generator.set_state(guess.generator_state)
        if running:
            self.scheduler.block_manager.cache_full_blocks(seq)
        return tokens

    def forget(self, seq: Sequence) -> None:
        """``seq`` failed when read back: its guess, launched or not, is dropped unchecked."""
        self.pending.pop(seq.seq_id, None)
        self.unused.pop(seq.seq_id, None)

    def reset(self) -> None:
        """A step failed: forget its guesses and drafts (its requests are failed by the caller)."""
        for seq, num_inflight in self._lagged:
            seq.num_inflight = num_inflight
            seq.num_drafts = 0
        self._lagged = []
        for guess in list(self.pending.values()):
            if guess.step is None:
                self._unguess(guess)
        for seq, num_inflight in self._held:
            seq.num_inflight = num_inflight
        self.pending.clear()
        self.unused.clear()
        self._held = []
        self._drafted = []


def verified_bytes(seq: Sequence) -> bytearray:
    """``seq``'s tokens as ``token_bytes``, each converted once (Sequence.ngram_bytes). Called only while every token
    in ``token_ids`` is verified (drafts and guessed tokens are appended after), and verified tokens never change,
    so the bytes kept stay a prefix of them."""
    data = seq.ngram_bytes
    have = len(data) // TOKEN_BYTES
    if have < len(seq.token_ids):
        data += token_bytes(seq.token_ids[have:])
    return data
