"""The engine with a quantized KV cache (kv_cache_dtype "int8" / "fp8") on the embedded default model: the pool's
size, greedy generation close to the unquantized cache's, and chunked prefill, prefix caching and preemption as
lossless over a quantized cache as over a plain one."""
from __future__ import annotations

import logging

import pytest

from rooflm.llm import LLM
from rooflm.sampling_params import SamplingParams
from rooflm.worker.model_runner import kv_bytes_per_block

from engine_utils import run, tokens

PROMPTS = ["The capital of France is", "Water boils at a temperature of"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_pool_size_follows_the_element_size(make_engine):
    handler = _Lines()
    logger = logging.getLogger("rooflm")
    logger.addHandler(handler)
    try:
        budget = 24 * 2**20
        engines = {kv: make_engine(kv_cache_dtype=kv, kv_cache_memory=budget) for kv in ("auto", "int8", "fp8")}
    finally:
        logger.removeHandler(handler)
    cfg = engines["auto"].model_config
    for kv, engine in engines.items():
        per_block = kv_bytes_per_block(cfg, engine.config.block_size, engine.dtype, kv)
        assert engine.kv.num_blocks == budget // per_block
        assert sum(c.nbytes if kv != "auto" else c.numel() * c.element_size() for c in engine.runner.kv_caches) \
            == engine.kv.num_blocks * per_block
    # a float32 model: 4 bytes a value against 1 (+ 4 bytes of scale per head_dim values)
    assert engines["int8"].kv.num_blocks >= 3 * engines["auto"].kv.num_blocks
    kv_lines = [line for line in handler.lines if line.startswith("KV cache:")]
    assert len(kv_lines) == 3 and "int8 + per-token scales" in kv_lines[1] and "float8_e4m3fn" in kv_lines[2]
    assert str(engines["int8"].kv.num_blocks * engines["int8"].config.block_size) in kv_lines[1]
    # the live roofline counts one byte per cached value: the int8 engine's roofline settings, on the same measured
    # ceilings as the float engine's (each engine measures its own at start-up, and a busy machine moves them)
    from rooflm.roofline.live import LiveRoofline

    auto = engines["auto"].roofline
    int8 = LiveRoofline(cfg, engines["int8"].dtype, auto.hardware, kv_dtype=engines["int8"].kv_dtype)
    long_decode = ([1] * 8, [1500] * 8, 8)
    assert int8.predict(*long_decode) < auto.predict(*long_decode)
    own = LiveRoofline(cfg, engines["int8"].dtype, engines["int8"].roofline.hardware, kv_dtype=engines["int8"].kv_dtype)
    assert own.predict(*long_decode) == engines["int8"].roofline.predict(*long_decode)  # the engine's own settings


# int8 keeps 8 bits of each row's range, e4m3 keeps 4 significant bits of each value: fp8 is allowed twice the gap
@pytest.mark.parametrize("kv,max_gap,mean_gap", [("int8", 0.2, 0.04), ("fp8", 0.4, 0.12)])
def test_generate_close_to_the_unquantized_cache(make_engine, kv, max_gap, mean_gap):
    ref = LLM.from_engine(make_engine()).generate(PROMPTS, GREEDY, use_tqdm=False)
    got = LLM.from_engine(make_engine(kv_cache_dtype=kv)).generate(PROMPTS, GREEDY, use_tqdm=False)
    for r, o in zip(ref, got):
        rt, ot = r.outputs[0].token_ids, o.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(rt, ot)) if a != b), len(rt))
        assert same >= len(rt) // 2, f"{kv}: greedy tokens part after {same} of {len(rt)}"
        # the chosen tokens' log-probabilities, where both runs saw the same tokens
        gaps = [abs(r.outputs[0].logprobs[i][rt[i]] - o.outputs[0].logprobs[i][ot[i]])
                for i in range(same)]
        assert max(gaps) < max_gap, f"{kv}: log-probabilities {max(gaps):.3f} apart"
        assert sum(gaps) / len(gaps) < mean_gap, f"{kv}: log-probabilities {sum(gaps) / len(gaps):.3f} apart on average"


def test_quantized_cache_is_lossless_under_chunking_prefix_caching_and_preemption(make_engine, smol, mixed_prompts):
    """On the reference ops: each sequence's attention there is one float32 computation over its gathered context
    whatever the chunking, so chunked, prefix-cached and recomputed keys are bitwise those of a one-shot run. (The CPU
    backend's fused attention tiles by chunk length; an int8 cache can turn those last-bit differences into a key one
    quantization step away, and a greedy choice at a near-tie into another.)"""
    from rooflm.layers.custom_op import select_ops

    select_ops(smol[0], "native")
    try:
        _lossless_under_chunking(make_engine, mixed_prompts)
    finally:
        select_ops(smol[0], "auto")


def _lossless_under_chunking(make_engine, mixed_prompts):
    prompts = mixed_prompts[:8]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone_engine = make_engine(kv_cache_dtype="int8", enable_prefix_caching=False)
    alone = [tokens(run(alone_engine, [p], params))[0] for p in prompts]
    engine = make_engine(kv_cache_dtype="int8", max_num_batched_tokens=24, num_gpu_blocks_override=20,
                         max_model_len=160)
    assert tokens(run(engine, prompts, params)) == alone
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
