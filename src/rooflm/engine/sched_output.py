"""What the scheduler decides for one step: plain data that the model runner executes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rooflm.sampling_params import SamplingParams


@dataclass
class ScheduledSeq:
    """One sequence's share of the step: compute the KV of ``token_ids`` at positions
    ``[num_computed_tokens, num_computed_tokens + len(token_ids))``."""

    seq_id: str
    request_id: str
    token_ids: list[int]  # the new tokens to compute this step
    num_computed_tokens: int  # tokens with KV in the cache before this step
    block_ids: list[int]  # the sequence's block table (covers num_computed_tokens + len(token_ids) slots)
    # Sampling: set when this chunk reaches the end of the sequence's known tokens.
    sample: bool
    params: "SamplingParams"
    # One row per sample drawn from this chunk's last logits: several when the leader of an n > 1 request finishes
    # its prompt (its samples fork here), else one.
    generators: list["torch.Generator | None"] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)  # per row, for penalties
    prompt_token_ids: list[int] = field(default_factory=list)  # for the repetition penalty
    ban_token_ids: list[int] = field(default_factory=list)  # EOS/stop ids masked while under min_tokens
    prompt_logprobs: bool = False  # return logprobs of the prompt tokens in this chunk

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # in batch order
    preempted_seq_ids: list[str] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) before the step

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
