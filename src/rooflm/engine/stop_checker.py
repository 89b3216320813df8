"""When does a sequence stop? One pure function, in vLLM's order and with its finish reasons.

Stop strings are found by the IncrementalDetokenizer (its ``append`` returns the stop string); pass that result in.
"""
from __future__ import annotations

from rooflm.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


def is_stop_token(token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_id: int | None) -> bool:
    """Whether ``token_id`` (the ``num_output_tokens``-th generated token, counting it) ends the sequence as EOS or
    one of ``stop_token_ids``. Before ``min_tokens`` tokens exist these cannot end it (the sampler bans them)."""
    if num_output_tokens <= params.min_tokens:
        return False
    if eos_token_id is not None and token_id == eos_token_id and not params.ignore_eos:
        return True
    return token_id in params.stop_token_ids


def check_stop(
    token_id: int,
    num_output_tokens: int,
    params: SamplingParams,
    eos_token_id: int | None,
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
        if eos_token_id is not None and token_id == eos_token_id and not params.ignore_eos:
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
