"""Token embedding and the output projection (LM head), which may share the embedding's weight.

Under tensor parallelism both are vocab-parallel: each rank holds a contiguous range of vocabulary rows
(``rooflm.distributed.partition.shard_range``). The embedding looks up the ids in its range, zeros the others, and
an all-reduce adds the ranks' rows; the head computes the logits of its range and an all-gather concatenates them,
so every rank holds the full logits and samples the same tokens (vLLM v1 does the same)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rooflm.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from rooflm.distributed.partition import Shard, shard_range, split_sizes
from rooflm.layers.custom_op import CustomOp
from rooflm.layers.linear import QuantizableMixin, linear_native, linear_triton


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_size = get_tp_size()
        self.vocab_size = vocab_size
        self.vocab_start, self.num_local = shard_range(vocab_size, self.tp_size, get_tp_rank())
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)

    @property
    def shard(self) -> Shard | None:
        """The rows of the checkpoint's [vocab, hidden] tensor this rank holds (None: all)."""
        return None if self.tp_size == 1 else Shard(0, self.vocab_start, self.num_local)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] long -> [num_tokens, hidden]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return tp_all_reduce(rows)


class LMHead(QuantizableMixin, CustomOp):
    """Hidden states to float32 logits. With ``tie_to`` it reuses that embedding's weight (no copy).

    ``set_packed`` / ``set_fp8`` (``QuantizableMixin``) give it a quantized weight of its own; a tied head then
    keeps only the quantized copy, and the embedding keeps its float weight (a lookup reads floats)."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tp_size = get_tp_size()
        self.vocab_sizes = split_sizes(vocab_size, self.tp_size)  # every rank's logits width, for the all-gather
        self.vocab_start, local = shard_range(vocab_size, self.tp_size, get_tp_rank())
        self.in_features = hidden_size
        self.out_features = local
        self.bias = None
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight  # the same Parameter object: one tensor in memory
        else:
            self.weight = nn.Parameter(torch.empty(local, hidden_size), requires_grad=False)

    @property
    def shard(self) -> Shard | None:
        """The rows of the checkpoint's [vocab, hidden] tensor this rank holds (None: all)."""
        return None if self.tp_size == 1 else Shard(0, self.vocab_start, self.out_features)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """hidden: [N, hidden] -> [N, vocab] float32 (every rank's vocabulary range, gathered)."""
        logits = self._impl_fn(self, hidden)
        return logits if self.tp_size == 1 else tp_all_gather(logits, self.vocab_sizes)

    def _set_impl(self, impl: str) -> None:
        super()._set_impl(impl)
        if self.quant is not None:
            matmul = self._quant_impl(impl)
            self._impl_fn = lambda layer, hidden: matmul(layer, hidden).float()

    def forward_native(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32."""
        return linear_native(hidden, self.weight).float()

    def forward_cuda(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear_triton(hidden, self.weight).float()
