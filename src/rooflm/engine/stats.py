"""Engine counters and gauges, read by the demo report, the server's /metrics and the benchmarks."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int = 0  # sequences holding KV blocks
    num_waiting: int = 0  # sequences waiting for admission (incl. preempted ones)
    kv_usage: float = 0.0  # fraction of KV blocks in use (ref_cnt > 0)
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    peak_blocks_used: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    prompt_tokens_total: int = 0  # prompt tokens computed (prefix hits excluded)
    generation_tokens_total: int = 0
    num_steps: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
