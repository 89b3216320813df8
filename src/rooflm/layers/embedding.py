"""Token embedding and the output projection (LM head), which may share the embedding's weight."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rooflm.layers.custom_op import CustomOp
from rooflm.layers.linear import QuantizableMixin, linear_native, linear_triton


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] long -> [num_tokens, hidden]."""
        return F.embedding(input_ids, self.weight)


class LMHead(QuantizableMixin, CustomOp):
    """Hidden states to float32 logits. With ``tie_to`` it reuses that embedding's weight (no copy).

    ``set_packed`` / ``set_fp8`` (``QuantizableMixin``) give it a quantized weight of its own; a tied head then
    keeps only the quantized copy, and the embedding keeps its float weight (a lookup reads floats)."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.in_features = hidden_size
        self.out_features = vocab_size
        self.bias = None
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight  # the same Parameter object: one tensor in memory
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

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
