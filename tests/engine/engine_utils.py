"""Helpers for the engine tests."""
from __future__ import annotations

from rooflm.engine.engine import LLMEngine
from rooflm.llm import LLM
from rooflm.outputs import RequestOutput
from rooflm.sampling_params import SamplingParams


def run(engine: LLMEngine, prompts, params) -> list[RequestOutput]:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    return LLM.from_engine(engine)._run(list(zip(prompts, params)), use_tqdm=False)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]
