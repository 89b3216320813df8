"""IncrementalDetokenizer: multi-byte characters split across byte-level BPE tokens (SmolLM2's tokenizer), special
tokens, stop strings across token boundaries, and streaming deltas that are never retracted."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rooflm.engine.detokenizer import IncrementalDetokenizer
from rooflm.engine.stop_checker import check_stop, is_stop_token
from rooflm.sampling_params import SamplingParams

JAPANESE_EMOJI = "東京タワーは高さ333メートルです。🗼🎌 家族👨‍👩‍👧‍👦と行きました！ naïve café — ok 👍🏽"


@pytest.fixture(scope="session")
def tok(default_model_path):
    path = default_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def stream(detok: IncrementalDetokenizer, ids: list[int], stop_ids: frozenset[int] = frozenset()):
    """Feed ids one by one, collecting deltas. Checks the streaming invariants at every step and returns
    (concatenated deltas, the stop string or None)."""
    streamed = ""
    stop = None
    for t in ids:
        stop = detok.append(t, is_stop_token=t in stop_ids)
        text = detok.output_text
        assert not text.endswith("\ufffd"), f"incomplete character in {text!r}"
        streamed += detok.get_delta()
        assert text.startswith(streamed), "a delta was retracted"
        if stop is not None:
            break
    streamed += detok.flush()
    assert streamed == detok.output_text
    return streamed, stop


def test_split_multibyte_characters_decode_like_the_full_text(tok):
    ids = tok.encode(JAPANESE_EMOJI)
    singles = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in s for s in singles) > 10  # the test really splits characters across tokens
    prompt = tok.encode("Say something:")
    streamed, stop = stream(IncrementalDetokenizer(tok, prompt, SamplingParams()), ids)
    assert stop is None
    assert streamed == tok.decode(ids) == JAPANESE_EMOJI


def test_each_delta_is_emitted_once_its_character_is_complete(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for t in ids[:-1]:
        detok.append(t)
        assert detok.output_text == "" and detok.get_delta() == ""
    detok.append(ids[-1])
    assert detok.output_text == "🎉" and detok.get_delta() == "🎉"


def test_no_prompt_and_plain_ascii(tok):
    text = "The quick brown fox jumps over the lazy dog. 12345"
    ids = tok.encode(text)
    streamed, _ = stream(IncrementalDetokenizer(tok, [], SamplingParams()), ids)
    assert streamed == text


def test_skip_special_tokens(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hello") + [im_end] + tok.encode(" world 日本") + [tok.eos_token_id]
    skipped, _ = stream(IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=True)), ids)
    kept, _ = stream(IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False)), ids)
    assert skipped == tok.decode(ids, skip_special_tokens=True) == "Hello world 日本"
    assert kept == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|>" in kept and tok.eos_token in kept


def test_flush_releases_an_incomplete_trailing_character(tok):
    ids = tok.encode("ok 🎉")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for t in ids:
        detok.append(t)
    assert detok.output_text == "ok"
    assert detok.get_delta() == "ok"
    assert detok.flush().endswith("\ufffd")


# ---------------------------------------------------------------------------------------------------------------
# stop strings


def test_stop_string_spanning_tokens(tok):
    text = "Hello world, here is the answer: 42. Bye"
    ids = tok.encode(text)
    stop = "o wor"  # spans "Hello" | " world"
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop]))
    streamed, found = stream(detok, ids)
    assert found == stop == detok.stop_string
    assert streamed == detok.output_text == "Hell"
    assert detok.num_output_tokens == 2  # found as soon as the second token arrived


def test_include_stop_str_in_output(tok):
    ids = tok.encode("Hello world, here is the answer: 42. Bye")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["answer:"], include_stop_str_in_output=True))
    streamed, found = stream(detok, ids)
    assert found == "answer:"
    assert streamed == "Hello world, here is the answer:"


def test_stop_string_inside_multibyte_text(tok):
    ids = tok.encode(JAPANESE_EMOJI)
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"), SamplingParams(stop=["メートル", "🎌"]))
    streamed, found = stream(detok, ids)
    assert found == "メートル" and streamed == "東京タワーは高さ333"


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["delta", "beta", "gamma"]))
    streamed, found = stream(detok, ids)
    assert found == "beta" and streamed == "alpha "


def test_held_back_text_is_released_when_no_stop_follows(tok):
    ids = tok.encode("Hello world, goodbye")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world!"]))
    deltas = []
    for t in ids[:2]:  # "Hello", " world"
        detok.append(t)
        deltas.append(detok.get_delta())
    assert detok.output_text == "Hello world" and "".join(deltas) == "Hello "  # "world" could start "world!"
    for t in ids[2:]:
        detok.append(t)
    assert detok.get_delta() == "world, goodbye"
    assert detok.flush() == "" and detok.stop_string is None


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("stop here, then stop there")
    n_first = len(tok.encode("stop here"))
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["stop"], min_tokens=n_first))
    streamed, found = stream(detok, ids)
    assert found == "stop" and streamed == "stop here, then "


def test_stop_token_is_left_out_of_the_text(tok):
    eos = tok.eos_token_id
    ids = tok.encode("Fine.") + [eos]
    shown = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False))
    hidden = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False))
    assert stream(shown, ids)[0] == "Fine." + tok.eos_token
    assert stream(hidden, ids, stop_ids=frozenset({eos}))[0] == "Fine."
    assert hidden.num_output_tokens == len(ids)


def test_appends_after_a_stop_are_ignored(tok):
    ids = tok.encode("one two three")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["two"]))
    stream(detok, ids)
    assert detok.append(ids[-1]) is None and detok.output_text == "one "


# ---------------------------------------------------------------------------------------------------------------
# a byte-level fake tokenizer (one token per UTF-8 byte), for property tests against a brute-force reference


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Characters arrive one at a time (whole characters: the detokenizer never shows partial ones); the first
    character completing a stop string ends the text; on a tie the earliest-starting (longest) stop wins."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab é🎉東", max_size=25),
    stops=st.lists(st.text(alphabet="ab é🎉東", min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
)
def test_property_stop_strings_and_streaming(text, stops, include):
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(ByteTokenizer(), [], params)
    streamed, found = stream(detok, list(text.encode("utf-8")))
    expect_text, expect_stop = reference_cut(text, stops, include)
    assert (streamed, found) == (expect_text, expect_stop)


# ---------------------------------------------------------------------------------------------------------------
# stop checker


def test_check_stop_reasons_and_order():
    p = SamplingParams(max_tokens=5, stop_token_ids=[7], min_tokens=1)
    assert check_stop(3, 1, p, eos_token_ids={2}) is None
    assert check_stop(2, 1, p, eos_token_ids={2}) is None  # EOS before min_tokens is satisfied: go on
    assert check_stop(2, 2, p, eos_token_ids={2}) == ("stop", None)
    assert check_stop(7, 2, p, eos_token_ids={2}) == ("stop", 7)
    assert check_stop(3, 2, p, eos_token_ids={2}, stop_string="###") == ("stop", "###")
    assert check_stop(3, 5, p, eos_token_ids={2}) == ("length", None)
    assert check_stop(3, 3, p, eos_token_ids={2}, num_tokens=100, max_model_len=100) == ("length", None)
    assert check_stop(2, 2, p.clone(ignore_eos=True), eos_token_ids={2}) is None
    assert is_stop_token(2, 2, p, {2}) and is_stop_token(7, 2, p, {2}) and not is_stop_token(7, 1, p, {2})
