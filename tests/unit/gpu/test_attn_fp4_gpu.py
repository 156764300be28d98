"""The CUDA FP4 decode attention kernel (`cuda_attn.kernel_name`) in several launch
configurations, on the H200 (skipped without a GPU and CuPy): > 40 dB SQNR per sequence against
fp32 attention over the dequantized cache and against the Triton kernel."""

from __future__ import annotations

import pytest
import torch
from test_kernels_gpu import DEV, sqnr_db

pytestmark = pytest.mark.gpu

CONFIGS = [("ring", 4, 4, 4), ("ring", 4, 5, 3), ("ring", 4, 4, 2), ("ring", 8, 2, 2)]


def _peaky_fp4_cache(b: int, cap: int, seed: int):
    """FP4 cache with random codes/scales and per-token row scales that vary (0.06-0.25), so
    the scores spread over several units and the softmax is far from uniform."""
    from trace_common.kernels import attention as attn

    g = torch.Generator(device=DEV).manual_seed(seed)
    cache = attn.KVCacheGPU.allocate(fp4=True, batch=b, kv_heads=4, capacity=cap, head_dim=128,
                                     device=DEV)  # fmt: skip
    cache.fill_random_(g)
    cache.row_scales.uniform_(0.0625, 0.25, generator=g)
    q = (3 * torch.randn(b, 32, 128, device=DEV, generator=g)).bfloat16()
    return cache, q


# lengths: 1, below / at / above one 16-token tile, past a split, up to 32K + 1; odd
# capacities (row-scale rows start at odd offsets and the block-scale rows are 8-byte aligned
# only); a batch where every sequence ends mid-tile
@pytest.mark.parametrize("b,cap,lens", [
    (1, 41, [1]), (1, 301, [17]), (1, 33001, [32769]),
    (8, 9001, [1, 15, 16, 17, 1000, 4097, 8191, 9001]),
    (8, 33001, [32769, 31, 20000, 4097, 1, 16385, 777, 33001]),
    (4, 2053, [2053, 2047, 1025, 513]),
])  # fmt: skip
@pytest.mark.parametrize("config", CONFIGS)
def test_fp4_attention_kernels(b, cap, lens, config, monkeypatch):
    pytest.importorskip("cupy", reason="the CUDA attention kernel is launched through CuPy")
    from trace_common.kernels import attention as attn
    from trace_common.kernels import cuda_attn

    monkeypatch.setattr(cuda_attn, "_CONFIG", [config])  # the config in force
    cache, q = _peaky_fp4_cache(b, cap, seed=cap + 3 * b)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    plan = attn.DecodeAttnPlan.make(batch=b, q_heads=32, kv_heads=4, capacity=cap, head_dim=128,
                                    context_hint=max(lens), device=DEV, cuda_fp4=True)  # fmt: skip
    out = torch.full((b, 32 * 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    attn.decode_attention(q, cache, lens_t, plan, out=out, impl="cuda")
    ref = attn.attention_reference(q, attn.dequantize_cache(cache), lens_t)
    assert torch.isfinite(out.float()).all(), f"{config}: unwritten or non-finite outputs"
    for i in range(b):
        got = sqnr_db(ref[i], out[i])
        assert got > 40, f"{config}, sequence {i} (len {lens[i]}): {got:.1f} dB <= 40"
    tri = attn.decode_attention(q, cache, lens_t, plan, impl="triton")
    assert sqnr_db(tri, out) > 40, f"{config} vs Triton: {sqnr_db(tri, out):.1f} dB"


def test_fp4_attention_ignores_garbage_past_len(monkeypatch):
    """Cache slots at and past lens[b] hold NaN row scales and NaN e4m3 block scales (0x7F):
    the ring kernel zero-fills them instead of reading them, so the output stays finite and
    equal to the clean cache's."""
    pytest.importorskip("cupy", reason="the CUDA attention kernel is launched through CuPy")
    from trace_common.kernels import attention as attn
    from trace_common.kernels import cuda_attn

    monkeypatch.setattr(cuda_attn, "_CONFIG", [("ring", 4, 4, 4)])
    b, cap, lens = 3, 1200, [1000, 7, 333]
    cache, q = _peaky_fp4_cache(b, cap, seed=11)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    plan = attn.DecodeAttnPlan.make(batch=b, q_heads=32, kv_heads=4, capacity=cap, head_dim=128,
                                    context_hint=max(lens), device=DEV, cuda_fp4=True)  # fmt: skip
    clean = attn.decode_attention(q, cache, lens_t, plan, impl="cuda").clone()
    for i, n in enumerate(lens):
        cache.row_scales[:, i, n:] = float("nan")
        cache.scales[:, i, :, n:] = 0x7F
    dirty = attn.decode_attention(q, cache, lens_t, plan, impl="cuda")
    assert torch.equal(clean, dirty), "data past lens[b] changed the output"
