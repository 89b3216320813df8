"""``rooflm bench multiturn``: each turn's prompt is the conversation so far plus the new user text, users run
interleaved in a closed loop, and the host tier restores the prefixes a quarter-sized pool could not keep."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rooflm.bench.multiturn import make_conversations, pool_blocks, run_trace
from rooflm.cli import main


class _FakeEngine:
    """Answers each request with the last two prompt tokens plus one, one request finishing per step (the latest
    added first), and records every prompt."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, list[int]]] = []
        self.prompts: dict[str, list[int]] = {}
        self.steps = 0
        self.max_pending = 0

    def add_request(self, rid, prompt, params):
        self.prompts[rid] = list(prompt)
        self.pending.append((rid, list(prompt)))
        self.max_pending = max(self.max_pending, len(self.pending))

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def get_stats(self):
        return SimpleNamespace(prompt_tokens_total=0, prefix_hits=0, host_cache_hits=0, num_preemptions=0)

    def step(self):
        self.steps += 1
        rid, prompt = self.pending.pop()
        metrics = SimpleNamespace(arrival_time=0.0, first_token_time=0.5)
        return [SimpleNamespace(request_id=rid, finished=True, metrics=metrics,
                                outputs=[SimpleNamespace(token_ids=[prompt[-2] + 1, prompt[-1] + 1])])]


@pytest.mark.parametrize("concurrency", [0, 1, 2])
def test_each_turn_extends_the_conversation(concurrency):
    convs = make_conversations(3, 4, 5, vocab_size=1000, seed=1)
    engine = _FakeEngine()
    r = run_trace(engine, convs, output_len=2, max_concurrency=concurrency)
    assert len(r.ttft_s) == 12 and r.ttft_s == [0.5] * 12
    if concurrency:  # round-robin: every user's turn t before anyone's turn t + 1
        assert list(engine.prompts) == [f"u{u}-t{t}" for t in range(4) for u in range(3)]
        assert engine.max_pending == concurrency
    for u in range(3):
        history: list[int] = []
        for t in range(4):
            history += convs[u][t]
            assert engine.prompts[f"u{u}-t{t}"] == history
            assert r.answers[u][t] == [history[-2] + 1, history[-1] + 1]
            history += r.answers[u][t]


def test_conversations_and_pool_size():
    convs = make_conversations(4, 2, 7, vocab_size=500, seed=3)
    assert [len(c) for c in convs] == [2] * 4 and all(len(t) == 7 for c in convs for t in c)
    assert all(100 <= tok < 400 for c in convs for t in c for tok in t)
    assert convs != make_conversations(4, 2, 7, vocab_size=500, seed=4)
    # 8 users x 4 turns x 160 tokens: a quarter is 1280 tokens, 80 blocks of 16
    assert pool_blocks(8, 4, 128, 32, 16, 0.25) == 1280 // 16
    # 2 users x 1 turn x 40 tokens: a quarter (20 tokens) is less than one conversation (3 blocks) plus one
    assert pool_blocks(2, 1, 32, 8, 16, 0.25) == 4
    with pytest.raises(ValueError, match="pool_fraction"):
        pool_blocks(2, 1, 32, 8, 16, 0)


def test_bench_multiturn_with_and_without_host_tier(tmp_path):
    out = tmp_path / "mt.json"
    assert main(["bench", "multiturn", "--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu",
                 "--dtype", "float32", "--num-users", "4", "--num-turns", "3", "--input-len", "32",
                 "--output-len", "4", "--max-concurrency", "2", "--kv-offload-gb", "0,auto", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["working_set_tokens"] == 4 * 3 * 36 and d["pool_blocks"] == pool_blocks(4, 3, 32, 4, 16, 0.25)
    base, host = d["runs"]
    assert base["kv_offload_gb"] == 0 and host["kv_offload_gb"] > 0
    assert base["host_hit_tokens"] == 0 and host["host_hit_tokens"] > 0
    assert host["prompt_tokens_computed"] < base["prompt_tokens_computed"]
    assert base["mean_ttft_ms"] > 0 and host["mean_ttft_ms"] > 0
