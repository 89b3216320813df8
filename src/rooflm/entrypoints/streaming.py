"""Stream one request's text to a terminal while the engine batches it with any others."""
from __future__ import annotations

from typing import TextIO

from rooflm.engine.engine import LLMEngine
from rooflm.outputs import RequestOutput
from rooflm.sampling_params import SamplingParams


def drive(engine: LLMEngine, watch: str | None = None, out: TextIO | None = None) -> dict[str, RequestOutput]:
    """Step the engine until every request finishes; stream ``watch``'s first sample to ``out`` as it grows.
    Returns the final output of every request that finished."""
    finals: dict[str, RequestOutput] = {}
    shown = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == watch and out is not None:
                text = o.outputs[0].text
                out.write(text[shown:])
                out.flush()
                shown = len(text)
            if o.finished:
                finals[o.request_id] = o
    return finals


def stream_request(engine: LLMEngine, prompt: str | list[int], params: SamplingParams, out: TextIO) -> str:
    rid = engine.add_request(None, prompt, params)
    return drive(engine, rid, out)[rid].outputs[0].text
