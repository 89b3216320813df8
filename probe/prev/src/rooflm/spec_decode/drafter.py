"""Model-based drafts, proposed in the model runner right after each step (vLLM v1's place for a drafter): the draft
continues from the tokens the step just produced, and its k tokens go back with the step's output to be scheduled
and verified in the next step.

Two drafts share this code:
- ``draft_model``: a smaller model with the target's vocabulary (Leviathan et al. 2023; Chen et al. 2023). It has its
  own paged KV pool, shaped for its own layers and heads but indexed by the *same* block tables as the target's, so
  the target's block manager serves both. The draft runs every step's scheduled tokens too (``mirror``), so its cache
  holds exactly the positions the target's holds: chunked prefill, prefix-cache hits (a cached block was filled by
  both models in the step that filled it) and recomputation after preemption need nothing of their own.
- ``self``: the target's first ``num_draft_layers`` layers, its final norm and its LM head (Draft & Verify, Zhang et
  al. 2023; LayerSkip, Elhoushi et al. 2024). It reads and writes the target's own cache for those layers; the verify
  step recomputes every position the draft wrote (from the last accepted token on) in all layers before attention
  reads it, and the drafted positions never lie in a block the prefix cache holds.

Drafting writes KV at the positions p0 .. p0 + k - 1 (p0: the first position the target has not computed). The
scheduler allocates k lookahead slots beyond each sampling step for them; those positions are recomputed by the next
step, so a rejected draft's KV is simply overwritten, and nothing is freed or rolled back here.

Greedy requests draft the draft's argmax. Sampled requests draw from the draft's distribution q (the same temperature,
min-p, top-k and top-p as the request) and keep q for the rejection sampler (``rejection.verify``), which then keeps
every output token distributed exactly as the target's. Seeded requests draw from their own generator.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rooflm.attention.kv_quant import allocate_kv_cache, kv_bytes_per_token_head
from rooflm.attention.metadata_utils import build_attention_metadata
from rooflm.config import ModelConfig
from rooflm.layers.sampler import SamplingMetadata, argmax_tokens, target_probs
from rooflm.sampling_params import SamplingParams
from rooflm.spec_decode.config import SpeculativeConfig


def draftable(params: SamplingParams) -> bool:
    """Requests whose drafts the verifier can decide (the proposer's ``eligible`` without the per-step state)."""
    p = params
    return (p.logprobs is None and p.prompt_logprobs is None and p.repetition_penalty == 1
            and p.presence_penalty == 0 and p.frequency_penalty == 0 and not getattr(p, "logit_bias", None))


def load_draft_model(spec: SpeculativeConfig, target_cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                     quantization: str | None, ops: str = "auto", attn_backend: str = "auto",
                     seed: int = 0) -> tuple[nn.Module, ModelConfig]:
    """Load ``spec.model`` and check that it can draft for the target (same vocabulary size)."""
    from rooflm.loader import load_model

    model, cfg = load_model(spec.model, load_format=spec.load_format, dtype=dtype, device=device,
                            attn_backend=attn_backend, ops=ops, seed=seed, show_progress=False,
                            quantization=quantization)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative_config.model={spec.model!r} has vocab_size={cfg.vocab_size}, the target "
                         f"{target_cfg.vocab_size}: a draft model must share the target's vocabulary")
    return model.eval(), cfg


def draft_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """The draft model's K and V for one block of every layer (its pool has as many blocks as the target's)."""
    return cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * kv_bytes_per_token_head(
        cfg.head_dim, dtype, kv_cache_dtype)


def early_exit_forward(model: nn.Module, num_layers: int) -> Callable:
    """The forward pass of ``model``'s first ``num_layers`` layers followed by its final norm (a Llama-like model:
    ``model.model`` with ``embed_tokens``, ``rotary_emb``, ``layers`` and ``norm``)."""
    inner = model.model

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta) -> torch.Tensor:
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(inner.layers[:num_layers], kv_caches[:num_layers], strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        hidden, _ = inner.norm(hidden, residual)
        return hidden

    return forward


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights, packed quantized ones (buffers) included: what a decode step reads."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def decode_weight_bytes(model: nn.Module, num_layers: int | None = None) -> int:
    """The weight bytes a decode step of ``model`` (its first ``num_layers`` layers) reads: the layers, the final
    norm and the LM head; the embedding contributes one row per token."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return weight_bytes(model)
    layers = list(inner.layers)[:num_layers]
    return sum(weight_bytes(m) for m in layers) + weight_bytes(inner.norm) + weight_bytes(model.lm_head)


@dataclass
class DraftRequest:
    """One request to draft for: its persistent row, the position of its newest token (not yet in the cache),
    its block table, sampling parameters and generator, and the most drafts it can use (its remaining max_tokens)."""

    req_id: str
    row: int
    position: int
    block_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    max_drafts: int | None = None


class Drafter:
    def __init__(self, spec: SpeculativeConfig, target: nn.Module, target_cfg: ModelConfig,
                 target_caches: list, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, kv_cache_dtype: str = "auto",
                 draft: tuple[nn.Module, ModelConfig] | None = None) -> None:
        self.k = spec.num_speculative_tokens
        self.method = spec.method
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.enabled = True  # the engine turns drafting off for steps whose drafts would not be verified
        if spec.method == "self":
            n = spec.num_draft_layers or max(1, target_cfg.num_hidden_layers // 2)
            if n >= target_cfg.num_hidden_layers:
                raise ValueError(f"speculative_config.num_draft_layers={n} must be below the target's "
                                 f"{target_cfg.num_hidden_layers} layers")
            if not all(hasattr(getattr(target, "model", None), a) for a in ("embed_tokens", "layers", "norm")):
                raise ValueError(f"speculative_config.method='self' needs a Llama-like model, not "
                                 f"{type(target).__name__}")
            self.num_draft_layers = n
            self.forward = early_exit_forward(target, n)
            self.compute_logits = target.compute_logits
            self.kv_caches = target_caches[:n]  # shared: the target's own cache for those layers
            self.owns_cache = False
            # Decode reads every weight once: a draft step reads its layers and the whole LM head.
            self.cost_fraction = decode_weight_bytes(target, n) / max(1, decode_weight_bytes(target))
        elif spec.method == "draft_model":
            if draft is None:
                raise ValueError("speculative_config.method='draft_model' needs a loaded draft model")
            model, cfg = draft
            self.model, self.cfg = model, cfg
            self.forward = model
            self.compute_logits = model.compute_logits
            self.kv_caches = [allocate_kv_cache(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype,
                                                kv_cache_dtype, device) for _ in range(cfg.num_hidden_layers)]
            self.owns_cache = True
            self.cost_fraction = decode_weight_bytes(model) / max(1, decode_weight_bytes(target))
        else:
            raise ValueError(f"speculative_config.method={spec.method!r} has no draft model")
        # req_id -> (draft tokens, their distributions [k_r, V] or None for greedy requests)
        self.pending: dict[str, tuple[list[int], torch.Tensor | None]] = {}

    # -- the target's step ----------------------------------------------------------------------------------------------
    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """Run the draft model over the step's scheduled tokens, so its cache covers what the target's does."""
        if self.owns_cache:
            self.forward(input_ids, positions, self.kv_caches, meta)

    def draft_probs(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        """The distributions the scheduled ``drafts`` were drawn from (None: greedy, or not this drafter's)."""
        tokens, probs = self.pending.get(req_id, ([], None))
        if probs is None or tokens[:len(drafts)] != drafts:
            return None
        return probs[:len(drafts)]

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.pending.pop(rid, None)

    # -- proposing ------------------------------------------------------------------------------------------------------
    def budget(self, position: int, num_blocks: int, max_drafts: int | None = None) -> int:
        """How many tokens a request whose newest token sits at ``position`` may draft: its drafts' KV must fit the
        blocks it holds and the model's length (and no more than ``max_drafts`` are of use)."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        return max(0, min(k, num_blocks * self.block_size - position, self.max_model_len - 1 - position))

    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest], last_token: torch.Tensor) -> dict[str, list[int]]:
        """Up to k draft tokens per request, continuing from ``last_token[row]`` (the token just produced, on the
        device). Runs one batched single-token step of the draft per draft position."""
        self.pending = {}
        reqs = [r for r in reqs if self.budget(r.position, len(r.block_ids), r.max_drafts) >= 1]
        if not reqs or not self.enabled:
            return {}
        limits = [self.budget(r.position, len(r.block_ids), r.max_drafts) for r in reqs]
        greedy = [r.params.greedy or r.params.top_k == 1 for r in reqs]
        rows = torch.tensor([r.row for r in reqs], device=self.device)
        tokens = last_token.index_select(0, rows)
        out: list[tuple[list[int], torch.Tensor]] = []  # per draft position: (active requests, their tokens)
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = list(range(len(reqs)))
        for j in range(max(limits)):
            if j > 0:
                keep = [i for i, a in enumerate(active) if limits[a] > j]
                if len(keep) < len(active):
                    tokens = tokens[torch.tensor(keep, device=self.device)]
                    active = [active[i] for i in keep]
            meta, pos = build_attention_metadata([reqs[a].block_ids for a in active],
                                                 [reqs[a].position + j for a in active], [1] * len(active),
                                                 self.block_size, self.device)
            logits = self.compute_logits(self.forward(tokens, pos, self.kv_caches, meta))  # [n, V] float32
            tokens = self._choose(logits, [reqs[a] for a in active], [greedy[a] for a in active],
                                  [probs[a] for a in active])
            out.append((active, tokens))
        drafts: list[list[int]] = [[] for _ in reqs]
        for active_j, tok in out:
            for a, t in zip(active_j, tok.tolist()):
                drafts[a].append(t)
        result = {}
        for i, r in enumerate(reqs):
            result[r.req_id] = drafts[i]
            self.pending[r.req_id] = (drafts[i], torch.stack(probs[i]) if probs[i] else None)
        return result

    def _choose(self, logits: torch.Tensor, reqs: list[DraftRequest], greedy: list[bool],
                probs_out: list[list[torch.Tensor]]) -> torch.Tensor:
        """Greedy rows: the draft's argmax. Random rows: a draw from q (exponential race, ``argmax(q / E)``), q kept."""
        tokens = argmax_tokens(logits)
        if all(greedy):
            return tokens
        n = len(reqs)
        md = SamplingMetadata.from_params([r.params for r in reqs], [[]] * n, [[]] * n, [None] * n, self.device)
        q = target_probs(logits, md)
        noise = torch.empty_like(q).exponential_()
        for i, r in enumerate(reqs):
            if not greedy[i] and r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        sampled = (q / noise).argmax(dim=-1)
        random_rows = torch.tensor([not g for g in greedy], device=self.device)
        for i, g in enumerate(greedy):
            if not g:
                probs_out[i].append(q[i])
        return torch.where(random_rows, sampled, tokens)
