"""logit_bias through the whole engine (persistent batch, asynchronous steps) on the embedded model."""
from __future__ import annotations

from engine_utils import run, tokens
from rooflm.sampling_params import SamplingParams


def test_logit_bias_forces_and_bans_tokens_in_a_batch(make_engine, smol):
    tok = smol[2]
    prompt = tok("The capital of France is")["input_ids"]
    engine = make_engine()
    plain = tokens(run(engine, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))[0]
    forced_id = tok(" banana")["input_ids"][-1]
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100.0})
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced_id: 100.0})
    outs = tokens(run(engine, [prompt, prompt, prompt],
                      [banned, forced, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]))
    assert outs[0][0] != plain[0]
    assert outs[1] == [forced_id] * 6
    assert outs[2] == plain
