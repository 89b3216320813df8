"""Scheduling policies: which waiting request is admitted next, and which running request is preempted.

The scheduler (``rooflm.engine.scheduler``) keeps one rule for every policy: running requests first, then
admissions, under one token budget, ``max_num_seqs`` and the KV pool. A policy only answers these questions:

- ``next_waiting(waiting)``: the request to try to admit next (admission stops at the first that does not fit, so
  nobody jumps the policy's order);
- ``order_running(running)``: the order running requests get the step's budget in;
- ``victim(running)``: whom to preempt when the pool runs short;
- ``outranks(candidate, victim)``: may a waiting request preempt a running one to be admitted (never, for FCFS and
  ``fair``);
- ``grant_prefill(req, num_new)``: how many of the ``num_new`` prompt tokens (a prompt's chunk, or the recomputation
  after a preemption) ``req`` may compute this step (all of them, except under ``priority``);
- hooks to keep its own state: ``add``, ``before_schedule``, ``on_admit``, ``on_finish``.

Policies:

- ``fcfs``: first come, first served; the most recently admitted running request is preempted (the default).
- ``priority``: vLLM's semantics: a lower ``priority`` value is served first, ties by arrival; the victim is the
  lowest-priority, latest-arrived running request, and a waiting request preempts running ones of strictly lower
  priority (never one of equal or higher priority). A request's first token waits for the step in flight when it
  arrives and then for its own prompt's step, so two rules keep both short for the best class seen so far:
  requests of a worse class compute at most ``priority_prefill_chunk`` prompt tokens per step together (so the
  step a better-class arrival waits for holds at most that much lower-priority prefill, instead of whole
  prompts), and a step in which a request of the best class present has prompt tokens to compute gives worse
  classes no prompt tokens, so its prompt does not share the step with lower-priority prefill. Decodes (one token
  each) are never held back. ``priority_prefill_chunk=None`` turns both rules off.
- ``mlfq``: FastServe's skip-join multi-level feedback queue (Wu et al. 2023, "Fast Distributed Inference Serving
  for Large Language Models"). Level ``i`` has a quantum of ``mlfq_quantum * 2**i`` generated tokens; a request
  joins the level its prompt length selects (skip-join: a long prompt's first iteration is long, so it skips the
  levels whose quantum it would exhaust at once), is demoted one level each time it generates its level's quantum,
  and is promoted back to the top level after waiting ``mlfq_starvation_steps`` scheduler steps (counted in steps,
  not wall time, so the rule is reproducible). Strict priority across levels, with preemption of lower levels;
  first come first served within a level.
- ``fair``: the Virtual Token Counter (Sheng et al. 2024, "Fairness in Serving Large Language Models"). Each client
  (the request's ``user``) has a counter of the service it received, ``w_in`` per prompt token admitted and
  ``w_out`` per generated token; the waiting request of the client with the smallest counter is admitted next. A
  client that becomes active has its counter lifted to the smallest counter of the clients with waiting requests
  (or, when none wait, to the counter of the client admitted last), so an idle spell banks no credit.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rooflm.config import SCHEDULING_POLICIES as POLICIES

if TYPE_CHECKING:
    from rooflm.config import SchedulerConfig
    from rooflm.engine.request import Request


class FCFSPolicy:
    """First come, first served. The scheduler's waiting deque is already in this order (preempted requests go to
    its front), so every question is answered from the ends of the lists."""

    name = "fcfs"
    preempts_for_admission = False

    def add(self, req: "Request", waiting: Sequence["Request"]) -> None:
        pass

    def before_schedule(self, waiting: Sequence["Request"], running: list["Request"]) -> None:
        pass

    def order_running(self, running: list["Request"]) -> None:
        pass  # admission order

    def next_waiting(self, waiting: Sequence["Request"]) -> "Request":
        return waiting[0]

    def victim(self, running: Sequence["Request"]) -> "Request":
        return running[-1]  # the most recently admitted

    def outranks(self, candidate: "Request", victim: "Request") -> bool:
        return False

    def on_admit(self, req: "Request") -> None:
        pass

    def on_finish(self, req: "Request") -> None:
        pass

    def grant_prefill(self, req: "Request", num_new: int) -> int:
        return num_new


class _KeyedPolicy(FCFSPolicy):
    """A policy with a sort key per request (smaller is served first); ties go to the earlier arrival."""

    preempts_for_admission = True

    def key(self, req: "Request") -> tuple[int, int]:
        raise NotImplementedError

    def order_running(self, running: list["Request"]) -> None:
        running.sort(key=self.key)

    def next_waiting(self, waiting: Sequence["Request"]) -> "Request":
        return min(waiting, key=self.key)

    def victim(self, running: Sequence["Request"]) -> "Request":
        return max(running, key=self.key)

    def outranks(self, candidate: "Request", victim: "Request") -> bool:
        return self.key(candidate)[0] < self.key(victim)[0]  # a strictly better class, never an equal one


class PriorityPolicy(_KeyedPolicy):
    name = "priority"

    def __init__(self, prefill_chunk: int | None = None) -> None:
        self.prefill_chunk = prefill_chunk  # None: worse classes' prompts are not limited
        self.best_seen: int | None = None  # the best (smallest) priority value added so far
        self.urgent: int | None = None  # this step: the best class among requests with prompt tokens to compute
        self.chunk_left = 0  # this step: prompt tokens worse classes may still compute

    def key(self, req: "Request") -> tuple[int, int]:
        return req.params.priority, req.arrival_index

    def add(self, req: "Request", waiting: Sequence["Request"]) -> None:
        p = req.params.priority
        self.best_seen = p if self.best_seen is None else min(self.best_seen, p)

    def before_schedule(self, waiting: Sequence["Request"], running: list["Request"]) -> None:
        pending = [r.params.priority for r in running if r.num_computed_tokens < r.num_prompt_tokens]
        pending += [r.params.priority for r in waiting]
        self.urgent = min(pending, default=None)
        self.chunk_left = self.prefill_chunk or 0

    def grant_prefill(self, req: "Request", num_new: int) -> int:
        p = req.params.priority
        if self.prefill_chunk is None:  # the plain priority order (vLLM's)
            return num_new
        if self.urgent is not None and p > self.urgent:
            return 0  # a better class computes its prompt this step: it gets the step to itself
        if self.best_seen is None or p <= self.best_seen:
            return num_new
        granted = min(num_new, self.chunk_left)
        self.chunk_left -= granted
        return granted


class MLFQPolicy(_KeyedPolicy):
    name = "mlfq"

    def __init__(self, num_levels: int, quantum: int, skip_join_tokens: int, starvation_steps: int) -> None:
        self.num_levels = num_levels
        self.quantum = quantum
        self.skip_join_tokens = skip_join_tokens
        self.starvation_steps = starvation_steps
        self.level: dict[str, int] = {}
        self.level_start: dict[str, int] = {}  # generated tokens when the request entered its level
        self.waited: dict[str, int] = {}  # consecutive steps spent waiting
        self.num_demotions = 0
        self.num_promotions = 0

    def initial_level(self, num_prompt_tokens: int) -> int:
        """Skip-join: the top level for a prompt of up to ``skip_join_tokens``, one level lower per doubling."""
        level, limit = 0, self.skip_join_tokens
        while num_prompt_tokens > limit and level < self.num_levels - 1:
            level, limit = level + 1, limit * 2
        return level

    def level_quantum(self, level: int) -> int:
        return self.quantum << level

    def key(self, req: "Request") -> tuple[int, int]:
        return self.level[req.request_id], req.arrival_index

    def add(self, req: "Request", waiting: Sequence["Request"]) -> None:
        self.level[req.request_id] = self.initial_level(req.num_prompt_tokens)
        self.level_start[req.request_id] = 0
        self.waited[req.request_id] = 0

    def before_schedule(self, waiting: Sequence["Request"], running: list["Request"]) -> None:
        for req in running:
            rid = req.request_id
            self.waited[rid] = 0
            generated = len(req.all_token_ids) - req.num_prompt_tokens
            while (self.level[rid] < self.num_levels - 1
                   and generated - self.level_start[rid] >= self.level_quantum(self.level[rid])):
                self.level_start[rid] += self.level_quantum(self.level[rid])
                self.level[rid] += 1
                self.num_demotions += 1
        for req in waiting:
            rid = req.request_id
            self.waited[rid] += 1
            if self.waited[rid] >= self.starvation_steps:  # the starvation guard
                if self.level[rid] > 0:
                    self.num_promotions += 1
                self.level[rid] = 0
                self.level_start[rid] = len(req.all_token_ids) - req.num_prompt_tokens
                self.waited[rid] = 0

    def on_finish(self, req: "Request") -> None:
        for d in (self.level, self.level_start, self.waited):
            d.pop(req.request_id, None)


class FairPolicy(FCFSPolicy):
    """The Virtual Token Counter. Preemption stays FCFS's (the paper does not preempt for fairness)."""

    name = "fair"

    def __init__(self, input_weight: float, output_weight: float) -> None:
        self.w_in = input_weight
        self.w_out = output_weight
        self.counters: dict[str, float] = {}
        self.charged_out: dict[str, int] = {}  # generated tokens already charged, per request
        self.last_admitted: str | None = None

    @staticmethod
    def client(req: "Request") -> str:
        return req.params.user or ""

    def add(self, req: "Request", waiting: Sequence["Request"]) -> None:
        u = self.client(req)
        c = self.counters.setdefault(u, 0.0)
        queued = {self.client(r) for r in waiting}
        if u not in queued:  # the client becomes active: lift its counter (no credit for idle time)
            if queued:
                c = max(c, min(self.counters[v] for v in queued))
            elif self.last_admitted is not None:
                c = max(c, self.counters[self.last_admitted])
            self.counters[u] = c
        self.charged_out[req.request_id] = 0

    def _charge_output(self, req: "Request") -> None:
        generated = len(req.all_token_ids) - req.num_prompt_tokens
        done = self.charged_out.get(req.request_id, generated)
        if generated > done:
            self.counters[self.client(req)] += self.w_out * (generated - done)
            self.charged_out[req.request_id] = generated

    def before_schedule(self, waiting: Sequence["Request"], running: list["Request"]) -> None:
        for req in running:
            self._charge_output(req)

    def next_waiting(self, waiting: Sequence["Request"]) -> "Request":
        return min(waiting, key=lambda r: (self.counters[self.client(r)], r.arrival_index))

    def on_admit(self, req: "Request") -> None:
        u = self.client(req)
        if req.num_preemptions == 0:  # a resumed request's prompt was charged once already
            self.counters[u] += self.w_in * req.num_prompt_tokens
        self.last_admitted = u

    def on_finish(self, req: "Request") -> None:
        self._charge_output(req)
        self.charged_out.pop(req.request_id, None)


SchedulingPolicy = FCFSPolicy  # the protocol every policy implements (FCFS's methods are its defaults)


def make_policy(config: "SchedulerConfig") -> FCFSPolicy:
    name = config.scheduling_policy
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(config.priority_prefill_chunk)
    if name == "mlfq":
        return MLFQPolicy(config.mlfq_num_levels, config.mlfq_quantum, config.mlfq_skip_join_tokens,
                          config.mlfq_starvation_steps)
    if name == "fair":
        return FairPolicy(config.fair_input_weight, config.fair_output_weight)
    raise ValueError(f"scheduling_policy={name!r} is invalid: expected one of {POLICIES}")


__all__ = ["POLICIES", "SchedulingPolicy", "FCFSPolicy", "PriorityPolicy", "MLFQPolicy", "FairPolicy", "make_policy"]
