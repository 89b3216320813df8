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
    # The prefix cache's host tier (kv_offload_gb): prompt tokens restored from host memory instead of computed, full
    # prompt blocks' tokens that missed on the device and the host, blocks in host memory, bytes copied each way.
    host_cache_enabled: bool = False
    host_cache_hits: int = 0
    host_cache_misses: int = 0
    host_cache_blocks: int = 0
    host_cache_bytes_offloaded: int = 0
    host_cache_bytes_restored: int = 0
    prompt_tokens_total: int = 0  # prompt tokens computed (prefix hits excluded)
    generation_tokens_total: int = 0
    num_steps: int = 0
    # Speculative decoding: draft tokens verified, of those accepted, and verifications (one per request and step).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    spec_steps_disabled: int = 0  # steps in which the roofline predicted no gain, so nothing was proposed
    # The live roofline (rooflm.roofline.live.LiveRoofline.fill_stats); the defaults mean "not measured".
    roofline_fraction: float | None = None  # Σ best possible step time / Σ measured step time
    roofline_last_fraction: float | None = None  # of the latest step
    roofline_steps: int = 0  # steps observed
    roofline_predicted_s: float = 0.0  # Σ best possible step time
    roofline_measured_s: float = 0.0  # Σ measured step time
    roofline_fraction_sum: float = 0.0  # Σ per-step fractions (the histogram's sum)
    roofline_bucket_bounds: tuple[float, ...] = ()  # upper bounds of the per-step fraction buckets, the last +inf
    roofline_bucket_counts: tuple[int, ...] = ()  # steps per bucket (not cumulative)
    roofline_hardware: str | None = None  # the ceilings, e.g. "NVIDIA H200 measured: 4.2 TB/s, 760 TFLOP/s"

    def fill_host_tier(self, tier) -> None:
        """Copy the counters of a ``rooflm.kv_cache.host_tier.HostPrefixTier``."""
        st = tier.stats
        self.host_cache_enabled = True
        self.host_cache_hits, self.host_cache_misses = st.hit_tokens, st.miss_tokens
        self.host_cache_blocks = tier.num_cached_blocks
        self.host_cache_bytes_offloaded, self.host_cache_bytes_restored = st.bytes_offloaded, st.bytes_restored

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens produced per verification: the accepted drafts plus the target's own token."""
        return 1 + self.spec_accepted_tokens / self.spec_verifications if self.spec_verifications else None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
