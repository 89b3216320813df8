"""The scheduler: one decision per step under one token budget (vLLM v1's rule, Orca's iteration-level batching).

Every sequence has ``num_computed_tokens`` catching up to ``num_tokens``. Each step:
1. running sequences, in admission order, get what they still need (a decode: 1 token; an unfinished prompt: the
   next chunk), within ``max_num_batched_tokens``. When the KV pool cannot supply a block, the most recently
   admitted running sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
   recomputed later (its tokens so far are kept, so its output does not change).
2. if nothing was preempted, waiting sequences are admitted first come first served while the budget, the pool
   and ``max_num_seqs`` allow, their prompt's cached prefix (full blocks) skipped.

Stop conditions are decided by the engine, which calls ``finish`` for finished sequences before the next step.
"""
from __future__ import annotations

import time
from collections import deque

from rooflm.config import SchedulerConfig
from rooflm.engine.sched_output import ScheduledSeq, SchedulerOutput
from rooflm.engine.sequence import Request, Sequence, SeqStatus
from rooflm.engine.stop_checker import banned_token_ids
from rooflm.kv_cache import KVCacheManager


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: list[int] | None = None) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = list(eos_token_ids or [])
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; preemption takes from the end
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.peak_blocks_used = 0

    # -- requests -----------------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request.leader)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.finish(seq, "abort")
        return request

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark ``seq`` finished and free its blocks. The request is forgotten once all its samples are done."""
        if seq.is_finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.index == 0:  # samples never forked (an abort before the prompt was computed) end with it
            for other in seq.request.seqs:
                if other.status is SeqStatus.WAITING_FOR_FORK:
                    other.status, other.finish_reason = SeqStatus.FINISHED, reason
        if seq.request.finished:
            self.requests.pop(seq.request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -----------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: dict[str, int] = {}  # seq_id -> number of new tokens, in batch order
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, f"{seq} is running with nothing to compute"
            while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.seq_id)
                budget += chosen.pop(victim.seq_id, 0)
                if victim is seq:
                    break
            else:
                chosen[seq.seq_id] = num_new
                budget -= num_new
                i += 1

        if not preempted:
            self._admit_waiting(budget, chosen)

        by_id = {s.seq_id: s for s in self.running}
        scheduled = [self._make_scheduled(by_id[sid], n) for sid, n in chosen.items()]
        used = self.kv.num_blocks - self.kv.num_free_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        return SchedulerOutput(scheduled, preempted, self.kv.take_pending_copies())

    def _admit_waiting(self, budget: int, chosen: dict[str, int]) -> None:
        now = time.monotonic()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            num_seqs_after = len(self.running) + (self._num_unforked(seq) if seq.index == 0 else 1)
            if num_seqs_after > self.config.max_num_seqs and self.running:
                break
            hits, num_cached = [], 0
            lookup = seq.params.prompt_logprobs is None  # prompt logprobs need every prompt position computed
            if lookup:
                hits, num_cached = self.kv.get_computed_blocks(seq.all_token_ids, record=False)
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq.seq_id, num_cached, num_cached + num_new, hits):
                break  # FCFS: nobody jumps the queue
            self.waiting.popleft()
            if lookup and self.kv.enable_prefix_caching:
                self.kv.record_lookup(seq.num_tokens, num_cached)
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.index == 0 and seq.num_preemptions == 0:
                seq.request.metrics.num_cached_tokens = num_cached
                if seq.request.metrics.first_scheduled_time is None:
                    seq.request.metrics.first_scheduled_time = now
            self.running.append(seq)
            chosen[seq.seq_id] = num_new
            budget -= num_new

    def _num_unforked(self, leader: Sequence) -> int:
        return 1 + sum(s.status is SeqStatus.WAITING_FOR_FORK for s in leader.request.seqs)

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it back at the front of the queue; its tokens are kept for recompute."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _make_scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_new
        sample = end == seq.num_tokens
        params = seq.params
        rows: list[Sequence] = [seq]
        if sample and seq.index == 0:
            rows += [s for s in seq.request.seqs if s.status is SeqStatus.WAITING_FOR_FORK]
        want_prompt_lp = params.prompt_logprobs is not None and start < seq.num_prompt_tokens
        penalties = sample and (params.repetition_penalty != 1 or params.presence_penalty != 0
                                or params.frequency_penalty != 0)
        ban = banned_token_ids(seq.num_output_tokens, params, self.eos_token_ids) if sample else []
        return ScheduledSeq(
            seq_id=seq.seq_id,
            request_id=seq.request.request_id,
            token_ids=seq.all_token_ids[start:end],
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(seq.seq_id),
            sample=sample,
            params=params,
            generators=[r.generator for r in rows] if sample else [],
            # Token histories only where penalties read them: copying them each step costs host time.
            output_token_ids=[r.output_token_ids if penalties else [] for r in rows] if sample else [],
            prompt_token_ids=seq.all_token_ids[: seq.num_prompt_tokens] if penalties or want_prompt_lp else [],
            ban_token_ids=ban,
            prompt_logprobs=want_prompt_lp,
        )

    # -- after the forward pass ----------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Sequence, str, int]]:
        """Advance ``num_computed_tokens``, cache newly full blocks, append sampled tokens and fork the samples of
        n > 1 requests. ``sampled[seq_id]`` holds one token per row of that ScheduledSeq. Returns, for each sequence
        that received a token (forked ones included, in batch order), ``(sequence, scheduled seq_id, row)``."""
        by_id = {s.seq_id: s for s in self.running}
        got_token: list[tuple[Sequence, str, int]] = []
        for sch in out.scheduled:
            seq = by_id.get(sch.seq_id)
            if seq is None:  # finished (aborted) while the step ran
                continue
            seq.num_computed_tokens += sch.num_new_tokens
            self.kv.cache_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            if not sch.sample:
                continue
            tokens = sampled[sch.seq_id]
            seq.all_token_ids.append(tokens[0])
            got_token.append((seq, sch.seq_id, 0))
            if len(tokens) > 1:  # the leader's samples fork off here, sharing its blocks
                followers = [s for s in seq.request.seqs if s.status is SeqStatus.WAITING_FOR_FORK]
                assert len(followers) == len(tokens) - 1
                for row, (follower, token) in enumerate(zip(followers, tokens[1:]), start=1):
                    self.kv.fork(seq.seq_id, follower.seq_id)
                    follower.num_computed_tokens = seq.num_computed_tokens
                    follower.all_token_ids.append(token)
                    follower.status = SeqStatus.RUNNING
                    self.running.append(follower)
                    got_token.append((follower, sch.seq_id, row))
        return got_token
