#!/usr/bin/env python3
"""Mutation check: does the test suite notice when the code it covers is broken?

Each mutant replaces one exact snippet of a source file with a broken variant and names the tests that should then
fail. The runner copies the repository to a temporary folder (the working tree is never touched), checks that the
named tests pass on the unchanged copy, then, for each mutant, patches the copy, runs those tests and restores the
file. A mutant is CAUGHT when its tests fail, SURVIVED when they pass (the suite is blind to that bug).

    python scripts/mutation_check.py              # every mutant
    python scripts/mutation_check.py --list       # names and descriptions
    python scripts/mutation_check.py --only no-abort-on-cancel --only admission-off

Exit status: 0 when every mutant is caught, 1 when one survived, 2 when a mutant is stale (its snippet is not found
exactly once: the code changed, so update the mutant) or the named tests fail without any mutation.
Standard library only; the tests run with the interpreter given by ``--python`` (default: this one).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
_COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", "build", "dist",
                                      "*.egg-info")

CAUGHT, SURVIVED, ERROR = "CAUGHT", "SURVIVED", "ERROR"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    mutated: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    description: str


class StaleMutantError(ValueError):
    """A mutant's snippet is not in its file exactly once."""


@dataclass
class Result:
    mutant: Mutant
    status: str  # CAUGHT, SURVIVED or ERROR
    detail: str = ""


_ASYNC = "src/rooflm/engine/async_engine.py"
_SERVING = "src/rooflm/server/openai_serving.py"
_METRICS = "src/rooflm/server/metrics.py"
_RENDER = "src/rooflm/server/openai_render.py"
_T_ASYNC = "tests/server/test_server_async_engine.py"
_T_FAKE = "tests/server/test_server_api_fake.py"
_T_BEHAVIOUR = "tests/engine/test_engine_behaviour.py"
_SCHED = "src/rooflm/engine/scheduler.py"
_T_SCHED = "tests/unit/test_scheduler.py"
_POLICY = "src/rooflm/engine/policy.py"
_T_POLICY = "tests/unit/test_scheduling_policies.py"

MUTANTS: list[Mutant] = [
    Mutant(
        "budget-grows", _SCHED,
        "                chosen[req.request_id] = num_new\n                budget -= num_new\n                i += 1",
        "                chosen[req.request_id] = num_new\n                budget += num_new\n                i += 1",
        (f"{_T_SCHED}::test_budget_is_never_exceeded_over_a_mixed_run",
         f"{_T_SCHED}::test_running_requests_come_first_then_fcfs_admission_under_one_budget"),
        "running requests add their tokens to the step's budget instead of taking them from it",
    ),
    Mutant(
        "running-ignores-budget", _SCHED,
        "            num_new = granted = self._limit(req, min(req.num_tokens - req.num_computed_tokens, budget))\n"
        "            if req.spec_token_ids",
        "            num_new = granted = self._limit(req, req.num_tokens - req.num_computed_tokens)\n"
        "            if req.spec_token_ids",
        (f"{_T_SCHED}::test_a_long_prompt_is_split_into_budget_sized_chunks",),
        "a running request's next chunk ignores the token budget",
    ),
    Mutant(
        "admission-ignores-budget", _SCHED,
        "            num_new = self._limit(req, min(req.num_tokens - num_cached, budget))",
        "            num_new = self._limit(req, req.num_tokens - num_cached)",
        (f"{_T_SCHED}::test_a_long_prompt_is_split_into_budget_sized_chunks",
         f"{_T_SCHED}::test_budget_is_never_exceeded_over_a_mixed_run"),
        "an admitted prompt is not chunked to the step's remaining budget",
    ),
    Mutant(
        "max-num-seqs-off-by-one", _SCHED,
        "len(self.running) < self.config.max_num_seqs:",
        "len(self.running) <= self.config.max_num_seqs:",
        (f"{_T_SCHED}::test_max_num_seqs_caps_the_running_set",),
        "one more request than max_num_seqs is admitted",
    ),
    Mutant(
        "placeholder-not-counted", _SCHED,
        "                sampling.append(rid)\n                req.num_output_placeholders += 1",
        "                sampling.append(rid)",
        (f"{_T_SCHED}::test_async_one_step_lag_uses_placeholders",
         "tests/engine/test_async_scheduling.py::test_async_equals_sync"),
        "a scheduled sample holds no placeholder, so asynchronous scheduling cannot schedule the next decode",
    ),
    Mutant(
        "finished-request-kept", _SCHED,
        "        req.finish_reason, req.stop_reason = reason, stop_reason\n        self.requests.pop(req.request_id, None)",
        "        req.finish_reason, req.stop_reason = reason, stop_reason",
        (f"{_T_SCHED}::test_tokens_of_a_request_finished_while_in_flight_are_dropped",),
        "a finished request stays known, so a token sampled for it in a step still in flight reaches the output",
    ),
    Mutant(
        "spec-accepts-every-draft", "src/rooflm/spec_decode/rejection.py",
        "    accept = x == argmax[:, :k_max]",
        "    accept = x == x",
        ("tests/unit/test_spec_decode.py::test_greedy_verification_keeps_the_matching_prefix_and_the_targets_token",
         "tests/engine/test_spec_decode.py::test_greedy_speculation_equals_plain_decoding"),
        "greedy verification keeps every draft token, whatever the model predicts",
    ),
    Mutant(
        "spec-no-rollback", _SCHED,
        "                req.num_computed_tokens -= len(spec) + 1 - len(tokens)\n",
        "",
        ("tests/unit/test_spec_decode.py::test_scheduler_schedules_drafts_and_rolls_back_rejected_positions",),
        "positions of rejected draft tokens are not recomputed (their KV holds tokens that were not kept)",
    ),
    Mutant(
        "no-abort-on-cancel", _ASYNC,
        "            if not finished:\n                self.abort(stream.request_id)",
        "            if not finished:\n                pass",
        (f"{_T_ASYNC}::test_cancelled_consumer_aborts_the_request",
         f"{_T_ASYNC}::test_closing_the_generator_aborts_the_request",
         f"{_T_BEHAVIOUR}::test_consumer_going_away_aborts_and_frees_the_blocks"),
        "a consumer that is cancelled or closes its stream early no longer aborts its request",
    ),
    Mutant(
        "abort-command-dropped", _ASYNC,
        "                    self.engine.abort_request(cmd.request_id)",
        "                    pass",
        (f"{_T_ASYNC}::test_cancelled_consumer_aborts_the_request",
         f"{_T_FAKE}::test_client_disconnect_mid_stream_aborts_the_engine_request"),
        "the engine thread takes an abort off the queue but never tells the engine",
    ),
    Mutant(
        "admission-off", _ASYNC,
        "                if would_wait > self.max_waiting:",
        "                if False:",
        (f"{_T_ASYNC}::test_full_waiting_queue_raises_queue_full_at_once",
         f"{_T_FAKE}::test_full_waiting_queue_is_503_at_once"),
        "a full waiting queue admits the request instead of refusing it (no 503)",
    ),
    Mutant(
        "abort-keeps-admission-slot", _ASYNC,
        "                    logger.exception(\"abort_request(%s) failed\", cmd.request_id)\n"
        "                self._release(stream)",
        "                    logger.exception(\"abort_request(%s) failed\", cmd.request_id)",
        (f"{_T_ASYNC}::test_full_waiting_queue_raises_queue_full_at_once",),
        "an aborted request keeps its admission slot, so the server refuses more and more requests",
    ),
    Mutant(
        "cancelled-add-taken", _ASYNC,
        "                if not cmd.done.set_running_or_notify_cancel():  # the caller gave up waiting: don't add it",
        "                if cmd.done.set_running_or_notify_cancel() and False:",
        (f"{_T_ASYNC}::test_caller_cancelled_before_the_add_was_taken_leaves_the_engine_healthy",),
        "the engine thread adds a request whose caller already gave up waiting for it",
    ),
    Mutant(
        "stop-not-passed-to-engine", "src/rooflm/server/openai_prepare.py",
        "                stop=body.stop,",
        "                stop=None,",
        (f"{_T_FAKE}::test_stop_strings_reach_the_engine_and_its_stop_reason_the_response",),
        "the server drops the request's stop strings",
    ),
    Mutant(
        "completion-logprobs-worst-first", _RENDER,
        "top.append({self.token_text(t): _finite(lp) for t, lp in _top(d, k)})",
        "top.append({self.token_text(t): _finite(lp) for t, lp in sorted(d.items(), key=lambda kv: kv[1])[:k]})",
        (f"{_T_FAKE}::test_completion_logprobs_render_the_engines_values",),
        "/v1/completions reports the k least likely tokens as top_logprobs",
    ),
    Mutant(
        "chat-logprob-of-wrong-token", _RENDER,
        '"logprob": _finite(d.get(tid, _MIN_LOGPROB))',
        '"logprob": _finite(max(d.values(), default=_MIN_LOGPROB))',
        (f"{_T_FAKE}::test_chat_logprobs_render_the_engines_values",),
        "/v1/chat/completions reports the best logprob instead of the sampled token's",
    ),
    Mutant(
        "no-retry-after", _SERVING,
        'code="queue_full", headers={"Retry-After": "1"}',
        'code="queue_full", headers={}',
        (f"{_T_FAKE}::test_full_waiting_queue_is_503_at_once",),
        "a 503 for a full queue carries no Retry-After header",
    ),
    Mutant(
        "e2e-latency-not-observed", _METRICS,
        "        self.metrics.e2e.observe(end - self.arrival)\n",
        "",
        (f"{_T_FAKE}::test_metrics_count_known_traffic_exactly",),
        "successful requests add no sample to the end-to-end latency histogram",
    ),
    Mutant(
        "prompt-counter-exports-hits", _METRICS,
        '"Prompt tokens computed (prefix-cache hits excluded).",\n                      s.prompt_tokens_total)',
        '"Prompt tokens computed (prefix-cache hits excluded).",\n                      s.prefix_queries - 1)',
        (f"{_T_FAKE}::test_metrics_count_known_traffic_exactly",),
        "/metrics exports another number as rooflm_prompt_tokens_total",
    ),
    Mutant(
        "stop-prefix-streamed", "src/rooflm/engine/detokenizer.py",
        "        if self.finished or not self.stop_strings:\n            return 0",
        "        if True:\n            return 0",
        (f"{_T_BEHAVIOUR}::test_stop_string_across_tokens_is_never_streamed",),
        "text that may be the start of a stop string is streamed instead of held back",
    ),
    Mutant(
        "logprobs-after-temperature", "src/rooflm/layers/sampler.py",
        "raw_logprobs = torch.log_softmax(logits, dim=-1) if md.return_logprobs else None",
        "raw_logprobs = torch.log_softmax(logits / 0.8, dim=-1) if md.return_logprobs else None",
        ("tests/engine/test_generation.py::test_logprobs_equal_transformers",),
        "logprobs come from a temperature-scaled distribution instead of the model's",
    ),
    Mutant(
        "priority-victim-earliest", _POLICY,
        "    def victim(self, running: Sequence[\"Request\"]) -> \"Request\":\n        return max(running, key=self.key)",
        "    def victim(self, running: Sequence[\"Request\"]) -> \"Request\":\n        return min(running, key=self.key)",
        (f"{_T_POLICY}::test_priority_preempts_the_lowest_priority_latest_arrival",
         f"{_T_POLICY}::test_priority_never_preempts_a_higher_priority_request_for_a_lower_one"),
        "the priority policy preempts its most important running request instead of its least important",
    ),
    Mutant(
        "priority-preempts-equals", _POLICY,
        "        return self.key(candidate)[0] < self.key(victim)[0]",
        "        return self.key(candidate)[0] <= self.key(victim)[0]",
        (f"{_T_POLICY}::test_a_waiting_higher_priority_request_preempts_when_the_batch_is_full",),
        "a waiting request preempts a running one of the same priority",
    ),
    Mutant(
        "no-admission-preemption", _SCHED,
        "        return victim if self.policy.outranks(candidate, victim) else None",
        "        return None",
        (f"{_T_POLICY}::test_a_waiting_higher_priority_request_preempts_when_the_batch_is_full",
         f"{_T_POLICY}::test_a_waiting_higher_priority_request_preempts_when_the_pool_is_short",
         f"{_T_POLICY}::test_mlfq_a_new_short_request_preempts_a_demoted_one"),
        "a waiting request of a higher class never preempts a running one to be admitted",
    ),
    Mutant(
        "mlfq-no-demotion", _POLICY,
        "                self.level[rid] += 1",
        "                self.level[rid] += 0",
        (f"{_T_POLICY}::test_mlfq_demotes_after_each_levels_quantum_of_generated_tokens",
         f"{_T_POLICY}::test_mlfq_a_new_short_request_preempts_a_demoted_one"),
        "MLFQ never demotes a request that used up its level's quantum",
    ),
    Mutant(
        "mlfq-no-skip-join", _POLICY,
        "            level, limit = level + 1, limit * 2",
        "            level, limit = level, limit * 2",
        (f"{_T_POLICY}::test_mlfq_skip_join_picks_the_first_level_from_the_prompt_length",
         f"{_T_POLICY}::test_mlfq_long_prompt_joins_lower_and_waits_for_short_ones"),
        "MLFQ puts every request in the top level whatever its prompt length",
    ),
    Mutant(
        "mlfq-no-starvation-guard", _POLICY,
        "            if self.waited[rid] >= self.starvation_steps:  # the starvation guard",
        "            if False:",
        (f"{_T_POLICY}::test_mlfq_starvation_guard_promotes_after_waiting_steps",),
        "a request waiting in a low MLFQ level is never promoted",
    ),
    Mutant(
        "fair-serves-the-richest", _POLICY,
        "        return min(waiting, key=lambda r: (self.counters[self.client(r)], r.arrival_index))",
        "        return max(waiting, key=lambda r: (self.counters[self.client(r)], -r.arrival_index))",
        (f"{_T_POLICY}::test_fair_alternates_clients_by_their_virtual_token_counters",),
        "the fair policy admits the client with the largest counter",
    ),
    Mutant(
        "fair-no-lift", _POLICY,
        "        if u not in queued:  # the client becomes active",
        "        if False:  # the client becomes active",
        (f"{_T_POLICY}::test_fair_lifts_a_newly_active_clients_counter",),
        "a client that becomes active keeps the credit of its idle time",
    ),
    Mutant(
        "fair-output-free", _POLICY,
        "            self.counters[self.client(req)] += self.w_out * (generated - done)",
        "            self.counters[self.client(req)] += 0",
        (f"{_T_POLICY}::test_fair_counters_are_the_weighted_service_each_client_received",
         f"{_T_POLICY}::test_fair_alternates_clients_by_their_virtual_token_counters"),
        "generated tokens are not charged to the client's virtual token counter",
    ),
]


# ---------------------------------------------------------------------------------------------------------- logic
def check_snippet(root: Path, mutant: Mutant) -> str:
    """The file's text; StaleMutantError unless the original snippet occurs exactly once."""
    path = root / mutant.file
    if not path.is_file():
        raise StaleMutantError(f"mutant {mutant.name!r}: file {mutant.file!r} does not exist")
    text = path.read_text()
    count = text.count(mutant.original)
    if count != 1:
        raise StaleMutantError(f"mutant {mutant.name!r}: its snippet occurs {count} times in {mutant.file} "
                               f"(expected exactly once); update the mutant:\n{mutant.original}")
    return text


def run_tests(root: Path, tests: Sequence[str], python: str, timeout: float) -> tuple[int | None, str]:
    """Run pytest on ``tests`` in ``root`` with ``root/src`` first on the path; (exit code or None on timeout,
    the output's tail)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    return p.returncode, (p.stdout + p.stderr)[-2000:]


def run_mutant(root: Path, mutant: Mutant, python: str, timeout: float) -> Result:
    """Patch ``root`` (a copy), run the mutant's tests, restore the file whatever happens."""
    text = check_snippet(root, mutant)
    path = root / mutant.file
    path.write_text(text.replace(mutant.original, mutant.mutated, 1))
    try:
        code, out = run_tests(root, mutant.tests, python, timeout)
    finally:
        path.write_text(text)
    if code is None:
        return Result(mutant, CAUGHT, out)  # the tests hang on the mutant: they do notice it
    if code == 0:
        return Result(mutant, SURVIVED, out)
    if code in (1, 2):  # tests failed, or collection failed because of the mutant
        return Result(mutant, CAUGHT, out)
    return Result(mutant, ERROR, f"pytest exit {code} (a test id not found?)\n{out}")


def run_all(mutants: Sequence[Mutant], root: Path = ROOT, python: str = sys.executable, timeout: float = 900,
            baseline: bool = True, log=print) -> list[Result]:
    """Check every snippet first (StaleMutantError), then run each mutant on a temporary copy of ``root``.
    With ``baseline``, the named tests must pass on the unchanged copy (else RuntimeError)."""
    for m in mutants:
        check_snippet(root, m)
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(root, copy, ignore=_COPY_IGNORE)
        if baseline:
            tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
            log(f"baseline: {len(tests)} tests on the unchanged code ...")
            code, out = run_tests(copy, tests, python, timeout)
            if code != 0:
                raise RuntimeError(f"the named tests do not pass without any mutation (exit {code}):\n{out}")
        results = []
        for m in mutants:
            r = run_mutant(copy, m, python, timeout)
            log(f"{r.status:8} {m.name}: {m.description}")
            if r.status != CAUGHT:
                log("         " + r.detail.strip().replace("\n", "\n         ")[-1500:])
            results.append(r)
    return results


# ---------------------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None, mutants: Sequence[Mutant] = MUTANTS, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (a hang counts as caught)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run on the unchanged code")
    args = ap.parse_args(argv)
    by_name = {m.name: m for m in mutants}
    unknown = [n for n in args.only if n not in by_name]
    if unknown:
        print(f"unknown mutant(s): {', '.join(unknown)}; known: {', '.join(by_name)}", file=sys.stderr)
        return 2
    chosen = [by_name[n] for n in args.only] if args.only else list(mutants)
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.description} [{m.file}]")
        return 0
    try:
        results = run_all(chosen, root, args.python, args.timeout, baseline=not args.no_baseline)
    except (StaleMutantError, RuntimeError) as e:
        print(f"mutation check refused: {e}", file=sys.stderr)
        return 2
    survived = [r.mutant.name for r in results if r.status != CAUGHT]
    print(f"{len(results) - len(survived)}/{len(results)} mutants caught"
          + (f"; not caught: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
