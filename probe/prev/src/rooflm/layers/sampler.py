"""Token sampling on the device: penalties, greedy, temperature, min_p, top_k, top_p, seeds and logprobs.

One row per sequence sampled this step, rows in batch order. The order of operations is vLLM's:

1. logprobs of the RAW model distribution (``log_softmax`` of the incoming logits) when any row asked for them;
2. tokens banned for this step (``min_tokens`` not reached yet: EOS / stop_token_ids) get ``-inf``, and each row's
   ``logit_bias`` is added (OpenAI's semantics: a bias of -100 all but bans a token, +100 all but forces it); then
   tokens a row's grammar does not allow (structured output) get ``-inf``;
3. penalties: repetition (prompt + output tokens), then presence and frequency (output tokens);
4. greedy rows (temperature 0, or top_k == 1) take the argmax;
5. random rows: temperature, min_p, top_k, top_p (each filter sees the distribution renormalised after the
   previous one), then an exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. per token, which picks
   token ``i`` with probability ``probs[i]``.

No device-to-host synchronisation. ``Sampler.__call__`` never reads a device value on the host: every branch is
decided by host fields of ``SamplingMetadata`` (``all_greedy``, ``all_random``, ``random_rows``, ``any_min_p``,
``any_top_k_top_p``, ``no_penalties``, the generators list), greedy and random rows are merged with ``torch.where``
(the random path runs on every row when some row is random), and host-to-device copies go through pinned memory
with ``non_blocking=True``. A caller can therefore keep the sampled ids on the device and feed them to the next
step without waiting for this one. Penalty state can stay on the device across steps too: ``token_counts`` /
``token_mask`` build it, ``add_tokens_to_counts`` adds each step's sampled ids in place. ``logprobs_to_dicts`` is the
exception: it converts to Python objects for the outputs, so it syncs; call it when the results are needed.

Batch invariance of seeded rows: a row with a generator draws its own ``q`` from that generator, exactly ``V``
numbers per step whatever else is in the batch, and every other operation is row-wise, so its token depends only on
its own logits, its own parameters and its own generator state. Unseeded random rows share one draw of shape
``[number of such rows, V]`` from the global RNG.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rooflm.sampling_params import SAMPLING_EPS, SamplingParams
from rooflm.structured.manager import apply_token_bitmask

_MASK64 = (1 << 64) - 1


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``: the same indices (the first of equal maxima; a NaN counts as the largest), computed
    through ``max``, which torch runs about 3x faster on the CPU over a vocabulary-wide row (about 25 against 70 us
    for 49,152 floats on one core). Every greedy choice goes through here, so the plain path, the verification of
    speculative tokens and the drafters all pick the same token. Float32 rows on the CPU go to the native operator
    (``rooflm.kernels.cpu_native.ops.argmax``: the same indices again, ~5 us a row) where the library is built; rows
    on CUDA to the Triton kernel ``rooflm.kernels.argmax.argmax_rows`` (the same indices, one launch)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        from rooflm.kernels.cpu_native.ops import argmax

        out = argmax(logits)
        if out is not None:
            return out
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and logits.numel() > 0:
        from rooflm.kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return logits.max(dim=-1).indices


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


def _to_device(data: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on ``device``. For CUDA the host tensor is pinned and the copy non-blocking: a copy
    from pageable memory, or a blocking one, would make the host wait for the device."""
    pinned = torch.device(device).type == "cuda"
    return torch.tensor(data, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


@dataclass
class SamplingMetadata:
    """Per-row sampling options of one step, on the logits' device. N rows, in batch order.

    The tensors live on the device; the lists and flags live on the host and decide every branch the sampler
    takes, so sampling never waits for the device. ``from_params`` fills everything consistently; a caller that
    builds the metadata itself must keep the host flags true to the tensors (the defaults of the optional flags are
    the safe ones: they cost work, never correctness).
    """

    temperature: torch.Tensor  # [N] float32; < SAMPLING_EPS means greedy for that row
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] float32; 1 = off
    min_p: torch.Tensor  # [N] float32; 0 = off
    repetition_penalty: torch.Tensor  # [N] float32; 1 = off
    presence_penalty: torch.Tensor  # [N] float32; 0 = off
    frequency_penalty: torch.Tensor  # [N] float32; 0 = off
    output_token_ids: list[list[int]]  # generated so far, per row (ignored when output_token_counts is given)
    prompt_token_ids: list[list[int]]  # per row (ignored when prompt_token_mask is given)
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
    # Device-resident penalty state, kept by the caller across steps. [N, V] counts (any integer dtype) of the
    # tokens each row generated so far; [N, V] bool, tokens present in each row's prompt. None: built this step from
    # output_token_ids / prompt_token_ids.
    output_token_counts: torch.Tensor | None = None
    prompt_token_mask: torch.Tensor | None = None
    # Host plan of the random path. random_rows: the rows sampled at random (not greedy), ascending; they, and only
    # they, draw noise (seeded ones from their own generator). None: every row when not all_greedy.
    random_rows: list[int] | None = None
    any_min_p: bool = True  # some random row has min_p > 0
    any_top_k_top_p: bool = True  # some random row has top_k > 0 or top_p < 1
    # Sparse logit biases, host lists of equal length: rows, token ids and the bias added there. None: no bias.
    logit_bias: tuple[list[int], list[int], list[float]] | None = None
    # Structured output: [N, ceil(V / 32)] int32 on the device, bit t of a row set where token t is allowed (rows
    # without a grammar are all ones). None: no row is constrained.
    allowed_token_bitmask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.return_logprobs is None:
            self.return_logprobs = self.max_num_logprobs > 0
        n = self.num_rows
        if len(self.generators) != n:
            raise ValueError(f"SamplingMetadata.generators has {len(self.generators)} entries for {n} rows")
        if self.random_rows is not None and any(not 0 <= i < n for i in self.random_rows):
            raise ValueError(f"SamplingMetadata.random_rows={self.random_rows!r} is invalid: expected rows in [0, {n})")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def any_random(self) -> bool:
        return not self.all_greedy

    def _random_rows(self) -> list[int]:
        if self.all_greedy:
            return []
        return list(range(self.num_rows)) if self.random_rows is None else self.random_rows

    @property
    def seeded_rows(self) -> list[tuple[int, torch.Generator]]:
        """(row, generator) of the random rows with their own generator: host data."""
        return [(i, g) for i in self._random_rows() if (g := self.generators[i]) is not None]

    @property
    def unseeded_rows(self) -> list[int]:
        """The random rows that draw from the global RNG: host data."""
        return [i for i in self._random_rows() if self.generators[i] is None]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_counts: torch.Tensor | None = None,
        prompt_token_mask: torch.Tensor | None = None,
        reuse: "SamplingMetadata | None" = None,
    ) -> "SamplingMetadata":
        """Build the metadata of one step. ``banned_token_ids[i]``: ids row i must not pick (EOS / stop ids under
        ``min_tokens``, from ``rooflm.engine.stop_checker.banned_token_ids``). ``output_token_counts`` /
        ``prompt_token_mask``: device-resident penalty state (see the fields); the id lists are then not read.
        ``reuse``: the metadata of an earlier step built from the very same ``params`` objects in the same order;
        its device tensors (which depend on nothing else and are never written) are taken as they are, which saves
        the step a host-to-device copy and a cast kernel (a decode step of an unchanged batch)."""
        n = len(params)
        if not (len(output_token_ids) == len(prompt_token_ids) == len(generators) == n):
            raise ValueError(
                f"SamplingMetadata.from_params: {n} params but {len(output_token_ids)} output lists, "
                f"{len(prompt_token_ids)} prompt lists and {len(generators)} generators"
            )
        greedy = [p.greedy or p.top_k == 1 for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if banned_token_ids is not None and len(banned_token_ids) != n:
            raise ValueError(f"SamplingMetadata.from_params: {n} params but {len(banned_token_ids)} banned lists")
        banned = [list(b) for b in banned_token_ids] if banned_token_ids is not None else []

        if reuse is not None and reuse.num_rows == n:
            top_k = reuse.top_k
            fields = (reuse.temperature, reuse.top_p, reuse.min_p, reuse.repetition_penalty, reuse.presence_penalty,
                      reuse.frequency_penalty)
        else:  # one [7, N] host tensor and one copy to the device, not seven (each copy from pageable memory stalls)
            table = _to_device(
                [[0.0 if g else float(p.temperature) for p, g in zip(params, greedy)],
                 [float(p.top_k) for p in params],  # exact in float32: top_k <= vocab size < 2**24
                 [float(p.top_p) for p in params],
                 [float(p.min_p) for p in params],
                 [float(p.repetition_penalty) for p in params],
                 [float(p.presence_penalty) for p in params],
                 [float(p.frequency_penalty) for p in params]],
                torch.float32,
                device,
            )
            top_k, fields = table[1].to(torch.int64), (table[0], *table[2:])
        return cls(
            temperature=fields[0],
            top_k=top_k,
            top_p=fields[1],
            min_p=fields[2],
            repetition_penalty=fields[3],
            presence_penalty=fields[4],
            frequency_penalty=fields[5],
            output_token_ids=[list(o) for o in output_token_ids] if output_token_counts is None else [],
            prompt_token_ids=[list(p) for p in prompt_token_ids] if prompt_token_mask is None else [],
            generators=list(generators),
            max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=all(
                p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0 for p in params
            ),
            return_logprobs=any(p.logprobs is not None for p in params),
            banned_token_ids=banned if any(banned) else None,
            output_token_counts=output_token_counts,
            prompt_token_mask=prompt_token_mask,
            random_rows=random_rows,
            any_min_p=any(params[i].min_p > 0 for i in random_rows),
            any_top_k_top_p=any(params[i].top_k > 0 or params[i].top_p < 1 for i in random_rows),
            logit_bias=_sparse_logit_bias(params),
        )


def _sparse_logit_bias(params: Sequence[SamplingParams]) -> tuple[list[int], list[int], list[float]] | None:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for tid, bias in (p.logit_bias or {}).items():
            rows.append(i)
            ids.append(tid)
            values.append(float(bias))
    return (rows, ids, values) if rows else None


def apply_logit_bias(logits: torch.Tensor, bias: tuple[list[int], list[int], list[float]]) -> torch.Tensor:
    """Add the sparse biases (host lists: rows, token ids, values) to [N, V] logits; ids outside [0, V) are skipped
    (the server rejects them; the engine must not fail a whole step for one request's bad id)."""
    v = logits.shape[1]
    keep = [j for j, t in enumerate(bias[1]) if 0 <= t < v]
    if not keep:
        return logits
    rows = _to_device([bias[0][j] for j in keep], torch.int64, logits.device)
    cols = _to_device([bias[1][j] for j in keep], torch.int64, logits.device)
    vals = _to_device([bias[2][j] for j in keep], logits.dtype, logits.device)
    return logits.index_put((rows, cols), vals, accumulate=True)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprob_token_ids: torch.Tensor | None = None  # [N, 1 + k] int64: the sampled token, then the top-k
    logprobs: torch.Tensor | None = None  # [N, 1 + k] float32, matching logprob_token_ids


def _pad_token_ids(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, L] int64 on ``device``, padded with ``vocab_size`` (a scratch column that callers drop); ids outside
    [0, vocab) land in the scratch column too. Built on the host (pinned for CUDA), one non-blocking copy."""
    width = max(max((len(r) for r in rows), default=0), 1)
    pinned = torch.device(device).type == "cuda"
    out = torch.full((len(rows), width), vocab_size, dtype=torch.int64, pin_memory=pinned)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    out.masked_fill_(out < 0, vocab_size).clamp_(max=vocab_size)
    return out.to(device, non_blocking=True)


def token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str,
                 dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[N, V] ``dtype`` (contiguous) on ``device``: how often each token occurs in each row of ids. Ids outside
    [0, vocab_size) are not counted."""
    ids = _pad_token_ids(rows, vocab_size, device)
    valid = ids < vocab_size  # padding adds 0 at column 0
    counts = torch.zeros(len(rows), vocab_size, dtype=dtype, device=device)
    counts.scatter_add_(1, ids.masked_fill(~valid, 0), valid.to(dtype))
    return counts


def token_mask(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] bool (contiguous) on ``device``: which tokens occur in each row of ids (e.g. the prompts)."""
    ids = _pad_token_ids(rows, vocab_size, device)
    mask = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, ids, True)
    return mask[:, :vocab_size].contiguous()


def add_tokens_to_counts(counts: torch.Tensor, rows_index: torch.Tensor | None, token_ids: torch.Tensor) -> None:
    """In place, on the device: ``counts[rows_index[j], token_ids[j]] += 1`` for every j (repeated pairs count
    every time). ``rows_index`` None: rows 0..R-1. Ids outside [0, V) are skipped (e.g. -1 for a row that sampled
    nothing), decided on the device, so nothing waits for the sampled ids to reach the host."""
    if counts.dim() != 2 or not counts.is_contiguous():
        raise ValueError(f"add_tokens_to_counts: counts must be a contiguous [N, V] tensor, got shape "
                         f"{tuple(counts.shape)} (contiguous={counts.is_contiguous()})")
    n, v = counts.shape
    tokens = token_ids.reshape(-1).to(device=counts.device, dtype=torch.int64)
    if rows_index is None:
        if tokens.shape[0] > n:
            raise ValueError(f"add_tokens_to_counts: {tokens.shape[0]} token ids for {n} rows and no rows_index")
        rows = torch.arange(tokens.shape[0], device=counts.device)
    else:
        rows = rows_index.reshape(-1).to(device=counts.device, dtype=torch.int64)
        if rows.shape[0] != tokens.shape[0]:
            raise ValueError(f"add_tokens_to_counts: rows_index has {rows.shape[0]} entries, token_ids "
                             f"{tokens.shape[0]}")
    valid = (tokens >= 0) & (tokens < v)
    flat = torch.where(valid, rows * v + tokens, torch.zeros_like(tokens))
    counts.view(-1).scatter_add_(0, flat, valid.to(counts.dtype))


def _check_state(name: str, t: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
    if tuple(t.shape) != shape or t.device != device:
        raise ValueError(f"SamplingMetadata.{name} has shape {tuple(t.shape)} on {t.device}; the logits need "
                         f"{shape} on {device}")


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Return penalised logits [N, V] (a new tensor). Neutral values (1, 0, 0) leave a row bit-exact. Uses the
    device-resident ``output_token_counts`` / ``prompt_token_mask`` when given, else the id lists."""
    n, v = logits.shape
    if md.output_token_counts is not None:
        _check_state("output_token_counts", md.output_token_counts, (n, v), logits.device)
        out_counts = md.output_token_counts
    else:
        out_counts = token_counts(md.output_token_ids, v, logits.device)
    if md.prompt_token_mask is not None:
        _check_state("prompt_token_mask", md.prompt_token_mask, (n, v), logits.device)
        in_prompt = md.prompt_token_mask
    else:
        in_prompt = token_mask(md.prompt_token_ids, v, logits.device)
    generated = out_counts > 0
    seen = generated | in_prompt
    rep = md.repetition_penalty.to(logits.dtype).unsqueeze(1)  # [N, 1]
    # Repetition (CTRL / HF): push seen tokens towards "less likely" whatever their sign.
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    # OpenAI presence / frequency on generated tokens only.
    logits = logits - md.frequency_penalty.to(logits.dtype).unsqueeze(1) * out_counts.to(logits.dtype)
    logits = logits - md.presence_penalty.to(logits.dtype).unsqueeze(1) * generated.to(logits.dtype)
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


def _exponential_race(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[N, V] probabilities -> [N] sampled ids; meaningful for the random rows. Noise per the host plan: seeded rows
    draw V numbers from their own generator, the unseeded random rows one [U, V] block from the global RNG, other
    rows none (their q is 1)."""
    n, v = probs.shape
    unseeded, seeded = md.unseeded_rows, md.seeded_rows
    if len(unseeded) == n:
        q = torch.empty_like(probs).exponential_()
    else:
        q = torch.ones_like(probs)
        if unseeded and unseeded[-1] - unseeded[0] == len(unseeded) - 1:  # one contiguous block of rows
            q[unseeded[0]: unseeded[-1] + 1].exponential_()
        elif unseeded:
            draw = torch.empty(len(unseeded), v, dtype=probs.dtype, device=probs.device).exponential_()
            q.index_copy_(0, _to_device(unseeded, torch.int64, probs.device), draw)
        for i, g in seeded:  # a host int index: a view, no sync
            q[i].exponential_(generator=g)
    # An Exp(1) draw can be 0.0 in float32; keep probs/q finite (0/0 would be NaN for filtered tokens).
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[N, V] penalised logits -> [N, V] the distribution random rows sample from: temperature, then min_p, then
    top-k/top-p, renormalised (greedy rows get temperature 1 here, so nothing divides by zero). Speculative decoding's
    rejection sampling verifies draft tokens against exactly this distribution."""
    temperature = md.temperature
    if not md.all_random:
        temperature = torch.where(temperature < SAMPLING_EPS, torch.ones_like(temperature), temperature)
    x = logits / temperature.unsqueeze(1)
    if md.any_min_p:
        x = apply_min_p(x, md.min_p)
    if md.any_top_k_top_p:
        x = apply_top_k_top_p(x, md.top_k, md.top_p)
    return torch.softmax(x, dim=-1)


def sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[N, V] penalised logits -> [N] token ids drawn for every row; only the random rows' ids are meaningful
    (greedy rows draw no noise)."""
    return _exponential_race(target_probs(logits, md), md)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] logprobs, [N] chosen ids -> (ids [N, 1+k] int64, logprobs [N, 1+k] float32): chosen first, then top-k.
    Stays on the device."""
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
    own top ``num_logprobs[i]`` (a batch returns the max k over rows; each row keeps only what it asked for).
    Copies to the host, so it waits for the device: call it when building outputs, not on the sampling path."""
    ids_l, lps_l = token_ids.tolist(), logprobs.tolist()
    out: list[dict[int, float]] = []
    for ids, lps, k in zip(ids_l, lps_l, num_logprobs):
        d = {ids[j]: lps[j] for j in range(1, 1 + k)}
        d.setdefault(ids[0], lps[0])
        out.append(d)
    return out


class Sampler:
    """Stateless; ``Sampler()(logits [N, V], md) -> SamplerOutput``. Runs on the logits' device, without waiting
    for it (see the module docstring)."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(f"Sampler: logits of shape {tuple(logits.shape)} for {md.num_rows} rows")
        logits = logits.float()
        v = logits.shape[1]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.return_logprobs else None  # [N, V]

        if md.banned_token_ids:
            logits = logits.masked_fill(token_mask(md.banned_token_ids, v, logits.device), float("-inf"))
        if md.logit_bias is not None:
            logits = apply_logit_bias(logits, md.logit_bias)
        if md.allowed_token_bitmask is not None:
            logits = apply_token_bitmask(logits, md.allowed_token_bitmask)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)

        if md.all_greedy:
            sampled = argmax_tokens(logits)
        else:
            sampled = sample_random(logits, md)
            if not md.all_random:
                greedy_rows = (md.temperature < SAMPLING_EPS) | (md.top_k == 1)  # [N] bool, on the device
                sampled = torch.where(greedy_rows, argmax_tokens(logits), sampled)

        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return out
