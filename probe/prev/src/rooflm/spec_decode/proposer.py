"""Which running requests get draft tokens this step, and whether speculation pays at all.

Speculation is exact but not free: a verify step computes k + 1 tokens per request instead of one. While decode is
memory-bound (small batches) that costs about as much as one token, and every accepted draft is a token saved; once
the batch is large enough to be compute-bound, the extra tokens cost their full price. Before each step the engine
asks the live roofline for the best possible time of a plain decode step and of a verify step of the running batch;
with the acceptance rate measured so far, a chain of k drafts yields (1 - a^(k+1)) / (1 - a) tokens per verification
(Leviathan et al. 2023, eq. 1). Drafts are proposed only when that buys more tokens per second than plain decoding.
A draft model's own k single-token steps are part of the price: about ``draft_cost`` (its share of the target's
weight bytes, what a memory-bound decode step reads) of a plain decode step each.

With a draft model (``draft_model``, ``self``) the drafts are made in the model runner after each step and come back
with its output (``receive``); here they are only handed to the requests that may verify them.

Under asynchronous scheduling the engine asks ``will_draft`` before each step, while the previous step may still be in
flight: the switch-off depends only on the batch the host already knows (which requests decode, their lengths with the
tokens in flight counted). A step that will not draft is pipelined (``skip``); before one that will, the engine
finishes the step in flight, so that ``propose`` works on tokens read back, as in the synchronous mode. Such a step
gives up the overlap of host and device work, so there drafting must also win back that time (``SYNC_OVERHEAD``), and
prompt lookup counts only on the share of requests it has lately found drafts for (on random text almost none, and
the verify step gains nothing); a lookup held back that way is tried again every ``PROBE_EVERY`` steps.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rooflm.spec_decode.config import SpeculativeConfig
from rooflm.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from rooflm.engine.request import Request
    from rooflm.engine.stats import EngineStats
    from rooflm.roofline.live import LiveRoofline

_PRIOR_ACCEPTANCE = 0.5  # assumed before any draft was verified
# The host time asynchronous scheduling hides, as a share of a step: a drafting step under asynchronous scheduling waits
# for the step before it (H100: 7% of a step at batch 64, 6% at batch 1, docs/benchmarks.md).
SYNC_OVERHEAD = 0.1
HIT_DECAY = 0.9  # prompt lookup's hit counts fade by this much per drafting step (a memory of about ten steps)
PROBE_EVERY = 16  # steps held back by a low prompt-lookup hit rate before one drafting step measures it again


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens per verification of k drafts when each is accepted with probability ``acceptance``."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def eligible(req: "Request", in_flight: bool = False) -> bool:
    """Requests whose next token the verifier can decide: plain decodes without logprobs, penalties, logit bias,
    structured output or min_tokens bans (their sampling depends on state the draft positions would change, or on
    logit changes the verifier does not apply; a grammar's mask at each draft position would need the matcher
    advanced through the drafts). ``in_flight``: judged as the request will be once the step in flight is read back
    (its one output placeholder, already counted in ``num_tokens``, resolved)."""
    p = req.params
    return (req.num_output_placeholders <= (1 if in_flight else 0) and req.num_computed_tokens == req.num_tokens - 1
            and req.num_output_tokens >= max(1, p.min_tokens) and p.logprobs is None and p.prompt_logprobs is None
            and p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
            and not getattr(p, "logit_bias", None) and getattr(p, "structured_outputs", None) is None)


class SpeculativeProposer:
    def __init__(self, config: SpeculativeConfig, roofline: "LiveRoofline | None", max_model_len: int) -> None:
        self.config = config
        self.roofline = roofline
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.model_based = config.method != "ngram"
        self.draft_cost = 0.0  # a draft step's cost over a plain decode step (set by the engine for draft models)
        self.pending: dict[str, list[int]] = {}  # drafts made by the runner after the last step
        self.drafting = True  # whether the last decision wants drafts (the runner skips drafting otherwise)
        # decodes prompt lookup found drafts for, and decodes it looked up, fading (prior: one hit in one lookup)
        self.hits, self.lookups = 1.0, 1.0
        self.held_back = 0  # steps in a row that the hit rate alone kept from drafting

    def receive(self, drafts: dict[str, list[int]]) -> None:
        """The draft tokens the runner proposed after the step just read back (each continues its request)."""
        self.pending = dict(drafts)

    @property
    def hit_rate(self) -> float:
        """The share of decodes expected to get drafts: prompt lookup's recent hit rate; a draft model drafts for all."""
        return 1.0 if self.model_based else self.hits / self.lookups

    def pays(self, decodes: list["Request"], acceptance: float, hit_rate: float = 1.0, overhead: float = 0.0) -> bool:
        """Whether verifying k drafts per request beats plain decoding on the roofline, at this acceptance rate.
        ``hit_rate``: the share of requests that get drafts (the others decode plainly in the verify step);
        ``overhead``: what a drafting step costs beyond the roofline, as a share of a plain step."""
        if self.roofline is None or not decodes:
            return True
        k = self.config.num_speculative_tokens
        ctx = [r.num_tokens for r in decodes]
        n = len(decodes)
        m = n if hit_rate >= 1.0 else min(n, max(1, round(hit_rate * n)))  # requests that verify
        q = [k + 1] * m + [1] * (n - m)
        plain = self.roofline.predict([1] * n, ctx, n)
        verify = self.roofline.predict(q, [c + x - 1 for c, x in zip(ctx, q)], sum(q))
        gain = 1.0 + min(1.0, hit_rate) * (expected_tokens(k, acceptance) - 1.0)  # tokens per plain token
        return (verify + k * self.draft_cost * plain) / gain < plain / (1.0 + overhead)

    def _coming_decodes(self, running: list["Request"]) -> list["Request"]:
        """The requests ``propose`` will see as eligible decodes once the step in flight is read back (one that its
        token in flight brings to max_tokens or max_model_len will have finished)."""
        return [r for r in running if eligible(r, in_flight=True) and r.num_tokens < self.max_model_len
                and (r.params.max_tokens is None or r.num_output_tokens < r.params.max_tokens)]

    def will_draft(self, running: list["Request"], stats: "EngineStats") -> bool:
        """Whether the coming step drafts, decided before the step in flight (if any) is read back: some request will
        decode and may get drafts, and (under ``auto_disable``) drafting pays for that batch. False also when nothing
        would be drafted: such a step need not wait for the one in flight."""
        decodes = self._coming_decodes(running)
        if not decodes:
            return False
        if not self.config.auto_disable:
            return True
        a = stats.spec_acceptance_rate
        a = _PRIOR_ACCEPTANCE if a is None else a
        if self.pays(decodes, a, self.hit_rate, SYNC_OVERHEAD):
            return True
        if self.hit_rate < 1.0 and self.pays(decodes, a, 1.0, SYNC_OVERHEAD):  # only the hit rate holds it back
            self.held_back += 1
            if self.held_back >= PROBE_EVERY:  # look again now and then: the text may have changed
                self.held_back = 0
                return True
        return False

    def skip(self, running: list["Request"], stats: "EngineStats") -> None:
        """A step without drafts (``will_draft`` said no): drafts the runner made earlier are dropped (the step in
        flight moves the requests past them), the runner's drafter stays off, and a switched-off step is counted."""
        self.pending = {}
        self.drafting = False
        if not self.model_based:
            self.ngram.retain({r.request_id for r in running})
        if self._coming_decodes(running):
            stats.spec_steps_disabled += 1

    def propose(self, running: list["Request"], stats: "EngineStats") -> None:
        """Set ``spec_token_ids`` on the running requests that get drafts this step."""
        pending, self.pending = self.pending, {}
        self.drafting = True
        if not self.model_based:
            self.ngram.retain({r.request_id for r in running})
        decodes = [r for r in running if eligible(r)]
        if not decodes:
            return
        acceptance = stats.spec_acceptance_rate
        if self.config.auto_disable and not self.pays(decodes, _PRIOR_ACCEPTANCE if acceptance is None else acceptance):
            stats.spec_steps_disabled += 1
            self.drafting = False
            return
        k = self.config.num_speculative_tokens
        self.held_back = 0
        hits = lookups = 0
        for req in decodes:
            p = req.params
            limit = min(k, self.max_model_len - req.num_tokens - 1)
            if p.max_tokens is not None:
                limit = min(limit, p.max_tokens - req.num_output_tokens - 1)
            if limit >= 1 and self.model_based:
                req.spec_token_ids = pending.get(req.request_id, [])[:limit]
            elif limit >= 1:
                req.spec_token_ids = self.ngram.propose(req.all_token_ids, limit, req.request_id)
                lookups += 1
                hits += bool(req.spec_token_ids)
        if lookups:
            self.hits = HIT_DECAY * self.hits + hits
            self.lookups = HIT_DECAY * self.lookups + lookups
