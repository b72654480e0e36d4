"""The masked decode kernel: where a stage uses it, and (on a CUDA device) that it attends as mlx-lm's masked
attention does. CI has no GPU: there the kernel test is skipped and stages keep mlx-lm's attention, which every
other test checks; on a GPU machine ``python -m pytest tests/test_masked_decode_kernel.py`` runs it."""

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention

from stage_worker.model.masked_decode_kernel import attend, decode_kernel_wanted, supported


def test_the_kernel_is_wanted_only_on_cuda_unless_turned_off():
    assert decode_kernel_wanted("auto", "cuda")
    assert not decode_kernel_wanted("off", "cuda")
    assert not decode_kernel_wanted("auto", "cpu")
    assert not decode_kernel_wanted("auto", "metal")


def test_it_does_not_apply_off_cuda_or_to_several_queries_a_row():
    q, k = mx.zeros((2, 8, 1, 64)), mx.zeros((2, 4, 256, 64))
    cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
    assert supported(q, k) == cuda
    assert not supported(mx.zeros((2, 8, 3, 64)), k)  # a verification's several tokens
    assert not supported(mx.zeros((2, 8, 1, 80)), mx.zeros((2, 4, 256, 80)))  # a head dim not a multiple of 32


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("batch,q_heads,kv_heads,head_dim", [(1, 32, 8, 64), (16, 32, 8, 64), (5, 40, 8, 128),
                                                             (3, 16, 16, 128), (2, 8, 8, 256)])
@pytest.mark.parametrize("end,capacity", [(1, 256), (37, 256), (1500, 1536)])
def test_each_row_attends_its_window_as_mlx_lm_masked_attention_does(dtype, batch, q_heads, kv_heads, head_dim,
                                                                     end, capacity):
    mx.random.seed(batch * end)
    q = mx.random.normal((batch, q_heads, 1, head_dim)).astype(dtype)
    keys = (2 * mx.random.normal((batch, kv_heads, capacity, head_dim))).astype(dtype)
    values = mx.random.normal((batch, kv_heads, capacity, head_dim)).astype(dtype)
    starts = mx.array([(7 * i) % end for i in range(batch)], dtype=mx.int32)  # each row's left padding
    scale = head_dim**-0.5
    got = attend(q, keys, values, starts, mx.array([end], dtype=mx.int32), scale)

    mask = create_causal_mask(1, offset=end - 1, left_padding=starts)
    as32 = [a[..., :end, :].astype(mx.float32) for a in (keys, values)]
    exact = scaled_dot_product_attention(q.astype(mx.float32), *as32, cache=None, scale=scale, mask=mask)
    mlx_lm = scaled_dot_product_attention(q, keys[..., :end, :], values[..., :end, :], cache=None, scale=scale,
                                          mask=mask)
    # No further from float32 attention than mlx-lm's own attention in the same dtype (twice, for rounding).
    ours = mx.abs(got.astype(mx.float32) - exact).max().item()
    theirs = mx.abs(mlx_lm.astype(mx.float32) - exact).max().item()
    assert ours <= max(2 * theirs, 1e-4), (ours, theirs)
