"""The sampler never reads a device value on the host. On the CPU, ``no_device_sync`` turns every Tensor operation
that would make the host wait for a GPU (``tolist``, ``item``, ``bool``/``int``/``float``/``index`` conversions,
``nonzero``, indexing with a boolean mask, ...) into an error; the sampler runs under it for a matrix of row mixes.
tests/gpu/test_sampler_cuda.py runs the same matrix under ``torch.cuda.set_sync_debug_mode("error")``."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from rooflm.engine.stop_checker import banned_token_ids
from rooflm.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    add_tokens_to_counts,
    make_generator,
    token_counts,
    token_mask,
)
from rooflm.sampling_params import SamplingParams

sampler = Sampler()


class DeviceSyncError(AssertionError):
    """Raised by ``no_device_sync`` where the code would read a device value on the host."""


_REFUSED_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu",
                    "masked_select")
_REFUSED_FUNCTIONS = ("nonzero", "masked_select", "argwhere", "unique")
_MISSING = object()


def _has_mask(index: object) -> bool:
    """Indexing with a bool (or uint8) tensor: the result's size is the number of True entries, which the host must
    read before it can allocate the result."""
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8) for x in items)


@contextmanager
def no_device_sync() -> Iterator[None]:
    """Within the block, Tensor operations that synchronise with the device raise DeviceSyncError."""
    saved_methods = {name: torch.Tensor.__dict__.get(name, _MISSING)
                     for name in (*_REFUSED_METHODS, "__getitem__", "__setitem__")}
    saved_functions = {name: getattr(torch, name) for name in _REFUSED_FUNCTIONS}
    get_item, set_item = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise DeviceSyncError(f"{what} reads a device value on the host")
        return refused

    def getitem(self, index):
        if _has_mask(index):
            raise DeviceSyncError("indexing with a boolean mask reads its number of True entries on the host")
        return get_item(self, index)

    def setitem(self, index, value):
        if _has_mask(index):
            raise DeviceSyncError("assigning through a boolean mask reads its number of True entries on the host")
        return set_item(self, index, value)

    try:
        for name in _REFUSED_METHODS:
            setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        for name in _REFUSED_FUNCTIONS:
            setattr(torch, name, refuse(f"torch.{name}"))
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem
        yield
    finally:
        for name, original in saved_methods.items():
            if original is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        for name, original in saved_functions.items():
            setattr(torch, name, original)


# ---------------------------------------------------------------------------------------------------------------
# the detector itself can fail


SYNCING_CALLS = {
    "bool(any)": lambda t: bool((t > 0).any()),
    "if tensor": lambda t: 1 if (t > 0).all() else 0,
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "int": lambda t: int(t[0]),
    "float": lambda t: float(t.max()),
    "index": lambda t: list(range(10))[t.argmax()],
    "nonzero": lambda t: t.nonzero(),
    "torch.nonzero": lambda t: torch.nonzero(t),
    "mask getitem": lambda t: t[t > 0],
    "mask getitem in tuple": lambda t: t.view(2, 3)[t.view(2, 3)[:, 0] > 0, 1],
    "mask setitem": lambda t: t.__setitem__(t > 0, torch.zeros(1)),
    "numpy": lambda t: t.numpy(),
}


@pytest.mark.parametrize("call", SYNCING_CALLS.values(), ids=SYNCING_CALLS.keys())
def test_detector_refuses_a_syncing_call(call):
    t = torch.tensor([1.0, -2.0, 3.0, 0.5, -1.0, 2.0])
    with pytest.raises(DeviceSyncError):
        with no_device_sync():
            call(t)
    call(t)  # restored afterwards, even after the error


def test_detector_lets_device_only_work_through():
    t = torch.tensor([1.0, -2.0, 3.0, 0.5, -1.0, 2.0])
    with no_device_sync():
        y = torch.where(t > 0, t, torch.zeros_like(t)).masked_fill(t < -1.5, 7.0)
        z = y[torch.tensor([0, 2])] + y[1:3] + y.view(2, 3)[1, :2]
    assert y.tolist() == [1.0, 7.0, 3.0, 0.5, 0.0, 2.0] and z.tolist() == [8.5, 6.0]


# ---------------------------------------------------------------------------------------------------------------
# the matrix of row mixes

V = 64
EOS = 1
T0, T1 = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
PEN = [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.3),
       SamplingParams(temperature=0.8, presence_penalty=0.7, seed=11),
       SamplingParams(temperature=1.1, repetition_penalty=0.8, frequency_penalty=-0.2)]
FILTERS = [SamplingParams(temperature=0.9, min_p=0.1), SamplingParams(temperature=1.2, top_k=5, seed=3),
           SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.3, min_p=0.05, top_k=9,
                                                                      top_p=0.9, seed=4)]
BANNED = [SamplingParams(temperature=0, min_tokens=10, stop_token_ids=[5]),
          SamplingParams(temperature=1.0, min_tokens=10, seed=6), SamplingParams(temperature=0, min_tokens=1)]
LOGPROBS = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.9, logprobs=0, seed=8),
            SamplingParams(temperature=1.0, logprobs=5)]

# name -> (rows, penalty state on the device)
MATRIX: dict[str, tuple[list[SamplingParams], bool]] = {
    "all_greedy": ([T0] * 5, False),
    "all_random": ([T1] * 5, False),
    "all_seeded": ([T1.clone(seed=s) for s in range(4)], False),
    "mixed_seeded_unseeded": ([T0, T1.clone(seed=9), T1, T0, T1, T1.clone(seed=2)], False),  # unseeded rows 2, 4
    "mixed_contiguous": ([T0, T1, T1, T0], False),
    "top_k_1_at_high_temperature": ([SamplingParams(temperature=5.0, top_k=1, seed=1), T1, T0], False),
    "filters": (FILTERS + [T0], False),
    "penalties_list_path": (PEN + [T1, T0], False),
    "penalties_tensor_path": (PEN + [T1, T0], True),
    "banned_ids": (BANNED + [T1], False),
    "logprobs": (LOGPROBS + [T0], False),
    "everything": (PEN + FILTERS + BANNED + LOGPROBS + [T0, T1], True),
}


def case_inputs(rows: list[SamplingParams], seed: int) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """Logits [N, V] and the output / prompt token ids of every row, drawn on the host."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), V, generator=g) * 2
    outputs = [torch.randint(0, V, (int(torch.randint(0, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in rows]
    prompts = [torch.randint(0, V, (5,), generator=g).tolist() for _ in rows]
    return logits, outputs, prompts


def sample_case(rows: list[SamplingParams], logits: torch.Tensor, outputs: list[list[int]],
                prompts: list[list[int]], on_device_state: bool, device: str, guard) -> tuple[SamplerOutput,
                                                                                           torch.Tensor | None]:
    """One step as a runner would take it, all of it inside ``guard``: the metadata (and the device-resident
    penalty state), the sampler, and the update of the counts with the sampled ids. Returns the output and the
    updated counts (None on the list path)."""
    gens = [make_generator(p.seed, 0, device) if p.seed is not None else None for p in rows]
    banned = [banned_token_ids(len(o), p, {EOS}) for p, o in zip(rows, outputs)]
    logits = logits.to(device)
    with guard():
        counts = token_counts(outputs, V, device, dtype=torch.int32) if on_device_state else None
        mask = token_mask(prompts, V, device) if on_device_state else None
        md = SamplingMetadata.from_params(rows, outputs, prompts, gens, device, banned_token_ids=banned,
                                          output_token_counts=counts, prompt_token_mask=mask)
        out = sampler(logits, md)
        if counts is not None:
            add_tokens_to_counts(counts, None, out.sampled_token_ids)
    return out, counts


def check_case(name: str, device: str, guard) -> None:
    rows, on_device_state = MATRIX[name]
    logits, outputs, prompts = case_inputs(rows, seed=len(name))
    out, counts = sample_case(rows, logits, outputs, prompts, on_device_state, device, guard)

    tokens = out.sampled_token_ids.cpu()
    assert tokens.shape == (len(rows),) and tokens.dtype == torch.int64
    assert ((tokens >= 0) & (tokens < V)).all()
    for i, p in enumerate(rows):
        assert tokens[i].item() not in banned_token_ids(len(outputs[i]), p, {EOS}), f"row {i} took a banned id"
        if p.greedy or p.top_k == 1 or p.seed is not None:
            # Greedy and seeded rows do not depend on the rest of the batch: the same row alone, on the list path.
            alone, _ = sample_case([p], logits[i: i + 1], [outputs[i]], [prompts[i]], False, device, no_guard)
            assert tokens[i].item() == alone.sampled_token_ids.item(), f"row {i} ({p})"
    if any(p.logprobs is not None for p in rows):
        k = max(p.logprobs or 0 for p in rows)
        raw = torch.log_softmax(logits.float(), dim=-1)
        assert out.logprob_token_ids.shape == (len(rows), 1 + k)
        assert torch.equal(out.logprob_token_ids[:, 0].cpu(), tokens)
        assert torch.allclose(out.logprobs.cpu(), raw.gather(1, out.logprob_token_ids.cpu()), atol=1e-5)
    else:
        assert out.logprobs is None
    if counts is not None:
        expected = token_counts([o + [t] for o, t in zip(outputs, tokens.tolist())], V, "cpu", dtype=torch.int32)
        assert torch.equal(counts.cpu(), expected)


@contextmanager
def no_guard() -> Iterator[None]:
    yield


@pytest.mark.parametrize("name", MATRIX)
def test_sampler_makes_no_device_sync(name):
    torch.manual_seed(0)
    check_case(name, "cpu", no_device_sync)


def test_no_sync_run_gives_the_same_tokens_as_an_unguarded_run():
    rows, _ = MATRIX["everything"]
    logits, outputs, prompts = case_inputs(rows, seed=1)
    results = []
    for guard in (no_guard, no_device_sync):
        torch.manual_seed(5)
        results.append(sample_case(rows, logits, outputs, prompts, True, "cpu", guard))
    assert torch.equal(results[0][0].sampled_token_ids, results[1][0].sampled_token_ids)
    assert torch.equal(results[0][0].logprobs, results[1][0].logprobs)


# ---------------------------------------------------------------------------------------------------------------
# the host plan: which rows draw noise, from which generator


def test_from_params_host_plan():
    rows = [T0, T1.clone(seed=9), T1, SamplingParams(temperature=2.0, top_k=1, seed=1), T1.clone(min_p=0.1)]
    gens = [make_generator(p.seed, 0, "cpu") if p.seed is not None else None for p in rows]
    md = SamplingMetadata.from_params(rows, [[]] * 5, [[]] * 5, gens, "cpu")
    assert md.random_rows == [1, 2, 4] and md.any_random and not md.all_random and not md.all_greedy
    assert md.seeded_rows == [(1, gens[1])]  # the top_k=1 row is greedy: its generator is not drawn from
    assert md.unseeded_rows == [2, 4]
    assert md.any_min_p and not md.any_top_k_top_p  # top_k=1 of a greedy row does not count
    md = SamplingMetadata.from_params([T0, T0], [[]] * 2, [[]] * 2, [None, None], "cpu")
    assert md.random_rows == [] and md.seeded_rows == [] and md.unseeded_rows == [] and not md.any_random


def test_noise_is_drawn_only_for_random_rows():
    """Unseeded random rows take one [U, V] block from the global RNG; greedy rows, even seeded, draw nothing; a
    seeded row takes exactly V numbers from its own generator."""
    rows = [T0, T1, SamplingParams(temperature=0, seed=4), T1.clone(seed=3), T1, T0]
    gens = [make_generator(p.seed, 0, "cpu") if p.seed is not None else None for p in rows]
    md = SamplingMetadata.from_params(rows, [[]] * 6, [[]] * 6, gens, "cpu")
    torch.manual_seed(21)
    sampler(torch.randn(6, V), md)
    after = torch.get_rng_state()
    torch.manual_seed(21)
    torch.randn(6, V)
    torch.empty(2, V).exponential_()  # rows 1 and 4
    assert torch.equal(after, torch.get_rng_state())
    assert torch.equal(gens[2].get_state(), make_generator(4, 0, "cpu").get_state())
    expected = make_generator(3, 0, "cpu")
    torch.empty(V).exponential_(generator=expected)
    assert torch.equal(gens[3].get_state(), expected.get_state())


def test_metadata_without_a_host_plan_samples_greedy_and_seeded_rows_alike():
    """A caller building SamplingMetadata itself may leave random_rows and the filter flags at their defaults."""
    rows = [T0, T1.clone(seed=2, top_p=0.9), T1, SamplingParams(temperature=0.5, seed=7, min_p=0.2)]
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    results = []
    for plan in (True, False):
        gens = [make_generator(p.seed, 0, "cpu") if p.seed is not None else None for p in rows]
        md = SamplingMetadata.from_params(rows, [[]] * 4, [[]] * 4, gens, "cpu")
        if not plan:
            md.random_rows, md.any_min_p, md.any_top_k_top_p = None, True, True
        with no_device_sync():
            results.append(sampler(logits, md).sampled_token_ids)
    assert torch.equal(results[0][[0, 1, 3]], results[1][[0, 1, 3]])


def test_metadata_rejects_bad_plans_and_state():
    md = SamplingMetadata.from_params([T1], [[]], [[]], [None], "cpu")
    with pytest.raises(ValueError, match="random_rows"):
        dataclasses.replace(md, random_rows=[3])
    with pytest.raises(ValueError, match="generators"):
        dataclasses.replace(md, generators=[None, None])
    with pytest.raises(ValueError, match="banned"):
        SamplingMetadata.from_params([T1, T1], [[], []], [[], []], [None, None], "cpu", banned_token_ids=[[1]])
    md = SamplingMetadata.from_params([T1.clone(frequency_penalty=1.0)], [[]], [[]], [None], "cpu",
                                      output_token_counts=torch.zeros(1, V + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="output_token_counts"):
        sampler(torch.randn(1, V), md)


def test_from_params_reuses_an_earlier_steps_device_tensors_for_the_same_params():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                                                              presence_penalty=0.5)]
    gens = [None, make_generator(3, 0, "cpu")]
    first = SamplingMetadata.from_params(params, [[], []], [[], []], gens, "cpu")
    again = SamplingMetadata.from_params(params, [[], []], [[], []], gens, "cpu", reuse=first)
    for f in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty"):
        assert getattr(again, f) is getattr(first, f), f  # no copy, no cast
    fresh = SamplingMetadata.from_params(params, [[], []], [[], []], gens, "cpu")
    for f in dataclasses.fields(SamplingMetadata):
        a, b = getattr(again, f.name), getattr(fresh, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    one = sampler(logits, again).sampled_token_ids
    gens2 = [None, make_generator(3, 0, "cpu")]
    two = sampler(logits, SamplingMetadata.from_params(params, [[], []], [[], []], gens2, "cpu")).sampled_token_ids
    assert torch.equal(one, two)
    # a metadata of another row count is not taken
    other = SamplingMetadata.from_params(params[:1], [[]], [[]], [None], "cpu", reuse=first)
    assert other.num_rows == 1 and other.temperature is not first.temperature
