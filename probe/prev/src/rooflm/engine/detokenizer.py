"""Incremental detokenization of one sequence, with stop strings and streaming-safe deltas.

Decoding token by token is wrong for byte-level BPE: one character (Japanese, emoji) may be split over several
tokens, each of which decodes alone to U+FFFD. Like vLLM and HF's TextStreamer we decode a small window: the tokens
already turned into text since the previous emission (``ids[prefix_offset:read_offset]``, for context such as a
leading space) and the same window plus the pending tokens (``ids[prefix_offset:]``). The new text is the difference,
emitted only once it no longer ends with U+FFFD (an incomplete character).

Text states, with their invariants (lengths in characters of ``output_text``):

    0 <= sent <= len(output_text)       ``sent``: given out by get_delta()/flush(), never retracted
    held = output_text[sent:]           withheld while its tail could still begin a stop string

``output_text`` only grows, except when a stop string is found: then it is cut at the stop string (or after it with
``include_stop_str_in_output``), and the cut never reaches text already sent (that tail was held back).
"""
from __future__ import annotations

from typing import Any

from rooflm.sampling_params import SamplingParams

# Prompt tokens decoded as left context of the first generated token (as vLLM does), so e.g. a SentencePiece
# leading space decodes as it would in the full text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop_strings: list[str] = list(params.stop or [])
        self._max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        # All ids decoded so far: a few prompt tokens for context, then every appended output token.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # ids before this are in the text (or are prompt context)
        self._prefix_text = self._decode(self._ids)  # decode(ids[prefix_offset:read_offset])
        self.num_output_tokens = 0
        self._text = ""
        self._sent = 0  # characters of _text given out by get_delta()/flush()
        self._checked = 0  # characters of _text already searched for stop strings
        self.stop_string: str | None = None  # the stop string that ended the output, if any
        self.finished = False

    # -- decoding -------------------------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_pending(self, allow_incomplete: bool) -> str:
        """Text of the tokens after read_offset, or "" if it would end in an incomplete character."""
        if self._read_offset == len(self._ids):
            return ""
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text):
            return ""  # nothing new yet (e.g. only skipped special tokens)
        if full.endswith(_REPLACEMENT_CHAR) and not allow_incomplete:
            return ""  # the last character is still incomplete: wait for its remaining bytes
        delta = full[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta

    # -- public API -----------------------------------------------------------------------------------------------

    def append(self, token_id: int, is_stop_token: bool = False) -> str | None:
        """Feed one generated token. Returns the stop string if the output now contains one (the text is then cut
        before it, or after it with ``include_stop_str_in_output``, and later tokens are ignored).

        ``is_stop_token``: the engine ends the sequence on this token (EOS or one of ``stop_token_ids``); as in vLLM
        it is then left out of the text unless ``include_stop_str_in_output``.
        """
        if self.finished:
            return None
        self.num_output_tokens += 1
        if is_stop_token and not self.params.include_stop_str_in_output:
            return None
        self._ids.append(int(token_id))
        self._text += self._decode_pending(allow_incomplete=False)
        return self._check_stop()

    def _check_stop(self) -> str | None:
        """Search the text added since the last check (plus an overlap for strings spanning it)."""
        if not self.stop_strings or len(self._text) == self._checked:
            return None
        checked, self._checked = self._checked, len(self._text)
        # vLLM: stop strings count only once more than min_tokens tokens were generated; an occurrence that ended
        # earlier is ignored for good.
        if self.num_output_tokens <= self.params.min_tokens:
            return None
        best: tuple[int, int, str] | None = None  # (start, -len, stop): earliest start, then the longest
        for stop in self.stop_strings:
            # Only occurrences that end in the new text: start late enough to overlap it.
            i = self._text.find(stop, max(0, checked - len(stop) + 1))
            if i >= 0 and (best is None or (i, -len(stop)) < best[:2]):
                best = (i, -len(stop), stop)
        if best is None:
            return None
        start, _, stop = best
        end = start + len(stop) if self.params.include_stop_str_in_output else start
        assert end >= self._sent, "a stop string must never retract text already streamed"
        self._text = self._text[:end]
        self._checked = len(self._text)
        self.stop_string = stop
        self.finished = True
        return stop

    @property
    def output_text(self) -> str:
        """The full text so far (cut at a stop string); never ends in an incomplete multi-byte character."""
        return self._text

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        if self.finished or not self.stop_strings:
            return 0
        text = self._text
        for n in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return n
        return 0

    def get_delta(self) -> str:
        """New text since the last get_delta(), safe to stream: it is never retracted later."""
        end = max(self._sent, len(self._text) - self._held_back())
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def flush(self) -> str:
        """At finish: decode what is still pending (an incomplete character decodes to U+FFFD), release the text
        held back for stop strings, and return everything not yet given out (none of a stop string cut away)."""
        if not self.finished:
            self._text += self._decode_pending(allow_incomplete=True)
            self._check_stop()
            self.finished = True
        delta = self._text[self._sent :]
        self._sent = len(self._text)
        return delta
