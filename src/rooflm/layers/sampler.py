"""Token sampling on the device: penalties, greedy, temperature, min_p, top_k, top_p, seeds and logprobs.

One row per sequence sampled this step, rows in batch order. The order of operations is vLLM's:

1. logprobs of the RAW model distribution (``log_softmax`` of the incoming logits) when any row asked for them;
2. tokens banned for this step (``min_tokens`` not reached yet: EOS / stop_token_ids) get ``-inf``;
3. penalties: repetition (prompt + output tokens), then presence and frequency (output tokens);
4. greedy rows (temperature 0, or top_k == 1) take the argmax;
5. random rows: temperature, min_p, top_k, top_p (each filter sees the distribution renormalised after the
   previous one), then an exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. per token, which picks
   token ``i`` with probability ``probs[i]``.

Batch invariance of seeded rows: a row with a generator draws its own ``q`` from that generator, exactly ``V``
numbers per step whatever else is in the batch, and every other operation is row-wise, so its token depends only on
its own logits, its own parameters and its own generator state. Unseeded rows share one draw from the global RNG.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rooflm.sampling_params import SAMPLING_EPS, SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A 64-bit mixing function: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_generator(seed: int, sample_index: int, device: torch.device | str) -> torch.Generator:
    """The generator of sample ``sample_index`` (of a request's ``n``) of a request seeded with ``seed``.

    Deterministic in (seed, sample_index); the n samples of one request get distinct streams. ``device`` must be the
    device of the logits (a CUDA generator for CUDA logits).
    """
    g = torch.Generator(device=device)
    g.manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ (sample_index & _MASK64)) >> 1)
    return g


@dataclass
class SamplingMetadata:
    """Per-row sampling options of one step, on the logits' device. N rows, in batch order."""

    temperature: torch.Tensor  # [N] float32; < SAMPLING_EPS means greedy for that row
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] float32; 1 = off
    min_p: torch.Tensor  # [N] float32; 0 = off
    repetition_penalty: torch.Tensor  # [N] float32; 1 = off
    presence_penalty: torch.Tensor  # [N] float32; 0 = off
    frequency_penalty: torch.Tensor  # [N] float32; 0 = off
    output_token_ids: list[list[int]]  # generated so far, per row (presence/frequency/repetition count these)
    prompt_token_ids: list[list[int]]  # per row (repetition penalty also covers the prompt)
    generators: list[torch.Generator | None]  # per row: own generator for seeded requests, None = global RNG
    max_num_logprobs: int  # k of the top-k logprobs to return (max over rows); 0 = no top-k
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    # Whether to return logprobs at all. None: max_num_logprobs > 0. A request with logprobs=0 still wants the
    # sampled token's logprob, so from_params sets this whenever any row has logprobs is not None.
    return_logprobs: bool | None = None
    # Per row, token ids whose logits are -inf this step (EOS / stop_token_ids while min_tokens is not reached).
    banned_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.return_logprobs is None:
            self.return_logprobs = self.max_num_logprobs > 0

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> "SamplingMetadata":
        """Build the metadata of one step. ``banned_token_ids[i]``: ids row i must not pick (EOS / stop ids under
        ``min_tokens``, from ``rooflm.engine.stop_checker.banned_token_ids``)."""
        n = len(params)
        if not (len(output_token_ids) == len(prompt_token_ids) == len(generators) == n):
            raise ValueError(
                f"SamplingMetadata.from_params: {n} params but {len(output_token_ids)} output lists, "
                f"{len(prompt_token_ids)} prompt lists and {len(generators)} generators"
            )
        greedy = [p.greedy or p.top_k == 1 for p in params]
        banned = [list(b) for b in banned_token_ids] if banned_token_ids is not None else []

        # One [7, N] host tensor and one copy to the device, not seven (each copy from pageable memory stalls).
        table = torch.tensor(
            [[0.0 if g else float(p.temperature) for p, g in zip(params, greedy)],
             [float(p.top_k) for p in params],  # exact in float32: top_k <= vocab size < 2**24
             [float(p.top_p) for p in params],
             [float(p.min_p) for p in params],
             [float(p.repetition_penalty) for p in params],
             [float(p.presence_penalty) for p in params],
             [float(p.frequency_penalty) for p in params]],
            dtype=torch.float32,
            pin_memory=torch.device(device).type == "cuda",
        ).to(device, non_blocking=True)
        return cls(
            temperature=table[0],
            top_k=table[1].to(torch.int64),
            top_p=table[2],
            min_p=table[3],
            repetition_penalty=table[4],
            presence_penalty=table[5],
            frequency_penalty=table[6],
            output_token_ids=[list(o) for o in output_token_ids],
            prompt_token_ids=[list(p) for p in prompt_token_ids],
            generators=list(generators),
            max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=all(
                p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0 for p in params
            ),
            return_logprobs=any(p.logprobs is not None for p in params),
            banned_token_ids=banned if any(banned) else None,
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprob_token_ids: torch.Tensor | None = None  # [N, 1 + k] int64: the sampled token, then the top-k
    logprobs: torch.Tensor | None = None  # [N, 1 + k] float32, matching logprob_token_ids


def _pad_token_ids(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, L] int64, padded with ``vocab_size`` (a scratch column that callers drop); ids >= vocab are dropped too."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), vocab_size, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    out = out.clamp_(max=vocab_size)  # out-of-vocab ids land in the scratch column
    return out.to(device, non_blocking=True)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] int64: how often each token occurs in each row."""
    ids = _pad_token_ids(rows, vocab_size, device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Return penalised logits [N, V] (a new tensor). Neutral values (1, 0, 0) leave a row bit-exact."""
    n, v = logits.shape
    out_counts = _token_counts(md.output_token_ids, v, logits.device)  # [N, V]
    prompt_counts = _token_counts(md.prompt_token_ids, v, logits.device)  # [N, V]
    seen = (out_counts > 0) | (prompt_counts > 0)
    rep = md.repetition_penalty.to(logits.dtype).unsqueeze(1)  # [N, 1]
    # Repetition (CTRL / HF): push seen tokens towards "less likely" whatever their sign.
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    # OpenAI presence / frequency on generated tokens only.
    logits = logits - md.frequency_penalty.to(logits.dtype).unsqueeze(1) * out_counts.to(logits.dtype)
    logits = logits - md.presence_penalty.to(logits.dtype).unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R, V]: drop tokens whose probability is below min_p times the top token's. min_p [R]."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R, V]: keep exactly the k best tokens (k = 0: all), then the smallest set of the best tokens whose
    probability (renormalised after top_k) reaches top_p (1: all). The best token always survives."""
    v = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(v, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).unsqueeze(1)  # [R, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of the better tokens
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """[R, V] probabilities -> [R] sampled ids. Rows with a generator draw from it alone."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        q.exponential_()
    else:
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            q[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
    # An Exp(1) draw can be 0.0 in float32; keep probs/q finite (0/0 would be NaN for filtered tokens).
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def sample_random(
    logits: torch.Tensor, md_rows: dict[str, torch.Tensor], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """[R, V] penalised logits of random rows -> [R] token ids. md_rows: temperature/min_p/top_k/top_p [R]."""
    x = logits / md_rows["temperature"].unsqueeze(1)
    if bool((md_rows["min_p"] > 0).any()):
        x = apply_min_p(x, md_rows["min_p"])
    if bool(((md_rows["top_k"] > 0) | (md_rows["top_p"] < 1)).any()):
        x = apply_top_k_top_p(x, md_rows["top_k"], md_rows["top_p"])
    probs = torch.softmax(x, dim=-1)
    return _exponential_race(probs, generators)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] logprobs, [N] chosen ids -> (ids [N, 1+k] int64, logprobs [N, 1+k] float32): chosen first, then top-k."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1).to(torch.int64))  # [N, 1]
    ids = token_ids.view(-1, 1).to(torch.int64)
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)  # [N, k], best first
        ids = torch.cat([ids, top_ids], dim=1)
        chosen = torch.cat([chosen, top_lp], dim=1)
    return ids, chosen.to(torch.float32)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt logprobs: logits [P, V] at P prompt positions, next_token_ids [P] (the prompt token that actually
    follows each position) -> (ids [P, 1+k], logprobs [P, 1+k]): the actual next token first, then the top-k."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), next_token_ids, k)


def logprobs_to_dicts(
    token_ids: torch.Tensor, logprobs: torch.Tensor, num_logprobs: Sequence[int]
) -> list[dict[int, float]]:
    """vLLM's per-position shape: row i -> {token_id: logprob} of its first token (the chosen or actual one) and its
    own top ``num_logprobs[i]`` (a batch returns the max k over rows; each row keeps only what it asked for)."""
    ids_l, lps_l = token_ids.tolist(), logprobs.tolist()
    out: list[dict[int, float]] = []
    for ids, lps, k in zip(ids_l, lps_l, num_logprobs):
        d = {ids[j]: lps[j] for j in range(1, 1 + k)}
        d.setdefault(ids[0], lps[0])
        out.append(d)
    return out


class Sampler:
    """Stateless; ``Sampler()(logits [N, V], md) -> SamplerOutput``. Runs on the logits' device."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(f"Sampler: logits of shape {tuple(logits.shape)} for {md.num_rows} rows")
        logits = logits.float()
        n, v = logits.shape
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.return_logprobs else None  # [N, V]

        if md.banned_token_ids:
            ids = _pad_token_ids(md.banned_token_ids, v, logits.device)  # [N, L], pad = v
            mask = torch.zeros(n, v + 1, dtype=torch.bool, device=logits.device)
            mask.scatter_(1, ids, True)
            logits = logits.masked_fill(mask[:, :v], float("-inf"))
        if not md.no_penalties:
            logits = apply_penalties(logits, md)

        if md.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            greedy_rows = md.temperature < SAMPLING_EPS  # [N] bool (from_params folds top_k == 1 in)
            greedy_rows |= md.top_k == 1
            sampled = torch.empty(n, dtype=torch.int64, device=logits.device)
            rows = torch.arange(n, device=logits.device)
            if not md.all_random:
                g = rows[greedy_rows]
                sampled[g] = logits[g].argmax(dim=-1)
            r = rows[~greedy_rows]
            r_list = r.tolist()
            if r_list:
                sel = {
                    "temperature": md.temperature[r],
                    "min_p": md.min_p[r],
                    "top_k": md.top_k[r],
                    "top_p": md.top_p[r],
                }
                sampled[r] = sample_random(logits[r], sel, [md.generators[i] for i in r_list])

        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return out
