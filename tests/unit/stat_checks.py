"""Statistical checks shared by the sampling tests."""
from __future__ import annotations

import math

import torch


def chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's chi-square of observed ``counts`` against ``probs``, over the cells expecting more than 5."""
    n = counts.sum().item()
    exp = probs * n
    keep = exp > 5
    chi2 = (((counts - exp) ** 2) / exp)[keep].sum().item()
    dof = int(keep.sum()) - 1
    return chi2 < dof + 6 * math.sqrt(2 * dof)  # ~4 sigma: fails only on a real mismatch
