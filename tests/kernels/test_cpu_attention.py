"""The CPU attention backend against the reference backend, through the protocol a model calls."""
import pytest
import torch
from kernel_checks import check_backend

from rooflm.attention.cpu_backend import CpuAttention
from rooflm.layers.custom_op import OpSelection


CASES = [
    # (heads, kv_heads, head_dim, block_size, cached tokens, new tokens, window)
    (4, 4, 16, 4, [0], [9], None),  # one prompt, plain multi-head attention
    (6, 2, 16, 4, [0], [13], None),  # grouped-query prompt
    (6, 2, 16, 4, [10], [1], None),  # batch-1 decode
    (6, 2, 16, 4, [10, 3, 17], [1, 1, 1], None),  # batched decode, different lengths
    (6, 3, 16, 8, [5, 0], [7, 4], None),  # chunked prefill beside a new prompt
    (4, 2, 16, 4, [12, 2], [1, 1], 5),  # decode with a sliding window
    (4, 2, 16, 4, [9], [6], 4),  # prefill with a sliding window
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_backend_matches_reference(case, dtype):
    heads, kv_heads, head_dim, block, ctx, new, window = case
    check_backend(heads, kv_heads, head_dim, block, ctx, new, window, dtype=dtype, backend_cls=CpuAttention)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[4], CASES[6]])
def test_cpu_backend_with_a_quantized_cache(case, kv_cache_dtype):
    heads, kv_heads, head_dim, block, ctx, new, window = case
    check_backend(heads, kv_heads, head_dim, block, ctx, new, window, dtype=torch.float32,
                  kv_cache_dtype=kv_cache_dtype, backend_cls=CpuAttention)


def test_auto_chooses_cpu_backend_on_cpu_only():
    assert OpSelection(torch.device("cpu")).attention_impl() == "cpu"
    assert OpSelection(torch.device("cpu")).impl() == "cpu"
    assert OpSelection(torch.device("cpu"), ops="native").attention_impl() == "torch"
    assert OpSelection(torch.device("meta")).impl() == "native"


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_rotary_over_views_of_one_qkv_row_equals_separate_tensors(num_tokens):
    """The model hands the backend q, k, v as views of one projection row; the backend then rotates q and k in one
    pass. Same rotated q, same cache as with separate contiguous tensors (where it rotates them one by one)."""
    from kernel_checks import make_step

    heads, kv_heads, dim, block = 6, 2, 16, 4
    g = torch.Generator().manual_seed(3)
    q, k, v, cache, meta = make_step([7], [num_tokens], heads, kv_heads, dim, block, torch.float32, "cpu", g)
    qkv = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)
    qv, kv_, vv = (t.view(num_tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    angles = 10 * torch.rand(num_tokens, dim // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    joint_cache, sep_cache = cache.clone(), cache.clone()
    joint = CpuAttention()
    jq, jk = joint.rotary_and_write(qv, kv_, vv, cos, sin, joint_cache, meta)
    assert jq.data_ptr() + heads * dim * 4 == jk.data_ptr(), "q and k were not rotated as one tensor"
    sq, sk = CpuAttention().rotary_and_write(q.clone(), k.clone(), v.clone(), cos, sin, sep_cache, meta)
    assert torch.equal(jq, sq) and torch.equal(jk, sk)
    assert torch.equal(joint_cache, sep_cache)
    assert torch.equal(joint.attend(jq, joint_cache, meta, dim ** -0.5), CpuAttention().attend(sq, sep_cache, meta,
                                                                                              dim ** -0.5))


def test_layers_of_one_model_share_one_backend_and_models_do_not():
    from rooflm.layers.attention import Attention
    from rooflm.layers.custom_op import op_selection

    with op_selection("cpu", ops="cpu"):
        a, b = Attention(4, 2, 16), Attention(4, 2, 16)
    with op_selection("cpu", ops="cpu"):
        c = Attention(4, 2, 16)
    assert isinstance(a.backend, CpuAttention)
    assert a.backend is b.backend and c.backend is not a.backend
