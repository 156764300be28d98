"""Argument checks of the fused-quantize outputs (no GPU needed): FP4Rows.check,
CompactRecordBuffers.check and the wrappers that use them refuse a wrong buffer by name."""

from __future__ import annotations

import pytest
import torch

from trace_common.kernels import cuda_moe, cuda_small
from trace_common.kernels.moe_layout import FP4Rows
from trace_common.kernels.quant import CompactRecordBuffers


def _rows(t: int, k: int, dq16: bool = True) -> FP4Rows:
    return FP4Rows(torch.zeros(t, k // 2, dtype=torch.uint8),
                   torch.zeros(t, k // 16, dtype=torch.uint8), torch.zeros(t),
                   torch.zeros(t, k, dtype=torch.float16) if dq16 else None)  # fmt: skip


def test_good_buffers_pass():
    _rows(3, 64).check(3, 64, "xq")
    _rows(3, 64, dq16=False).check(3, 64, "xq")
    CompactRecordBuffers.allocate(3, 64, "cpu").check(3, 64)
    assert len(cuda_small._quant_args(_rows(3, 64), CompactRecordBuffers.allocate(3, 64, "cpu"),
                                      3, 64)) == 7  # fmt: skip
    cuda_moe._check_quant_out(_rows(8, 32), torch.zeros(4, dtype=torch.int32), 8, 32, 4)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda q: setattr(q, "codes", torch.zeros(3, 31, dtype=torch.uint8)), r"xq\.codes"),
        (lambda q: setattr(q, "scales", torch.zeros(3, 4, dtype=torch.int8)), r"xq\.scales"),
        (lambda q: setattr(q, "scale_2", torch.zeros(3, dtype=torch.float64)), r"xq\.scale_2"),
        (lambda q: setattr(q, "dq16", torch.zeros(64, 3, dtype=torch.float16).t()), r"xq\.dq16"),
    ],
)
def test_fp4_rows_check_names_the_bad_field(bad, message):
    q = _rows(3, 64)
    bad(q)
    with pytest.raises(ValueError, match=message):
        q.check(3, 64, "xq")
    with pytest.raises(ValueError, match=message):
        cuda_small._quant_args(q, None, 3, 64)


def test_record_check_names_the_bad_field():
    rec = CompactRecordBuffers.allocate(3, 64, "cpu")
    rec.row_scales = torch.zeros(4)
    with pytest.raises(ValueError, match=r"capture\.row_scales"):
        rec.check(3, 64)
    with pytest.raises(ValueError, match=r"capture\.row_scales"):
        cuda_small._quant_args(_rows(3, 64), rec, 3, 64)


def test_quant_out_checks():
    with pytest.raises(ValueError, match=r"quant_out\.codes"):
        cuda_moe._check_quant_out(_rows(8, 64), torch.zeros(4, dtype=torch.int32), 8, 32, 4)
    with pytest.raises(ValueError, match="counter"):
        cuda_moe._check_quant_out(_rows(8, 32), torch.zeros(3, dtype=torch.int32), 8, 32, 4)


def test_norm_quant_supported():
    from trace_common.kernels import fused

    assert fused.norm_quant_supported(2048) and fused.norm_quant_supported(16)
    assert not fused.norm_quant_supported(8) and not fused.norm_quant_supported(1536)


@pytest.mark.parametrize("batch,context", [(8, 1024), (32, 1024), (128, 1024), (8, 32768),
                                           (16, 32768)])  # fmt: skip
def test_ring_plan_keeps_one_wave_up_to_capacity(batch, context):
    """The FP4 ring plan is made for the cache's capacity, not the starting length: decoding
    past a split boundary (context + a few tokens) must not need a second wave of CTAs."""
    from trace_common.kernels import attention as attn
    from trace_common.kernels import cuda_attn
    from trace_common.kernels.cuda_launch import sm_resources

    cap = context + 64
    plan = attn.DecodeAttnPlan.make(batch=batch, q_heads=32, kv_heads=4, capacity=cap,
                                    head_dim=128, context_hint=context, device="cpu",
                                    cuda_fp4=True)  # fmt: skip
    slots = cuda_attn.ring_ctas_per_sm() * sm_resources("cpu")[0]
    for length in (context, context + 1, context + 12, cap):
        assert batch * 4 * -(-length // plan.chunk) <= slots, (length, plan.chunk)


def test_fused_chunk_floor(monkeypatch):
    """The fused plan's split is at least FUSED_MIN_CHUNK keys (the wave rule alone would cut
    1K into 17 splits of 64) and stays within FUSED_MAX_SPLITS splits, else 0 (split + reduce)."""
    from trace_common.kernels import attention as attn
    from trace_common.kernels import cuda_attn

    monkeypatch.delenv("TRACE_ATTN_FUSED_CHUNK", raising=False)
    for fp4 in (False, True):
        assert attn.fused_chunk(4, 1024, fp4=fp4, sms=132) == cuda_attn.FUSED_MIN_CHUNK
        assert attn.fused_chunk(4, 32768, fp4=fp4, sms=132) == 0
