"""Pipeline parallelism (GPipe's layer split, Huang et al. 2019, without micro-batches): rank r holds the decoder
layers of stage r; each step, stage r receives the hidden states and the residual stream from stage r - 1, runs its
layers on them and sends them on. The first stage embeds the tokens; the last applies the final norm and the LM head
and broadcasts the logits, so that every rank samples the same tokens with the same generators and keeps its
``InputBatch`` in step (the same rule as tensor parallelism's gathered logits). At one stage every function here is
the identity of the single-process model.

A step runs its stages one after the other: the split lets a model larger than one device run, it does not make a
step faster. Overlapping the stages needs micro-batches from several steps in flight, which rooflm does not do.
"""
from __future__ import annotations

import torch
from torch import nn

from rooflm.distributed import parallel_state as ps
from rooflm.distributed.partition import shard_range


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the decoder layers stage ``pp_rank`` holds (the first stages take one more when the layers do
    not split evenly)."""
    start, size = shard_range(num_layers, pp_size, pp_rank)
    return start, start + size


class MissingLayer(nn.Module):
    """The place of a decoder layer another stage holds: no parameters, and layer indices (hence weight names) stay
    those of the whole model."""

    def forward(self, *args, **kwargs):  # pragma: no cover - never called: a stage runs only its own layers
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


def receive_activations(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                        pp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) [num_tokens, hidden_size] each, from stage ``pp_rank - 1``."""
    both = ps.pp_recv((2, num_tokens, hidden_size), dtype, pp_rank - 1)
    return both[0], both[1]


def send_activations(hidden: torch.Tensor, residual: torch.Tensor, pp_rank: int) -> None:
    """Hidden states and residual stream to stage ``pp_rank + 1``, in one message."""
    ps.pp_send(torch.stack((hidden, residual)), pp_rank + 1)


def share_logits(logits: torch.Tensor | None, num_rows: int, vocab_size: int, device: torch.device,
                 pp: int) -> torch.Tensor:
    """The last of ``pp`` stages' [num_rows, vocab] float32 logits on every stage (``logits`` itself at one stage;
    None on the stages without the LM head, which receive them)."""
    if pp == 1:
        return logits
    if logits is None:
        logits = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    return ps.pp_broadcast(logits.contiguous(), pp - 1)
