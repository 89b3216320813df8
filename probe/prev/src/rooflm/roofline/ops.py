"""Counting: OPs and bytes of every operator of one forward pass, per GPU. Pure arithmetic, no device.

Notation (per GPU, after tensor-parallel sharding): b batch, q tokens per sequence in this pass (prefill: the prompt
length s; decode: 1), T = b·q tokens, L keys attended (prefill: s; decode: min(context, window)), h hidden, I
intermediate (÷tp; whole under expert parallelism), H query heads (÷tp), Hk KV heads (÷tp, at least 1), d head_dim,
V vocab (÷tp), E experts (E/ep on each GPU under expert parallelism, ep = tp), k experts per token. Byte sizes: a activation, w weight, kv KV cache, hp the un-quantized float (embeddings, lm_head,
norms, router, biases). A multiply-accumulate counts 2 OPs. Every formula below is per operator, per layer."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rooflm.roofline.precision import Precision

if TYPE_CHECKING:
    from rooflm.config import ModelConfig

STAGES = ("prefill", "decode")
LOGITS_MODES = ("all", "last")
NORM_OPS_PER_ELEMENT = 7  # RMSNorm as Yuan et al. 2024 counts it: square, sum, mean, +eps, rsqrt, scale, ·weight
SOFTMAX_OPS_PER_ELEMENT = 5  # max, subtract, exp, sum, divide
ACT_OPS_PER_ELEMENT = 4  # silu(g)·u = g / (1 + exp(-g)) · u: exp, add, divide, multiply
ROTARY_OPS_PER_ELEMENT = 3  # x·cos + rotate_half(x)·sin: 2 multiplies, 1 add


@dataclass(frozen=True)
class Counting:
    """Choices that change what is counted.

    flash_attention: one fused attention operator (Q, K, V read once, O written once; the causal half skipped in
        prefill) instead of qk_matmul / softmax / sv_matmul with the full score matrix in memory.
    prefill_logits: "all" computes lm_head for every prompt token (Hugging Face transformers); "last" only for the
        last token of each sequence (vLLM, rooflm's engine).
    llm_viewer_elementwise: count norms without loading their weight and residual adds with one input, as LLM-Viewer
        and Table 1 of Yuan et al. 2024 do (only for reproducing Table 1; both are undercounts)."""

    flash_attention: bool = False
    prefill_logits: str = "all"
    llm_viewer_elementwise: bool = False

    def __post_init__(self) -> None:
        if self.prefill_logits not in LOGITS_MODES:
            raise ValueError(f"prefill_logits={self.prefill_logits!r} is invalid: expected one of {LOGITS_MODES}")


@dataclass(frozen=True)
class Dims:
    """Per-GPU model dimensions after sharding by ``tp`` (Megatron-style: heads, intermediate and vocab split;
    KV heads replicated when there are fewer than ``tp``). ``ep``: the GPUs a MoE layer's experts are split over,
    whole (expert parallelism: ``tp``, and ``inter`` stays whole), or 1."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    experts: int = 0
    top_k: int = 0
    window: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    tp: int = 1
    full_vocab: int = 0
    ep: int = 1

    @classmethod
    def of(cls, cfg: "ModelConfig", tp: int = 1, expert_parallel: bool = False) -> "Dims":
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp={tp!r} is invalid: expected a positive integer")
        H, Hk, I = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        ep = tp if expert_parallel and cfg.is_moe else 1
        # what the MLP splits: whole experts under expert parallelism, else every expert's intermediate columns
        split, split_name = (cfg.num_local_experts, "num_local_experts") if ep > 1 else (I, "intermediate_size")
        ok = [t for t in range(1, H + 1) if H % t == 0 and split % t == 0 and (Hk % t == 0 or t % Hk == 0)]
        if tp not in ok:
            raise ValueError(f"tp={tp} is invalid for {cfg.name or cfg.architecture}: expected one of {ok} "
                             f"(divides num_attention_heads={H} and {split_name}={split}; "
                             f"divides or is a multiple of num_key_value_heads={Hk})")
        if cfg.is_moe and not 1 <= cfg.num_experts_per_tok <= cfg.num_local_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} is invalid: expected 1.."
                             f"num_local_experts={cfg.num_local_experts}")
        return cls(hidden=cfg.hidden_size, inter=I // (tp // ep), heads=H // tp, kv_heads=max(1, Hk // tp),
                   head_dim=cfg.head_dim, vocab=math.ceil(cfg.vocab_size / tp), layers=cfg.num_hidden_layers,
                   experts=cfg.num_local_experts if cfg.is_moe else 0,
                   top_k=cfg.num_experts_per_tok if cfg.is_moe else 0, window=cfg.sliding_window,
                   tie_embeddings=cfg.tie_word_embeddings, qkv_bias=cfg.attention_bias, tp=tp,
                   full_vocab=cfg.vocab_size, ep=ep)


@dataclass(frozen=True)
class OpCount:
    """What one operator needs (per GPU, one layer). Bytes split by what they are; ``operands`` name the roles of the
    two inputs that set the compute format ("weight", "act", "kv", "high"); ``convert_elems`` elements of the first
    operand are converted to the compute format when their format differs from it (dequantization)."""

    name: str
    kind: str  # "linear" | "attention" | "elementwise" | "lookup" | "comm"
    ops: float
    load_weight: float = 0.0
    load_act: float = 0.0
    load_kv: float = 0.0
    store_act: float = 0.0
    store_kv: float = 0.0
    comm_bytes: float = 0.0  # bytes each GPU sends over the interconnect
    operands: tuple[str, str] = ("act", "act")
    convert_elems: float = 0.0


def causal_pairs(s: int, window: int | None) -> int:
    """(query, key) pairs a causal kernel computes for one head of one sequence of s tokens:
    Σ_{i=1..s} min(i, W) = s(s+1)/2 without a window, W(W+1)/2 + (s-W)·W with a window W < s."""
    if window is None or window >= s:
        return s * (s + 1) // 2
    return window * (window + 1) // 2 + (s - window) * window


def expected_distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected number of experts touched when each of ``tokens`` tokens picks ``top_k`` distinct experts of
    ``experts`` uniformly: E·(1 - (1 - k/E)^T) (an expert is missed by one token with probability 1 - k/E)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


# Past this many (state, choice) pairs per token the busiest rank's count is not computed exactly (see below).
BUSIEST_RANK_MAX_WORK = 200_000


@functools.lru_cache(maxsize=4096)
def expected_busiest_rank_experts(experts: int, top_k: int, tokens: int, ep: int) -> float:
    """Expected number of distinct experts touched on the busiest of ``ep`` ranks that hold ``experts / ep`` whole
    experts each, when each of ``tokens`` tokens picks ``top_k`` distinct experts uniformly.

    Under expert parallelism a MoE layer ends in an all-reduce, so every rank waits for the one that reads the most
    experts: its count, not the average E·(1 - (1 - k/E)^T) / ep, is the layer's critical path. At one token of
    Mixtral (8 experts, top-2) over two ranks the two experts share a rank with probability 3/7, so the busiest rank
    reads 1 + 3/7 experts on average against 1.0 for an even split.

    Exact, by dynamic programming over the touched counts of the ranks (as a multiset: ranks are interchangeable).
    One token moves the state (t_1..t_ep) by n_r new experts on rank r and j = k - sum(n) already touched ones, with
    probability prod_r C(m - t_r, n_r) · C(sum(t), j) / C(E, k) (m = E / ep). Where that would take more than
    ``BUSIEST_RANK_MAX_WORK`` steps per token (many experts and ranks), the even split is returned: a lower bound."""
    if ep <= 1:
        return expected_distinct_experts(experts, top_k, tokens)
    m = experts // ep
    if math.comb(m + ep, ep) * math.comb(top_k + ep, ep) > BUSIEST_RANK_MAX_WORK:
        return expected_distinct_experts(experts, top_k, tokens) / ep
    total = math.comb(experts, top_k)
    dist: dict[tuple[int, ...], float] = {(0,) * ep: 1.0}
    full = (m,) * ep
    for _ in range(tokens):
        nxt: dict[tuple[int, ...], float] = {}
        for state, p in dist.items():
            touched = sum(state)
            for new in _new_per_rank(state, m, top_k):
                j = top_k - sum(new)
                if j > touched:
                    continue
                w = math.comb(touched, j) * math.prod(math.comb(m - t, n) for t, n in zip(state, new))
                key = tuple(sorted(t + n for t, n in zip(state, new)))
                nxt[key] = nxt.get(key, 0.0) + p * w / total
        dist = nxt
        if dist.get(full, 0.0) > 1.0 - 1e-12:  # every expert touched: nothing changes any more
            break
    return sum(p * max(state) for state, p in dist.items())


def _new_per_rank(state: tuple[int, ...], m: int, k: int, i: int = 0):
    """Every (n_1..n_ep) with n_r <= m - t_r and sum <= k: how many new experts a token picks on each rank."""
    if i == len(state):
        yield ()
        return
    for n in range(min(m - state[i], k) + 1):
        for rest in _new_per_rank(state, m, k - n, i + 1):
            yield (n,) + rest


def _linear(name: str, tokens: float, n_in: int, n_out: int, weight_elems: float, p: Precision,
            out_to_kv: bool = False, bias: bool = False, weight_role: str = "weight") -> OpCount:
    """y[tokens, n_out] = x[tokens, n_in] @ W[n_in, n_out] (+ bias): OPs 2·tokens·n_in·n_out (+ tokens·n_out);
    loads W (weight_elems elements) and x; stores y (into the KV cache for v_proj)."""
    wb = p.weight.bytes if weight_role == "weight" else p.high.bytes
    out_bytes = tokens * n_out * (p.kv.bytes if out_to_kv else p.act.bytes)
    return OpCount(
        name, "linear", ops=2 * tokens * n_in * n_out + (tokens * n_out if bias else 0),
        load_weight=weight_elems * wb + (n_out * p.high.bytes if bias else 0),
        load_act=tokens * n_in * p.act.bytes,
        store_act=0.0 if out_to_kv else out_bytes, store_kv=out_bytes if out_to_kv else 0.0,
        operands=(weight_role, "act"), convert_elems=weight_elems)


def _norm(name: str, tokens: float, d: Dims, p: Precision, c: Counting) -> OpCount:
    """RMSNorm: OPs 7·T·h; loads x (T·h·a) and its weight (h·hp); stores T·h·a."""
    return OpCount(name, "elementwise", ops=NORM_OPS_PER_ELEMENT * tokens * d.hidden,
                   load_weight=0.0 if c.llm_viewer_elementwise else d.hidden * p.high.bytes,
                   load_act=tokens * d.hidden * p.act.bytes, store_act=tokens * d.hidden * p.act.bytes)


def _add(name: str, tokens: float, d: Dims, p: Precision, c: Counting) -> OpCount:
    """Residual add: OPs T·h; loads both inputs (2·T·h·a); stores T·h·a."""
    n_in = 1 if c.llm_viewer_elementwise else 2
    return OpCount(name, "elementwise", ops=tokens * d.hidden, load_act=n_in * tokens * d.hidden * p.act.bytes,
                   store_act=tokens * d.hidden * p.act.bytes)


def _allreduce(name: str, tokens: float, d: Dims, p: Precision) -> OpCount:
    """Ring all-reduce of T·h activations over tp GPUs: each GPU sends 2·(tp-1)/tp · T·h·a bytes."""
    size = tokens * d.hidden * p.act.bytes
    return OpCount(name, "comm", ops=0.0, comm_bytes=2 * (d.tp - 1) / d.tp * size)


def keys_read(stage: str, kv_len: int, d: Dims) -> int:
    """Keys (and values) each sequence reads: prefill reads all s (every key is in some query's window);
    decode reads min(context, window) (a sliding-window cache keeps only the last W)."""
    if stage == "prefill" or d.window is None:
        return kv_len
    return min(kv_len, d.window)


def attention_ops(d: Dims, p: Precision, c: Counting, stage: str, batch: int, q_len: int,
                  kv_len: int) -> list[OpCount]:
    """Attention proper (after rotary, before o_proj). GQA: K and V are read once per KV head (Hk), Q and the output
    per query head (H).

    Unfused (Table 1 of Yuan et al. 2024): the score matrix S = b·H·q·L elements (prefill: the full s×s, masked, as Table 1)
      qk_matmul  OPs 2·S·d;  loads Q (T·H·d·a) and K (b·L·Hk·d·kv);  stores S·a
      softmax    OPs 5·S;    loads S·a;  stores S·a
      sv_matmul  OPs 2·S·d;  loads S·a and V (b·L·Hk·d·kv);  stores O (T·H·d·a)
    Fused (flash attention): P = b·H·pairs, pairs = causal_pairs(s, W) in prefill (the masked half skipped), L in decode
      fused_attention  OPs P·(4d + 5);  loads Q (T·H·d·a), K and V (2·b·L·Hk·d·kv) once;  stores O (T·H·d·a)."""
    T = batch * q_len
    L = keys_read(stage, kv_len, d)
    a, kvb, dh = p.act.bytes, p.kv.bytes, d.head_dim
    q_bytes = T * d.heads * dh * a
    kv_elems = batch * L * d.kv_heads * dh  # one of K or V
    out_bytes = T * d.heads * dh * a
    if c.flash_attention:
        pairs = causal_pairs(q_len, d.window) if stage == "prefill" else L
        P = batch * d.heads * pairs
        return [OpCount("fused_attention", "attention", ops=P * (4 * dh + SOFTMAX_OPS_PER_ELEMENT), load_act=q_bytes,
                        load_kv=2 * kv_elems * kvb, store_act=out_bytes, operands=("kv", "act"),
                        convert_elems=2 * kv_elems)]
    S = batch * d.heads * q_len * L
    return [
        OpCount("qk_matmul", "attention", ops=2 * S * dh, load_act=q_bytes, load_kv=kv_elems * kvb,
                store_act=S * a, operands=("kv", "act"), convert_elems=kv_elems),
        OpCount("softmax", "elementwise", ops=SOFTMAX_OPS_PER_ELEMENT * S, load_act=S * a, store_act=S * a),
        OpCount("sv_matmul", "attention", ops=2 * S * dh, load_act=S * a, load_kv=kv_elems * kvb,
                store_act=out_bytes, operands=("kv", "act"), convert_elems=kv_elems),
    ]


def _mlp_ops(d: Dims, p: Precision, tokens: int) -> list[OpCount]:
    """Gated MLP. Dense: gate/up (h -> I), act on T·I elements (not T·h), down (I -> h).
    MoE: router (h -> E, hp weights), each token to k experts (R = T·k routed rows); expert weights loaded for the
    expected number of distinct experts touched; a combine sums the k weighted outputs (OPs 2·R·h). Expert
    parallelism over ep GPUs: the router stays whole; each GPU runs 1/ep of the routed rows, on whole experts, and
    reads the weights of the experts the busiest rank touches (``expected_busiest_rank_experts``: the layer's
    all-reduce waits for that rank)."""
    h, I, a = d.hidden, d.inter, p.act.bytes
    if not d.experts:
        return [
            _linear("gate_proj", tokens, h, I, h * I, p),
            _linear("up_proj", tokens, h, I, h * I, p),
            OpCount("mlp_act", "elementwise", ops=ACT_OPS_PER_ELEMENT * tokens * I, load_act=2 * tokens * I * a,
                    store_act=tokens * I * a),
            _linear("down_proj", tokens, I, h, I * h, p),
        ]
    R = tokens * d.top_k / d.ep
    distinct = expected_busiest_rank_experts(d.experts, d.top_k, int(tokens), d.ep)
    return [
        _linear("router", tokens, h, d.experts, h * d.experts, p, weight_role="high"),
        _linear("gate_proj", R, h, I, distinct * h * I, p),
        _linear("up_proj", R, h, I, distinct * h * I, p),
        OpCount("mlp_act", "elementwise", ops=ACT_OPS_PER_ELEMENT * R * I, load_act=2 * R * I * a,
                store_act=R * I * a),
        _linear("down_proj", R, I, h, distinct * I * h, p),
        OpCount("expert_combine", "elementwise", ops=2 * R * h, load_act=R * h * a, store_act=tokens * h * a),
    ]


def block_ops(d: Dims, p: Precision, c: Counting, stage: str, batch: int, q_len: int, kv_len: int) -> list[OpCount]:
    """The operators of one transformer block, in execution order."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is invalid: expected one of {STAGES}")
    T = batch * q_len
    h, H, Hk, dh, a = d.hidden, d.heads, d.kv_heads, d.head_dim, p.act.bytes
    ops = [
        _norm("attn_norm", T, d, p, c),
        _linear("q_proj", T, h, H * dh, h * H * dh, p, bias=d.qkv_bias),
        _linear("k_proj", T, h, Hk * dh, h * Hk * dh, p, bias=d.qkv_bias),
        _linear("v_proj", T, h, Hk * dh, h * Hk * dh, p, out_to_kv=True, bias=d.qkv_bias),
        # rotary on q and k: loads them and the cos/sin rows (T·d·hp), stores q and writes k into the KV cache
        OpCount("rotary", "elementwise", ops=ROTARY_OPS_PER_ELEMENT * T * (H + Hk) * dh,
                load_act=T * (H + Hk) * dh * a + T * dh * p.high.bytes,
                store_act=T * H * dh * a, store_kv=T * Hk * dh * p.kv.bytes),
        *attention_ops(d, p, c, stage, batch, q_len, kv_len),
        _linear("o_proj", T, H * dh, h, H * dh * h, p),
    ]
    if d.tp > 1:
        ops.append(_allreduce("attn_allreduce", T, d, p))
    ops += [_add("attn_add", T, d, p, c), _norm("mlp_norm", T, d, p, c), *_mlp_ops(d, p, T)]
    if d.tp > 1:
        ops.append(_allreduce("mlp_allreduce", T, d, p))
    ops.append(_add("mlp_add", T, d, p, c))
    return ops


def model_ops(d: Dims, p: Precision, c: Counting, stage: str, batch: int, q_len: int) -> list[OpCount]:
    """Model-level operators, once per pass: embedding lookup, final norm, lm_head (and TP collectives).
    lm_head: OPs 2·N·h·V for N = T tokens (prefill with prefill_logits="all") or b (decode, or "last");
    loads its h·V weights (hp) and N·h·a; stores N·V·a logits."""
    T = batch * q_len
    n_logits = T if (stage == "prefill" and c.prefill_logits == "all") else batch
    h, a = d.hidden, p.act.bytes
    ops = [OpCount("embedding", "lookup", ops=0.0, load_weight=T * h * p.high.bytes, store_act=T * h * a)]
    if d.tp > 1:  # vocab-parallel embedding: each GPU fills its rows, then an all-reduce
        ops.append(_allreduce("embed_allreduce", T, d, p))
    ops += [_norm("final_norm", T, d, p, c), _linear("lm_head", n_logits, h, d.vocab, h * d.vocab, p,
                                                      weight_role="high")]
    if d.tp > 1:  # all-gather of the vocab shards: each GPU receives (tp-1)/tp of N·V·a
        ops.append(OpCount("logits_allgather", "comm", ops=0.0,
                           comm_bytes=(d.tp - 1) / d.tp * n_logits * d.full_vocab * a))
    return ops


def weight_bytes(d: Dims, p: Precision) -> dict[str, float]:
    """Bytes of every weight, per GPU: embeddings, lm_head (none when tied), attention and MLP linears (all E experts
    for MoE, E/ep under expert parallelism, plus the router), biases, the 2 norms per layer and the final norm."""
    h, I, H, Hk, dh, n = d.hidden, d.inter, d.heads, d.kv_heads, d.head_dim, d.layers
    w, hp = p.weight.bytes, p.high.bytes
    attn = n * (h * H * dh + 2 * h * Hk * dh + H * dh * h) * w
    if d.qkv_bias:
        attn += n * (H + 2 * Hk) * dh * hp
    mlp = n * 3 * h * I * w * max(1, d.experts // d.ep) + (n * h * d.experts * hp if d.experts else 0)
    emb = d.vocab * h * hp
    return {"embedding": emb, "lm_head": 0.0 if d.tie_embeddings else emb, "attention": attn, "mlp": mlp,
            "norms": (2 * n + 1) * h * hp}


def kv_cache_bytes(d: Dims, p: Precision, batch: int, tokens: int) -> float:
    """KV cache per GPU: b · min(tokens, W) · layers · 2 (K and V) · Hk · d · kv bytes."""
    kept = tokens if d.window is None else min(tokens, d.window)
    return batch * kept * d.layers * 2 * d.kv_heads * d.head_dim * p.kv.bytes
