"""GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers").

For a linear layer y = x W^T, GPTQ minimises the layer-output error ||X W^T - X Q^T||^2 over the calibration inputs X
one input column at a time: quantizing column j leaves an error that the not yet quantized columns absorb, weighted
by the inverse Hessian H^-1 of that objective (H = 2 X^T X). With the upper Cholesky factor U of H^-1, the update
after column j is ``W[:, j+1:] -= err_j * U[j, j+1:] / U[j, j]`` (the paper's Algorithm 1). Updates are applied
lazily in blocks of 128 columns so most of the work is one matrix product per block.

- dampening: ``percdamp * mean(diag H)`` is added to the diagonal (1 % by default) so H is safely invertible;
- group-wise grids: a group's scale and zero point are computed from the (already error-updated) weights when the
  group's first column is reached;
- act-order (``desc_act``): columns are processed by decreasing diag(H), the most sensitive input features first;
  groups are formed in that order, so ``g_idx`` (the group of each input feature) is no longer sorted.
"""
from __future__ import annotations

import torch

from rooflm.quantization.formats import IntQuant
from rooflm.quantization.zeropoint import group_params, quantize_codes, search_group_params


class HessianAccumulator:
    """Running ``H = 2 / n * sum x x^T`` over calibration inputs x [..., K]: each batch's product in float32 (a
    float64 matmul costs several times more on a CPU), the running sum in float64."""

    def __init__(self, in_features: int) -> None:
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        if m == 0:
            return
        self.h *= self.n / (self.n + m)
        self.n += m
        self.h += (2.0 / self.n) * (x.t() @ x).to(self.h.device, torch.float64)

    def hessian(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError("no calibration inputs reached this layer: its Hessian is empty")
        return self.h.float()


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, desc_act: bool = False,
                  percdamp: float = 0.01, blocksize: int = 128, min_zero: int = 0,
                  search_grid: bool = False) -> IntQuant:
    """GPTQ-quantize float w [N, K] given the layer's Hessian [K, K]. Returns the codes, float16-exact scales,
    integer zero points and (with ``desc_act``) g_idx, in input-feature order. ``search_grid``: each group's grid
    from ``search_group_params`` (the smallest squared error of the group's current weights) instead of their min
    and max."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: expected 4 or 8")
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected {(k, k)}")
    if not 0 < percdamp < 1:
        raise ValueError(f"percdamp={percdamp} must lie in (0, 1)")
    W = w.detach().float().clone()
    H = hessian.detach().float().to(W.device).clone()
    dead = torch.diag(H) == 0  # an input feature that was always 0: its weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = None
    if desc_act:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(k, device=H.device)
    U = _inverse_cholesky_upper(H)

    threads = torch.get_num_threads()
    if W.device.type == "cpu":
        # the column loop is thousands of small ops: OpenMP's thread start-up and spinning cost more than they
        # save, tenfold on a busy machine
        torch.set_num_threads(1)
    try:
        return _column_loop(W, U, perm, bits, group_size, blocksize, min_zero, search_grid)
    finally:
        torch.set_num_threads(threads)


def _column_loop(W: torch.Tensor, U: torch.Tensor, perm: torch.Tensor | None, bits: int, group_size: int,
                 blocksize: int, min_zero: int, search_grid: bool = False) -> IntQuant:
    """Algorithm 1 of the paper on W (columns already in processing order) with U = chol(H^-1) upper."""
    n, k = W.shape
    groups = k // group_size
    scales = torch.zeros(n, groups, device=W.device)
    zeros = torch.zeros(n, groups, device=W.device)
    Q = torch.zeros(n, k, device=W.device)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                # the group's current weights: this block's updated columns, then later blocks' pending ones
                end = col + group_size
                cur = torch.cat([W1[:, i:min(i2 - i1, end - i1)], W[:, i2:max(i2, end)]], dim=1)
                s, z = (search_group_params if search_grid else group_params)(cur, bits, min_zero)
                scales[:, col // group_size], zeros[:, col // group_size] = s, z
            s, z = scales[:, col // group_size], zeros[:, col // group_size]
            wcol = W1[:, i]
            q = quantize_codes(wcol.unsqueeze(-1), s, z, bits).squeeze(-1)
            Q[:, col] = q
            err = (wcol - s * (q - z)) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]

    g_idx = None
    if perm is not None:
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(k, device=perm.device)
        Q = Q[:, inv]
        g_idx = inv // group_size  # feature perm[j] was processed j-th: group j // group_size
    return IntQuant(codes=Q.to(torch.int16), scales=scales, zeros=zeros.to(torch.int16), bits=bits,
                    group_size=group_size, g_idx=g_idx)


def _inverse_cholesky_upper(H: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 (float64 for the factorisations). If H is not positive definite after
    dampening (a degenerate calibration set), the dampening is raised tenfold, up to three times."""
    Hd = H.double()
    damp = torch.mean(torch.diag(Hd)) * 0.01
    for attempt in range(4):
        try:
            L = torch.linalg.cholesky(Hd)
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()
        except torch.linalg.LinAlgError:
            if attempt == 3:
                raise ValueError("the calibration Hessian is not positive definite even with extra dampening; "
                                 "use more or more varied calibration text") from None
            Hd = Hd + damp * 10 ** attempt * torch.eye(H.shape[0], dtype=Hd.dtype, device=Hd.device)
    raise AssertionError("unreachable")
