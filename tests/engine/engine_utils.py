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


def record_launches(engine: LLMEngine) -> list[tuple[int, bool, bool]]:
    """Per launched step: (steps still in flight, whether it verifies drafts, whether the runner's drafter may run)."""
    launches = []
    execute = engine.runner.execute

    def recording(out):
        drafter = engine.runner.drafter
        launches.append((len(engine._in_flight), bool(out.scheduled_spec_tokens),
                         engine.proposer.drafting if drafter is None else drafter.enabled))
        return execute(out)

    engine.runner.execute = recording
    return launches


def check_pipelining(launches: list[tuple[int, bool, bool]], switches: bool = True) -> None:
    """Steps overlapped, and never a step that verifies or drafts: it neither starts while another is in flight nor
    stays in flight while the next is launched. ``switches``: drafting was switched on and off during the run."""
    assert all(in_flight <= 1 for in_flight, _, _ in launches)
    assert sum(in_flight for in_flight, _, _ in launches) > 0, "no step was pipelined"
    for (_, spec, drafting), (in_flight, spec_next, drafting_next) in zip(launches, launches[1:]):
        if in_flight:  # this step was launched while the previous one ran
            assert not spec and not drafting, "a drafting step was still in flight when the next was launched"
            assert not spec_next and not drafting_next, "a drafting step was launched while another was in flight"
    modes = [drafting for _, _, drafting in launches]
    assert not switches or any(a and not b for a, b in zip(modes, modes[1:])), "speculation was never switched off"
    assert not switches or any(b and not a for a, b in zip(modes, modes[1:])), "speculation was never switched back on"
    assert any(spec for _, spec, _ in launches), "nothing was verified"
