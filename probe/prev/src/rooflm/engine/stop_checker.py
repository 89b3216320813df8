"""When does a sequence stop? Pure functions, in vLLM's order and with its finish reasons; the engine and the
scheduler both ask here, so the rules live in one place.

Stop strings are found by the IncrementalDetokenizer (its ``append`` returns the stop string); pass that result in.
"""
from __future__ import annotations

from collections.abc import Collection

from rooflm.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


def banned_token_ids(num_output_tokens: int, params: SamplingParams, eos_token_ids: Collection[int]) -> list[int]:
    """Ids the sampler must not pick as the next token: EOS (unless ``ignore_eos``) and ``stop_token_ids`` while
    fewer than ``min_tokens`` tokens have been generated (``num_output_tokens`` so far, before this one)."""
    if num_output_tokens >= params.min_tokens:
        return []
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))


def is_stop_token(token_id: int, num_output_tokens: int, params: SamplingParams,
                  eos_token_ids: Collection[int]) -> bool:
    """Whether ``token_id`` (the ``num_output_tokens``-th generated token, counting it) ends the sequence as EOS or
    one of ``stop_token_ids``. Before ``min_tokens`` tokens exist these cannot end it (the sampler bans them)."""
    if num_output_tokens <= params.min_tokens:
        return False
    if token_id in eos_token_ids and not params.ignore_eos:
        return True
    return token_id in params.stop_token_ids


def check_stop(
    token_id: int,
    num_output_tokens: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    stop_string: str | None = None,
    num_tokens: int | None = None,
    max_model_len: int | None = None,
) -> tuple[str, int | str | None] | None:
    """After appending ``token_id`` (``num_output_tokens`` generated so far, ``num_tokens`` prompt + output):
    ``None`` to go on, else ``(finish_reason, stop_reason)``:

    - EOS (unless ``ignore_eos``): ``("stop", None)``; a stop token id: ``("stop", token_id)``;
    - a stop string (from the detokenizer): ``("stop", stop_string)``;
    - ``max_tokens`` reached, or ``max_model_len`` reached: ``("length", None)``.
    """
    if num_output_tokens > params.min_tokens:
        if token_id in eos_token_ids and not params.ignore_eos:
            return FINISH_STOP, None
        if token_id in params.stop_token_ids:
            return FINISH_STOP, token_id
        if stop_string is not None:
            return FINISH_STOP, stop_string
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return FINISH_LENGTH, None
    if max_model_len is not None and num_tokens is not None and num_tokens >= max_model_len:
        return FINISH_LENGTH, None
    return None
