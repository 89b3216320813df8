"""Structured output on the real default model (SmolLM2-135M-Instruct, float32): sampled outputs always follow their
JSON schema / regex / choice, grammar rows leave plain rows of the same batch untouched, n > 1 children each follow
the grammar, asynchronous scheduling gives the synchronous outputs, and bad constraints are refused up front."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from rooflm.engine.request import Request
from rooflm.llm import LLM
from rooflm.sampling_params import SamplingParams
from rooflm.spec_decode.proposer import eligible
from rooflm.structured.params import StructuredOutputsParams

from engine_utils import run, tokens


# Bounded outputs: the longest JSON text allowed is '{"a": 99, "ok": false}' (22 characters), the longest regex
# match 6 characters, so with at most one character per token every output ends (EOS) within MAX_TOKENS.
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["a", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{1,3}-[0-9]{1,2}"
MAX_TOKENS = 24


def _prompts(tok, n):
    topics = ["a cat", "the weather", "a number", "a city", "music"]
    return [tok.apply_chat_template([{"role": "user", "content": f"Describe {topics[i % 5]} briefly ({i})."}],
                                    tokenize=False, add_generation_prompt=True) for i in range(n)]


def test_sampled_json_and_regex_outputs_always_follow_the_constraint(make_engine, smol):
    """100 requests at temperature 1 in one batch: 50 with a JSON schema, 50 with a regex."""
    engine = make_engine(kv_cache_memory=160 * 2**20, max_num_seqs=128)
    prompts = _prompts(smol[2], 100)
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i,
                             structured_outputs={"json": SCHEMA} if i % 2 == 0 else {"regex": REGEX})
              for i in range(100)]
    outputs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    texts = set()
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        if i % 2 == 0:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, c.text), (i, c.text)
        texts.add(c.text)
    assert len(texts) > 10  # sampled, not one forced string
    assert len(engine.structured) == 0  # every matcher released


def test_choice_and_n_children_each_follow_the_grammar(make_engine, smol):
    engine = make_engine()
    choices = ["yes", "no", "maybe"]
    out = run(engine, _prompts(smol[2], 3), [
        SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=8, structured_outputs={"choice": choices}),
        SamplingParams(temperature=1.0, n=3, seed=6, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMA}),
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)),
    ])
    assert [c.text in choices for c in out[0].outputs] == [True] * 4
    for c in out[1].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert out[2].outputs[0].text in choices and out[2].outputs[0].finish_reason == "stop"


def test_grammar_rows_leave_plain_rows_unchanged(make_engine, smol):
    tok = smol[2]
    prompts = _prompts(tok, 6)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = tokens(run(make_engine(), prompts[:3], plain))
    grammar = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMA}),
               SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs={"regex": REGEX}),
               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json_object": True})]
    mixed = run(make_engine(), [prompts[0], prompts[3], prompts[1], prompts[4], prompts[2], prompts[5]],
                [plain, grammar[0], plain, grammar[1], plain, grammar[2]])
    assert tokens([mixed[0], mixed[2], mixed[4]]) == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)
    assert re.fullmatch(REGEX, mixed[3].outputs[0].text)
    if mixed[5].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(mixed[5].outputs[0].text), dict)


def test_async_scheduling_gives_the_synchronous_outputs(make_engine, smol):
    prompts = _prompts(smol[2], 4)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=MAX_TOKENS, structured_outputs={"regex": REGEX}),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=3)]
    sync = run(make_engine(async_scheduling=False), prompts, params)
    asy = run(make_engine(async_scheduling=True), prompts, params)
    summary = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in sync]
    assert [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in asy] == summary
    jsonschema.validate(json.loads(sync[0].outputs[0].text), SCHEMA)


def test_min_tokens_does_not_fight_the_grammar(make_engine, smol):
    """min_tokens beyond the grammar's length: the grammar decides when the output ends (no NaN, no stray token)."""
    out = run(make_engine(), _prompts(smol[2], 1),
              SamplingParams(temperature=1.0, seed=1, min_tokens=6, max_tokens=8,
                             structured_outputs={"choice": ["no"]}))
    assert out[0].outputs[0].text == "no" and out[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("spec, field", [
    ({"json": {"type": "no-such-type"}}, "json"),
    ({"regex": "[a-"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
])
def test_invalid_constraints_are_refused_naming_the_field(make_engine, spec, field):
    engine = make_engine()
    with pytest.raises(ValueError, match=rf"StructuredOutputsParams\.{field}"):
        engine.add_request(None, [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests()


def test_grammar_requests_get_no_draft_tokens():
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0, structured_outputs={"regex": "a+"}))
    plain = Request("p", [1, 2, 3], SamplingParams(temperature=0))
    for r in (req, plain):
        r.all_token_ids.append(4)
        r.num_computed_tokens = r.num_tokens - 1
    assert eligible(plain) and not eligible(req)


def test_offline_chat_with_tools_and_a_forced_call(make_engine):
    from rooflm.structured.tools import forced_call_grammar, parse_tool_calls

    params_schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"}},
                     "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params_schema}}]
    llm = LLM.from_engine(make_engine())
    ids = llm.apply_chat_template([{"role": "user", "content": "Weather in Oslo?"}], tools=tools)
    assert '"name": "get_weather"' in llm.get_tokenizer().decode(ids)  # the fallback section
    forced = SamplingParams(temperature=1.0, seed=8, n=4, max_tokens=64,
                            structured_outputs={"grammar": forced_call_grammar(tools)})
    out = llm.chat([{"role": "user", "content": "Weather in Oslo?"}], forced, use_tqdm=False, tools=tools)[0]
    for c in out.outputs:
        content, calls = parse_tool_calls(c.text, {"get_weather"})
        assert c.finish_reason == "stop" and content == "" and len(calls) == 1, c.text
        jsonschema.validate(json.loads(calls[0].arguments), params_schema)


def test_preempted_grammar_requests_resume_where_they_were(make_engine, smol):
    """A KV pool too small for the batch preempts requests mid-output; each keeps its matcher and ends as it does
    with room to spare (greedy)."""
    prompts = _prompts(smol[2], 6)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"regex": REGEX})] * 3
    roomy = run(make_engine(), prompts, params)
    tight = make_engine(num_gpu_blocks_override=10, max_model_len=160, enable_prefix_caching=False)
    squeezed = run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert tokens(squeezed) == tokens(roomy)
    for i, o in enumerate(squeezed):
        if i % 2 == 0:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, o.outputs[0].text)
