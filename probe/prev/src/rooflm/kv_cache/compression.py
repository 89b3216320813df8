"""Lossy KV compression, opt-in: a request keeps at most ``budget`` tokens of KV, so it can generate past the pool.

``streaming`` is StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"): keep
the first tokens (the *attention sinks*, which soak up the attention mass a softmax must put somewhere) and a window
of the most recent tokens; drop everything between. Here the cache is paged, so the rule is applied to whole blocks:
the sinks are the first ``ceil(sink / block_size)`` blocks, and when a step would need more than
``budget // block_size`` blocks the oldest blocks after the sinks are freed. The pool stays paged (no block is ever
partly dropped), and a request holds a constant number of blocks however long it runs.

Positions. The paper assigns rotary positions *within the cache* (a token's position is its index among the kept
tokens, so the model never sees a distance larger than the cache), which needs keys stored before rotation and
re-rotated at every step. rooflm's cache stores keys after rotary embedding, so here every token keeps its
original position: queries and new keys are rotated at their true positions, the kept keys keep theirs, and
attention runs over the cache indices (sinks, then the window). Relative distances to the window are the true ones;
distances to the sinks grow with the sequence. ``docs/scheduling.md`` has the perplexity this gives.

Prefix caching. Blocks computed after a drop hold KV of a truncated context, not the full-attention KV the prefix
cache promises, so a compressed request neither registers its blocks nor takes prefix hits. A compressed request
that is preempted is recomputed (never swapped), from its tokens, under the same budget.

``h2o`` is H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference"): keep the most
recent tokens plus the *heavy hitters*, the tokens whose attention scores, accumulated over every step so far, are
largest. Block-granular here too: the last ``ceil(recent / block_size)`` full blocks (and the one being filled) are
kept, and when a step would need more than ``budget // block_size`` blocks the other blocks with the smallest
accumulated score are dropped, wherever they are (``plan_h2o_drop``). A block's score is the attention probability
its tokens received, summed over the step's queries, every head and every layer (the paper keeps heavy hitters per
head; one block table serves every head and layer here, so the score is their sum). The runner computes it
(``rooflm.attention.h2o_scores``) for the requests the scheduler names, and the scheduler accumulates it per block.

Pure Python: ``plan_drop`` and ``plan_h2o_drop`` decide, the scheduler frees the blocks (``KVCacheManager.drop_blocks``) and tells the
runner (``SchedulerOutput.kv_dropped``), which removes them from the request's block table and from then on maps
position ``p`` to cache index ``p - num_dropped_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KVCompressionConfig", "plan_drop", "plan_h2o_drop", "COMPRESSION_METHODS"]

COMPRESSION_METHODS = ("streaming", "h2o")


@dataclass(frozen=True)
class KVCompressionConfig:
    method: str = "streaming"
    budget: int = 1024  # tokens of KV kept per request (whole blocks: rounded down to a multiple of block_size)
    sink: int = 4  # streaming: attention-sink tokens kept at the start (whole blocks: rounded up)
    recent: int | None = None  # h2o: most recent tokens always kept (whole blocks: rounded up); None: half the budget

    def __post_init__(self) -> None:
        if self.method not in COMPRESSION_METHODS:
            raise ValueError(f"kv_compression.method={self.method!r} is invalid: expected one of "
                             f"{COMPRESSION_METHODS}")
        if self.recent is not None and (not isinstance(self.recent, int) or isinstance(self.recent, bool)
                                        or self.recent < 0):
            raise ValueError(f"kv_compression.recent={self.recent!r} is invalid: expected an integer >= 0 or None")
        for name in ("budget", "sink"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "budget" else 0):
                raise ValueError(f"kv_compression.{name}={v!r} is invalid: expected an integer "
                                 f"{'>= 1' if name == 'budget' else '>= 0'}")

    @classmethod
    def parse(cls, value: "KVCompressionConfig | dict[str, Any] | str | None") -> "KVCompressionConfig | None":
        """From a dict, a JSON string (the CLI's ``--kv-compression``) or None (no compression)."""
        from rooflm.config import parse_json_config

        return parse_json_config(cls, value, "kv_compression")

    def sink_blocks(self, block_size: int) -> int:
        return -(-self.sink // block_size)

    def protected_blocks(self, block_size: int) -> int:
        """Blocks never dropped besides the one being filled: the sinks (streaming) or the recent window (h2o)."""
        if self.method == "h2o":
            recent = self.budget // 2 if self.recent is None else self.recent
            return -(-recent // block_size)
        return self.sink_blocks(block_size)

    def budget_blocks(self, block_size: int) -> int:
        return self.budget // block_size

    def check(self, block_size: int) -> None:
        """The budget must hold the protected blocks (sinks, or h2o's recent window) plus two: the one being filled
        and one that can be dropped."""
        if self.budget_blocks(block_size) < self.protected_blocks(block_size) + 2:
            need = (self.protected_blocks(block_size) + 2) * block_size
            what = f"recent={self.recent}" if self.method == "h2o" else f"sink={self.sink}"
            raise ValueError(f"kv_compression.budget={self.budget} is invalid: with block_size={block_size} and "
                             f"{what} it must be at least {need} tokens")

    def max_new_tokens(self, block_size: int) -> int:
        """The most tokens one step may add to a request: what remains once every window block is dropped (a
        partly filled last block may stay)."""
        return (self.budget_blocks(block_size) - self.protected_blocks(block_size) - 1) * block_size


def plan_drop(cfg: KVCompressionConfig, cache_len: int, num_new: int, block_size: int) -> int:
    """How many blocks to drop, starting at table index ``cfg.sink_blocks(block_size)``, so that a request holding
    ``cache_len`` tokens of KV can add ``num_new`` (at most ``cfg.max_new_tokens``) within the budget. Only full
    blocks before the last one are dropped."""
    over = -(-(cache_len + num_new) // block_size) - cfg.budget_blocks(block_size)
    if over <= 0:
        return 0
    droppable = max(0, cache_len // block_size - cfg.sink_blocks(block_size))
    if over > droppable:
        raise ValueError(f"plan_drop: {num_new} new tokens on {cache_len} cached ones cannot fit the budget of "
                         f"{cfg.budget} tokens (at most {cfg.max_new_tokens(block_size)} new tokens a step)")
    return over


def plan_h2o_drop(cfg: KVCompressionConfig, cache_len: int, num_new: int, block_size: int,
                  scores: list[float]) -> list[int]:
    """H2O's choice: the table indices (ascending) of the blocks to drop so that ``num_new`` tokens (at most
    ``cfg.max_new_tokens``) fit the budget on ``cache_len`` cached ones. Candidates are the full blocks before the
    recent window; those with the smallest accumulated attention score go first (the older of equal ones).
    ``scores[i]`` is block ``i``'s score (missing entries count 0)."""
    over = -(-(cache_len + num_new) // block_size) - cfg.budget_blocks(block_size)
    if over <= 0:
        return []
    candidates = max(0, cache_len // block_size - cfg.protected_blocks(block_size))
    if over > candidates:
        raise ValueError(f"plan_h2o_drop: {num_new} new tokens on {cache_len} cached ones cannot fit the budget of "
                         f"{cfg.budget} tokens (at most {cfg.max_new_tokens(block_size)} new tokens a step)")
    order = sorted(range(candidates), key=lambda i: (scores[i] if i < len(scores) else 0.0, i))
    return sorted(order[:over])
