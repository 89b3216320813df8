"""The scheduler: one decision per step under one token budget (vLLM v1's rule, Orca's iteration-level batching).

Every request has ``num_computed_tokens`` catching up to ``num_tokens``. Each ``schedule()``:
1. running requests, in the policy's order (FCFS: admission order), get what they still need (a decode: 1 token;
   an unfinished prompt: the next chunk), within ``max_num_batched_tokens``. When the KV pool cannot supply a
   block, the policy's victim (FCFS: the most recently admitted running request) is preempted: its blocks are freed
   and it goes back to the queue, to be recomputed later (its tokens so far are kept, so its output does not
   change), or, under swap preemption (``rooflm.kv_cache.swap``), its KV is copied to host memory and back.
   A request under KV compression (``rooflm.kv_cache.compression``) first drops its oldest window blocks.
2. if nothing was preempted, waiting requests are admitted in the policy's order (FCFS: first come first served)
   while the budget, the pool and ``max_num_seqs`` allow, their prompt's cached prefix (full blocks) skipped. A
   policy with classes (``priority``, ``mlfq``) may preempt running requests of a strictly lower class to admit a
   waiting one; otherwise admission stops at the first request that does not fit.
The policies live in ``rooflm.engine.policy``.
``num_computed_tokens`` advances at scheduling time, so the next step can be scheduled while this one runs
(asynchronous scheduling); a request that will sample holds an output placeholder until its token is read back.

``update_from_output()`` is the one owner of every per-request change after a step: append the sampled tokens,
check the stop conditions (``stop_checker``), finish and free. (Full blocks enter the prefix cache when the step
that fills them is scheduled.)
Stop strings need detokenized text, so the output processor finds them and calls ``finish_requests``.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from rooflm.config import SchedulerConfig
from rooflm.engine.policy import make_policy
from rooflm.engine.request import Request, RequestStatus
from rooflm.engine.sched_output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                                        SchedulerOutput)
from rooflm.engine.stop_checker import FINISH_LENGTH, check_stop
from rooflm.kv_cache import KVCacheManager
from rooflm.kv_cache.compression import KVCompressionConfig, plan_drop, plan_h2o_drop
from rooflm.kv_cache.host_tier import HostPrefixTier
from rooflm.kv_cache.swap import SwapManager

FINISH_ABORT = "abort"


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; preemption takes from the end
        self.requests: dict[str, Request] = {}
        self.policy = make_policy(config)
        self._num_added = 0
        # Requests the runner holds state for, and how many of each one's blocks it has been sent.
        self._sent_blocks: dict[str, int] = {}
        self._finished_for_runner: set[str] = set()
        self._preempted_for_runner: set[str] = set()  # preempted in steps the runner has not run yet
        self.num_preemptions = 0
        self.peak_blocks_used = 0
        # Prompt tokens computed, each position once: prefix-cache hits and recomputation after preemption excluded.
        self.num_prompt_tokens_computed = 0
        # Speculative decoding: draft tokens verified and accepted so far.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        # Slots a step that samples reserves past its tokens: a draft model writes the KV of its k drafts there right
        # after the step (vLLM's lookahead slots); the next step recomputes those positions.
        self.num_lookahead_tokens = 0
        # Swap preemption (rooflm.kv_cache.swap): set by the engine unless preemption_mode is "recompute".
        self.swap: SwapManager | None = None
        # Engine-wide KV compression (a request's SamplingParams.kv_compression overrides it); None: off.
        self.compression: KVCompressionConfig | None = None
        self._dropped: dict[str, list[tuple[int, int]]] = {}
        self.h2o_scores: dict[str, list[float]] = {}  # H2O: accumulated attention score per block of a request's table
        # The prefix cache's host tier (rooflm.kv_cache.host_tier), set by the engine when kv_offload_gb > 0.
        self.host_tier: HostPrefixTier | None = None

    # -- requests -----------------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        comp = self._compression(request)
        if comp is not None:
            comp.check(self.kv.block_size)
        request.arrival_index = self._num_added
        self._num_added += 1
        self.policy.add(request, self.waiting)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], reason: str = FINISH_ABORT,
                        stop_reason: int | str | None = None) -> list[Request]:
        """Finish (abort, or stop on a stop string) and free. Unknown or finished ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, reason, stop_reason)
                done.append(req)
        return done

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self.h2o_scores.pop(req.request_id, None)
        if self.swap is not None:
            self.swap.drop(req.request_id)
        self.policy.on_finish(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.requests.pop(req.request_id, None)
        if self._sent_blocks.pop(req.request_id, None) is not None:
            self._finished_for_runner.add(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -----------------------------------------------------------------------------------------------------
    def _will_finish(self, req: Request) -> bool:
        """Its pending placeholder already reaches max_tokens or max_model_len: nothing more to compute."""
        p = req.params
        return ((p.max_tokens is not None and req.num_output_tokens >= p.max_tokens)
                or req.num_tokens >= self.config.max_model_len)

    def _slots(self, req: Request, end: int) -> int:
        """KV slots a step computing up to ``end`` needs: with lookahead for a draft when the step samples."""
        if self.num_lookahead_tokens and end >= req.num_tokens:
            return max(end, min(end + self.num_lookahead_tokens, self.config.max_model_len))
        return end

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: dict[str, int] = {}  # req_id -> number of new tokens, in batch order
        preempted: set[str] = set()

        spec_used: dict[str, int] = {}
        self.policy.before_schedule(self.waiting, self.running)
        self.policy.order_running(self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = granted = self._limit(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if req.spec_token_ids and num_new == 1 and budget > 1:  # a decode with draft tokens to verify
                spec_used[req.request_id] = n_spec = min(len(req.spec_token_ids), budget - 1)
                num_new += n_spec
            # A request with a grammar waits for its placeholder: its next mask needs the token still in flight.
            if num_new <= 0 or (req.num_output_placeholders and (self._will_finish(req)
                                                                 or req.params.structured_outputs is not None)):
                i += 1
                continue
            if self._compression(req) is not None:
                spec_used.pop(req.request_id, None)  # no draft tokens: a step's tokens are capped by the budget
                num_new = self._compress(req, granted)
            # cache indices run behind positions by the tokens compression dropped
            cached = req.num_computed_tokens - req.num_dropped_tokens
            while not self.kv.allocate_slots(req.request_id, cached, self._slots(req, req.num_computed_tokens + num_new)
                                             - req.num_dropped_tokens):
                victim = self.policy.victim(self.running)
                budget += self._evict(victim, chosen, preempted, spec_used)
                if victim is req:
                    break
            else:
                chosen[req.request_id] = num_new
                budget -= num_new
                i += 1

        if not preempted:
            self._admit_waiting(budget, chosen, preempted, spec_used)
        return self._build_output(chosen, preempted, spec_used)

    def _evict(self, victim: Request, chosen: dict[str, int], preempted: set[str], spec_used: dict[str, int]) -> int:
        """Preempt ``victim`` within this step's schedule; returns the budget it had taken."""
        self._preempt(victim)
        if victim.request_id in self._sent_blocks:
            del self._sent_blocks[victim.request_id]
            preempted.add(victim.request_id)
        spec_used.pop(victim.request_id, None)
        return chosen.pop(victim.request_id, 0)

    def _victim_for(self, candidate: Request) -> Request | None:
        """A running request the policy lets ``candidate`` preempt to be admitted, or None."""
        if not self.policy.preempts_for_admission or not self.running:
            return None
        victim = self.policy.victim(self.running)
        return victim if self.policy.outranks(candidate, victim) else None

    def _admit_waiting(self, budget: int, chosen: dict[str, int], preempted: set[str],
                       spec_used: dict[str, int]) -> None:
        now = time.monotonic()
        while self.waiting and budget > 0:
            req = self.policy.next_waiting(self.waiting)
            if req.num_output_placeholders:  # preempted while a step ran for it: resume once its token is back
                break
            if not len(self.running) < self.config.max_num_seqs:
                victim = self._victim_for(req)
                if victim is None:
                    break
                budget += self._evict(victim, chosen, preempted, spec_used)
                continue
            hits, num_cached, held = [], 0, []
            swapped = self.swap is not None and self.swap.holds(req.request_id)
            comp = self._compression(req)
            # (prompt logprobs need every position, a compressed request full-attention KV: no lookup for those)
            lookup = (not swapped and self.kv.enable_prefix_caching and not req.wants_prompt_logprobs
                      and comp is None)
            if swapped:  # its KV comes back from host memory
                num_cached = req.num_computed_tokens
            elif lookup:
                hashes = req.update_block_hashes(self.kv.block_size)
                hits, num_cached = self.kv.get_computed_blocks_by_hash(hashes, req.num_tokens, record=False)
                if self.host_tier is not None:  # the blocks after the device's hits may wait in host memory
                    held = self.host_tier.hold(hashes, len(hits), self._max_hit_blocks(req, hashes))
                    num_cached += len(held) * self.kv.block_size
            num_new = self._limit(req, min(req.num_tokens - num_cached, budget))
            if num_new <= 0:  # the policy defers its prompt this step: nobody jumps the policy's queue
                if held:
                    self.host_tier.release(held)
                break
            if comp is not None:
                num_new = min(num_new, comp.max_new_tokens(self.kv.block_size))
            if not (self._swap_in(req, num_new) if swapped
                    else self.kv.allocate_slots(req.request_id, len(hits) * self.kv.block_size,
                                                self._slots(req, num_cached + num_new), hits)):
                if held:
                    self.host_tier.release(held)
                victim = self._victim_for(req)
                if victim is None:
                    break  # nobody jumps the policy's queue
                budget += self._evict(victim, chosen, preempted, spec_used)
                continue
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            self.policy.on_admit(req)
            if lookup:
                self.kv.record_lookup(req.num_tokens, len(hits) * self.kv.block_size)
                if self.host_tier is not None:  # restored blocks count as computed, like device hits
                    self.host_tier.restore(held, self.kv.get_block_ids(req.request_id)[len(hits):len(hits) + len(held)],
                                           self._max_hit_blocks(req, hashes) - len(hits) - len(held))
            if req.num_preemptions == 0:
                req.metrics.num_cached_tokens = num_cached
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self.running.append(req)
            chosen[req.request_id] = num_new
            budget -= num_new

    def _limit(self, req: Request, num_new: int) -> int:
        """The prompt tokens of ``num_new`` the policy grants this step (a decode's one token is never held back)."""
        return self.policy.grant_prefill(req, num_new) if num_new > 1 else num_new

    def _max_hit_blocks(self, req: Request, hashes: list[int]) -> int:
        """Full prompt blocks a cache may supply: at least one token is left to compute (it gives the logits)."""
        return min(len(hashes), (req.num_tokens - 1) // self.kv.block_size)

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s blocks and put it back at the front of the queue; its tokens are kept. Its KV is either
        swapped out to host memory (``self.swap`` decides) or recomputed on resume."""
        self.running.remove(req)
        n_blocks = self.kv.blocks_needed(req.num_computed_tokens)
        if (self.swap is not None and not req.num_dropped_tokens
                and self.swap.should_swap(n_blocks, req.num_computed_tokens)):
            self.swap.swap_out(req.request_id, self.kv.get_block_ids(req.request_id)[:n_blocks])
        else:
            req.num_computed_tokens = req.num_dropped_tokens = 0
            self.h2o_scores.pop(req.request_id, None)
            if self.swap is not None:
                self.swap.stats.recomputes += 1
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _compression(self, req: Request) -> KVCompressionConfig | None:
        return req.params.kv_compression or self.compression

    def _compress(self, req: Request, num_new: int) -> int:
        """Cap a compressed request's new tokens and drop the blocks they would push past its budget: the oldest window
        blocks (StreamingLLM) or the lowest-scored ones (H2O), rooflm.kv_cache.compression; returns the tokens to
        schedule."""
        comp, bs = self._compression(req), self.kv.block_size
        num_new = min(num_new, comp.max_new_tokens(bs))
        cache_len = req.num_computed_tokens - req.num_dropped_tokens
        if comp.method == "h2o":
            scores = self.h2o_scores.setdefault(req.request_id, [])
            indices = plan_h2o_drop(comp, cache_len, num_new, bs, scores)
            ranges = [(i, 1) for i in reversed(indices)]  # last first: the earlier indices stay valid
            for i in ranges:
                del scores[i[0]:i[0] + 1]
        else:
            n = plan_drop(comp, cache_len, num_new, bs)
            ranges = [(comp.sink_blocks(bs), n)] if n else []
        for start, n in ranges:
            self.kv.drop_blocks(req.request_id, start, n)
            req.num_dropped_tokens += n * bs
            self._sent_blocks[req.request_id] -= n  # dropped blocks were computed, so sent
        if ranges:
            self._dropped[req.request_id] = ranges
        return num_new

    def _swap_in(self, req: Request, num_new: int) -> bool:
        """Fresh device blocks for a swapped-out request's KV (queued to be copied back) plus this step's tokens;
        False (nothing changed) when the pool cannot supply them."""
        end = self._slots(req, req.num_computed_tokens + num_new)  # with a draft's lookahead slots
        if self.kv.blocks_needed(end) > self.kv.num_free_blocks:
            return False
        self.swap.swap_in(req.request_id, self.kv.allocate_restored(req.request_id,
                                                                    self.swap.num_blocks_of(req.request_id)))
        if not self.kv.allocate_slots(req.request_id, req.num_computed_tokens, end):
            raise RuntimeError(f"request {req.request_id!r}: the pool changed while it was swapped in")
        return True

    def _build_output(self, chosen: dict[str, int], preempted: set[str], spec_used: dict[str, int]) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        sampling: list[str] = []
        computed_after: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        for rid, num_new in chosen.items():
            req = self.requests[rid]
            start = req.num_computed_tokens
            sent = self._sent_blocks.get(rid)
            if sent is None:
                block_ids = self.kv.get_block_ids(rid)
                new_reqs.append(NewRequestData(rid, list(req.all_token_ids), req.num_prompt_tokens, req.params,
                                               req.generator, block_ids, start))
                self._sent_blocks[rid] = len(block_ids)
            else:
                new_ids = self.kv.get_block_ids(rid, sent)
                cached.append(CachedRequestData(rid, new_ids))
                self._sent_blocks[rid] = sent + len(new_ids)
            req.num_computed_tokens = end = start + num_new
            computed_after[rid] = end - req.num_dropped_tokens  # the context its attention reads
            if end > req.prompt_high_water and req.prompt_high_water < req.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(end, req.num_prompt_tokens) - max(start, req.prompt_high_water)
                req.prompt_high_water = min(end, req.num_prompt_tokens)
            if self.kv.enable_prefix_caching and self._compression(req) is None:
                # Register the blocks this step fills as soon as it is scheduled (vLLM v1 does the same): any later
                # step that reads them through a prefix hit runs after this one on the device. Only blocks of known
                # tokens can be hashed; one ending in a token still in flight is registered at a later step.
                self.kv.cache_full_blocks(rid, req.all_token_ids, min(end, len(req.all_token_ids)),
                                          req.update_block_hashes(self.kv.block_size))
            n_spec = spec_used.get(rid, 0)
            if n_spec:
                spec_tokens[rid] = req.spec_token_ids[:n_spec]
            if end == req.num_tokens + n_spec:
                sampling.append(rid)
                req.num_output_placeholders += 1
            req.spec_token_ids = []
        used = self.kv.num_blocks - self.kv.num_free_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        finished: set[str] = set()
        # An empty step is not executed: the runner sees the ids finished or preempted in it with the next step it
        # runs (a request preempted in an empty step and admitted again later is then removed before it is re-added).
        self._preempted_for_runner |= preempted
        if chosen:
            finished, self._finished_for_runner = self._finished_for_runner, set()
            preempted, self._preempted_for_runner = self._preempted_for_runner, set()
        # Swap copies wait for a step the runner executes: a step in which the only running request preempted itself
        # is empty, and the copy of its blocks out must still happen before any later step reuses them.
        swap_out, swap_in = self.swap.take() if self.swap is not None and chosen else ([], [])
        dropped, self._dropped = self._dropped, {}
        scored = [r for r in chosen if (c := self._compression(self.requests[r])) is not None and c.method == "h2o"]
        offload, restore = self.host_tier.take() if self.host_tier is not None and chosen else ([], [])
        return SchedulerOutput(new_reqs, cached, chosen, sampling, spec_tokens, finished, preempted,
                               self.kv.take_pending_copies(), computed_after, blocks_to_swap_out=swap_out,
                               blocks_to_swap_in=swap_in,
                               kv_dropped={r: d for r, d in dropped.items() if r in chosen},
                               kv_offload_out=offload, kv_offload_in=restore, attn_score_req_ids=scored)

    # -- after the forward pass ----------------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply one step's results: sampled tokens, logprobs, stop checks, finishing.

        Requests that finished (or were aborted) after the step was scheduled get nothing: a token sampled after a
        stop condition never reaches the user."""
        outputs: dict[str, EngineCoreOutput] = {}
        for rid, step_scores in result.block_scores.items():  # H2O: accumulate each block's attention score
            if rid in self.requests:
                acc = self.h2o_scores.setdefault(rid, [])
                acc.extend([0.0] * (len(step_scores) - len(acc)))
                for i, x in enumerate(step_scores):
                    acc[i] += x
        for rid, pl in result.prompt_logprobs.items():
            if rid in self.requests:
                outputs[rid] = EngineCoreOutput(rid, [], new_prompt_logprobs=pl)
        for row, rid in enumerate(result.req_ids):
            req = self.requests.get(rid)
            if req is None:
                continue
            tokens = result.sampled_token_ids[row]
            req.num_output_placeholders -= 1
            spec = out.scheduled_spec_tokens.get(rid)
            if spec:
                # Draft positions after the first rejected one hold KV of tokens that were not kept: recompute them.
                req.num_computed_tokens -= len(spec) + 1 - len(tokens)
                self.num_draft_tokens += len(spec)
                self.num_verifications += 1
                self.num_accepted_tokens += len(tokens) - 1
            o = outputs.get(rid) or outputs.setdefault(rid, EngineCoreOutput(rid, []))
            for j, token in enumerate(tokens):
                req.all_token_ids.append(token)
                o.new_token_ids.append(token)
                if result.logprobs and result.logprobs[row] is not None:
                    o.new_logprobs.append(result.logprobs[row])
                    o.new_sampled_logprobs.append(result.sampled_logprobs[row])
                known = len(req.all_token_ids)  # placeholders of steps still in flight do not count yet
                stop = check_stop(token, known - req.num_prompt_tokens, req.params, self.eos_token_ids,
                                  None, known, self.config.max_model_len)
                if stop is not None:  # tokens accepted after the stop are dropped
                    self._finish(req, *stop)
                    o.finish_reason, o.stop_reason = stop
                    break
        return list(outputs.values())


__all__ = ["Scheduler", "FINISH_ABORT", "FINISH_LENGTH"]
