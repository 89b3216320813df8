"""Self-distillation data for Medusa heads (Cai et al. 2024, section 2.3.2): the heads are trained on the frozen
model's own greedy continuations instead of human text.

Why: under greedy decoding a draft token is accepted when it equals the model's argmax, not when it equals what a
person wrote. Human text disagrees with the model's greedy choice at most positions (SmolLM2-135M's own next-token
top-1 on held-out prose is about 37%), so heads trained on it learn a target the verifier never asks for. A greedy
continuation is exactly the sequence the verifier accepts, token for token.

Prompts are windows of the training text; the continuations come from the rooflm engine (``rooflm.LLM``) built
around the already loaded model, all prompts in one batch (continuous batching), temperature 0. Each example keeps
the prompt as context for the hidden states, but only positions t >= P - 1 (P: the prompt's length) are trained:
there every token from t + 1 on is the model's greedy output, which is the situation of a draft at decode time
(head i at t predicts token t + i + 1 after the chain t + 1 .. t + i was accepted, i.e. was greedy). A position inside
the prompt would ask head i for a greedy token that followed human tokens the head never sees accepted.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch import nn

IGNORE = -100  # label of a position that is no target (prompt tokens, padding): F.cross_entropy's ignore_index


@dataclass
class Example:
    """One training or evaluation sequence for the heads: its token ids and ``first``, the first position whose hidden
    state is trained (0 for human text; P - 1 for a prompt of P tokens and its greedy continuation)."""
    ids: list[int]
    first: int = 0

    def labels(self) -> list[int]:
        """The ids from ``first`` on, with positions before ``first + 1`` (the prompt) marked IGNORE: a label is only
        ever a target of an earlier position, and every target kept is a token after the prompt."""
        out = list(self.ids[self.first:])
        if self.first > 0:
            out[0] = IGNORE
        return out


def prompt_windows(ids: list[int], n: int, prompt_len: int, field: str = "self_distill") -> list[list[int]]:
    """``n`` windows of ``prompt_len`` tokens at evenly spaced starts over ``ids`` (overlapping when the text holds
    fewer than ``n`` distinct windows)."""
    if len(ids) < prompt_len:
        raise ValueError(f"MedusaTrainConfig.{field}: the text has {len(ids)} tokens, fewer than one prompt of "
                         f"distill_prompt_len={prompt_len}")
    span = len(ids) - prompt_len
    starts = [0] if n == 1 else [round(i * span / (n - 1)) for i in range(n)]
    return [ids[s:s + prompt_len] for s in starts]


def greedy_continuations(model: nn.Module, cfg, prompts: list[list[int]], max_tokens: int,
                         device: torch.device, dtype: torch.dtype, seed: int = 0) -> list[list[int]]:
    """The model's greedy continuation of each prompt (at most ``max_tokens``; shorter when it ends with EOS), from a
    rooflm engine built around the loaded ``model``: the same batched decode path that serves it. The engine and its
    KV pool are released before returning, so the memory is free for the hidden-state cache."""
    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine
    from rooflm.llm import LLM
    from rooflm.sampling_params import SamplingParams

    longest = max(len(p) for p in prompts) + max_tokens
    config = EngineConfig(device=str(device), dtype=str(dtype).removeprefix("torch."), show_progress=False,
                          seed=seed, max_model_len=longest, max_num_seqs=min(256, len(prompts)),
                          enable_prefix_caching=False)
    llm = LLM.from_engine(LLMEngine(config, model=model, model_config=cfg, tokenizer=None))
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        result = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def distilled_examples(model: nn.Module, cfg, texts: list[tuple[list[int], int, str]], prompt_len: int,
                       max_tokens: int, device: torch.device, dtype: torch.dtype,
                       seed: int = 0) -> list[list[Example]]:
    """For each (text ids, n, config field) of ``texts``: n examples, prompt windows of the text and their greedy
    continuations (``first`` = P - 1). All prompts decode in one batch of one engine."""
    prompts = [prompt_windows(ids, n, prompt_len, field) for ids, n, field in texts]
    flat = [p for group in prompts for p in group]
    conts = iter(greedy_continuations(model, cfg, flat, max_tokens, device, dtype, seed))
    return [[Example(p + next(conts), len(p) - 1) for p in group] for group in prompts]
