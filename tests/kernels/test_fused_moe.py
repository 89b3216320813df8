"""The fused mixture-of-experts kernels (rooflm/kernels/fused_moe.py) against the reference expert loop
(``rooflm.models.mixtral.moe_forward``), on CUDA or under Triton's interpreter.

The plan (pairs grouped by expert, padded to whole tiles) is checked for its invariants and for the one-program Triton
form equalling the torch form bit for bit; the MoE output for every top-k, ragged sizes, expert parallelism (only
some experts local, the others' pairs adding zero), the decode and prefill tile shapes and three dtypes."""
import pytest
import torch

from kernel_checks import assert_close


def _routing(t: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from rooflm.models.mixtral import route_topk

    g = torch.Generator().manual_seed(seed)
    return route_topk(torch.randn(t, num_experts, generator=g), top_k)


def _check_plan(plan, ids: torch.Tensor, num_local: int, start: int) -> None:
    """Every local pair exactly once, in order within its expert; every tile of one expert; used tiles first."""
    sorted_pairs = plan.sorted_pairs.cpu().tolist()
    block_expert = plan.block_expert.cpu().tolist()
    flat = ids.reshape(-1).cpu().tolist()
    bm = plan.block_m
    assert len(sorted_pairs) == len(block_expert) * bm
    used = [b for b, e in enumerate(block_expert) if e >= 0]
    assert used == list(range(len(used)))  # the unused tiles are at the end
    seen = []
    for b in used:
        tile = [p for p in sorted_pairs[b * bm:(b + 1) * bm] if p != plan.num_pairs]
        assert all(flat[p] - start == block_expert[b] for p in tile)
        seen += tile
    assert all(p == plan.num_pairs for b in range(len(used), len(block_expert))
               for p in sorted_pairs[b * bm:(b + 1) * bm])
    local = [p for p, e in enumerate(flat) if start <= e < start + num_local]
    assert sorted(seen) == local and len(seen) == len(set(seen))
    by_expert = sorted(local, key=lambda p: (flat[p], p))
    assert seen == by_expert  # experts in order, pairs in order within each
    counts = [sum(1 for p in local if flat[p] - start == e) for e in range(num_local)]
    assert len(used) == sum(-(-c // bm) for c in counts)  # no tile more than the padding needs
    assert block_expert == sorted(block_expert, key=lambda e: (e < 0, e))


@pytest.mark.parametrize("t,num_experts,top_k,num_local,start,block_m", [
    (1, 8, 2, 8, 0, 16), (3, 8, 2, 8, 0, 16), (40, 8, 2, 8, 0, 16), (40, 8, 2, 4, 4, 16), (40, 8, 2, 4, 0, 64),
    (7, 16, 4, 8, 8, 16), (5, 4, 1, 2, 2, 16), (300, 8, 2, 8, 0, 16), (1, 8, 2, 2, 6, 16)])
def test_plan_groups_every_local_pair_once_in_whole_tiles(device, t, num_experts, top_k, num_local, start, block_m):
    from rooflm.kernels.fused_moe import moe_align

    _, ids = _routing(t, num_experts, top_k, seed=t + start)
    ids = ids.to(device)
    plans = [moe_align(ids, num_local, start, block_m, method=m) for m in ("triton", "torch")]
    for plan in plans:
        _check_plan(plan, ids, num_local, start)
    assert torch.equal(plans[0].sorted_pairs, plans[1].sorted_pairs)
    assert torch.equal(plans[0].block_expert, plans[1].block_expert)


def test_the_tile_bound_holds_for_the_routing_that_needs_the_most_tiles(device) -> None:
    """Every expert one pair past a whole tile (17 pairs of 16-row tiles): 16 tiles, exactly ``max_blocks``."""
    from rooflm.kernels.fused_moe import max_blocks, moe_align

    ids = torch.arange(8).repeat_interleave(17)[torch.randperm(136, generator=torch.Generator().manual_seed(0))]
    ids = ids.view(68, 2).to(device)
    assert max_blocks(136, 8, 16) == 16
    for method in ("triton", "torch"):
        plan = moe_align(ids, 8, 0, 16, method=method)
        _check_plan(plan, ids, 8, 0)
        assert (plan.block_expert >= 0).all()  # every tile used


def test_large_steps_take_the_torch_plan_and_bad_methods_are_refused(device) -> None:
    from rooflm.kernels.fused_moe import ALIGN_ONE_PROGRAM_MAX, moe_align

    t = ALIGN_ONE_PROGRAM_MAX // 8  # 2 * t pairs x 8 experts: past the one-program limit
    _, ids = _routing(t, 8, 2, seed=1)
    ids = ids.to(device)
    auto = moe_align(ids, 8)
    _check_plan(auto, ids, 8, 0)
    assert torch.equal(auto.sorted_pairs, moe_align(ids, 8, method="torch").sorted_pairs)
    with pytest.raises(ValueError, match="method='cub'"):
        moe_align(ids, 8, method="cub")


def _reference(x, w13, w2, weights, ids, start):
    from rooflm.kernels.activation import silu_and_mul_ref
    from rooflm.models.mixtral import moe_forward

    return moe_forward(x, w13, w2, weights.to(x.device), ids.to(x.device), silu_and_mul_ref, expert_start=start)


def _weights(num_local, hidden, inter, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_local, hidden, inter, generator=g) / inter ** 0.5
    return w13.to(dtype).to(device), w2.to(dtype).to(device)


CASES = [  # t, experts, top_k, local experts, first local expert, hidden, intermediate
    (1, 8, 2, 8, 0, 64, 96), (6, 8, 2, 8, 0, 72, 40), (37, 8, 2, 8, 0, 64, 96), (37, 8, 2, 4, 4, 64, 96),
    (9, 4, 1, 4, 0, 32, 48), (20, 16, 4, 8, 8, 64, 64), (2, 8, 2, 2, 2, 48, 80)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,num_experts,top_k,num_local,start,hidden,inter", CASES)
def test_fused_moe_equals_the_expert_loop(device, dtype, t, num_experts, top_k, num_local, start, hidden, inter):
    from rooflm.kernels.fused_moe import fused_moe

    g = torch.Generator().manual_seed(t * 7 + hidden)
    x = torch.randn(t, hidden, generator=g).to(dtype).to(device)
    w13, w2 = _weights(num_local, hidden, inter, dtype, device, seed=t)
    weights, ids = _routing(t, num_experts, top_k, seed=t + 1)
    weights, ids = weights.to(device), ids.to(device)
    out = fused_moe(x, w13, w2, weights, ids, start, num_experts)
    ref = _reference(x, w13, w2, weights, ids, start)
    assert out.shape == ref.shape and out.dtype == dtype
    # On a GPU, float32 tl.dot runs in IEEE precision here (the kernel asks for it), so float32 is held to float32.
    assert_close(out, ref, dtype, f"fused MoE {dtype}", scale=ref.abs().max().item())
    assert torch.equal(fused_moe(x, w13, w2, weights, ids, start, num_experts), out)  # a fixed order of sums
    if num_local < num_experts:  # a token none of whose experts is local gets exactly zero here
        local = ((ids >= start) & (ids < start + num_local)).any(dim=1)
        assert not (out[~local] != 0).any()


@pytest.mark.parametrize("block_m", [16, 32])
def test_prefill_tiles_equal_decode_tiles(device, block_m):
    """The larger tiles of a long step give the small tiles' result (float32: the same sums up to reassociation)."""
    from rooflm.kernels.fused_moe import MoEGemmConfig, fused_moe

    t, hidden, inter = 70, 64, 96
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(3)).to(device)
    w13, w2 = _weights(8, hidden, inter, torch.float32, device, seed=4)
    weights, ids = _routing(t, 8, 2, seed=5)
    w, ids = weights.to(device), ids.to(device)
    small = fused_moe(x, w13, w2, w, ids, configs=(MoEGemmConfig(16, 32, 32, 4, 1),) * 2)
    big = fused_moe(x, w13, w2, w, ids,
                    configs=(MoEGemmConfig(block_m, 64, 64, 4, 2), MoEGemmConfig(block_m, 32, 64, 4, 2)))
    ref = _reference(x, w13, w2, weights, ids, 0)
    assert_close(small, ref, torch.float32, "16-row tiles", scale=ref.abs().max().item())
    assert_close(big, ref, torch.float32, f"{block_m}-row tiles", scale=ref.abs().max().item())


def test_empty_steps_and_bad_shapes(device) -> None:
    from rooflm.kernels.fused_moe import MoEGemmConfig, fused_moe

    w13, w2 = _weights(4, 32, 48, torch.float32, device, seed=0)
    weights, ids = _routing(0, 4, 2, seed=0)
    assert fused_moe(torch.empty(0, 32, device=device), w13, w2, weights.to(device), ids.to(device)).shape == (0, 32)
    weights, ids = _routing(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"w13 \(4, 96, 32\) and w2 \(4, 32, 40\)"):
        fused_moe(torch.randn(3, 32, device=device), w13, w2[..., :40], weights.to(device), ids.to(device))
    with pytest.raises(ValueError, match=r"block_m differ \(16, 32\)"):
        fused_moe(torch.randn(3, 32, device=device), w13, w2, weights.to(device), ids.to(device),
                  configs=(MoEGemmConfig(16, 32, 32, 4, 1), MoEGemmConfig(32, 32, 32, 4, 1)))
    with pytest.raises(ValueError, match=r"topk_ids \(3, 2\) and topk_weights \(3, 1\) must both be \[3, top_k\]"):
        fused_moe(torch.randn(3, 32, device=device), w13, w2, weights[:, :1].to(device), ids.to(device))
    with pytest.raises(ValueError, match=r"topk_ids \(2, 2\)"):
        fused_moe(torch.randn(3, 32, device=device), w13, w2, weights[:2].to(device), ids[:2].to(device))
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(torch.randn(32, 3, device=device).t(), w13, w2, weights.to(device), ids.to(device))
