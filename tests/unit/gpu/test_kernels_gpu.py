"""GPU kernels vs the plain-PyTorch reference (run on a CUDA GPU; skipped elsewhere).

Bit-exact (rtol=0, atol=0) where the algorithm is the same: NVFP4 quantize (codes, e4m3 block
scales, fp32 row/tensor scales), the compact guidance record, the FP4 KV append, and the
routing block layout. SQNR bounds (stated in each assertion) where accumulation order differs:
grouped expert GEMMs and decode attention.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref = ref.double()
    err = (ref - got.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-300)))


def _nasty(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows spanning 1e-12 .. 1e3 in magnitude, with zero blocks and a zero row."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=DEV)
    mag = torch.logspace(-12, 3, shape[-1], device=DEV)[torch.randperm(shape[-1], device=DEV)]
    x = (x * mag).to(dtype)
    x[..., :16] = 0  # an all-zero block in every row
    if x.ndim > 1 and x.shape[0] > 2:
        x[1] = 0  # an all-zero row
    return x


# The reference is compared on the CPU: on CUDA, PyTorch divides a tensor by a Python scalar as
# a multiplication by the reciprocal, so `nvfp4.scale_2_from_amax` (amax / 2688) can land one
# ulp away from the IEEE quotient that ModelOpt's CPU path, the reference and the kernel compute.


def _to_cpu(q):
    from trace_common.fp4.nvfp4 import NVFP4Tensor

    return NVFP4Tensor(q.qdata.cpu(), q.scale.cpu(), q.per_tensor_scale.cpu(), q.shape, q.dtype,
                       q.scale_granularity)  # fmt: skip


@pytest.mark.parametrize("gran", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(33, 128), (5, 768), (64, 2048), (3, 4, 512)])
def test_quantize_bit_exact(shape, dtype, gran):
    from trace_common.fp4 import nvfp4
    from trace_common.fp4.record import make_record
    from trace_common.kernels import quant

    x = _nasty(shape, dtype, seed=sum(shape) + len(str(dtype)) + len(gran))
    ref = nvfp4.quantize(x.cpu(), scale_granularity=gran)  # on the CPU: see the note above _to_cpu
    got, rec = quant.quantize_and_record(x, scale_granularity=gran)
    got, rec = _to_cpu(got), rec.to("cpu")
    assert torch.equal(got.qdata, ref.qdata), "packed E2M1 codes differ from the reference"
    assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8)), "e4m3 scales"
    torch.testing.assert_close(got.per_tensor_scale, ref.per_tensor_scale, rtol=0, atol=0)
    want = make_record(ref, "compact")
    assert torch.equal(rec.payload, want.payload), "mantissa bits differ"
    assert torch.equal(rec.block_scales, want.block_scales)
    torch.testing.assert_close(rec.row_scales, want.row_scales, rtol=0, atol=0)
    torch.testing.assert_close(got.dequantize(), ref.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("gran", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(33, 128), (3, 4, 512), (700, 384)])
def test_fake_quantize_bit_exact_and_used_by_qat(shape, dtype, gran):
    """The kernel's fake quant equals the CPU reference's dequantize(quantize(x)) bit for bit;
    `fp4.fake.fake_quantize` takes it for CUDA tensors, with the straight-through gradient."""
    from trace_common.fp4 import nvfp4
    from trace_common.fp4.fake import fake_quantize
    from trace_common.fp4.fast_path import fast_path_for
    from trace_common.kernels import quant

    x = _nasty(shape, dtype, seed=sum(shape) + len(str(dtype)) + len(gran) + 1)
    ref = nvfp4.dequantize(nvfp4.quantize(x.cpu(), scale_granularity=gran), dtype=dtype)
    bits = {4: torch.int32, 2: torch.int16}[x.element_size()]
    got = quant.fake_quantize(x, scale_granularity=gran)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.cpu().view(bits), ref.view(bits)), (
        "fake quant differs from the reference"
    )
    assert fast_path_for(x) is quant.FAST_PATH
    leaf = x.clone().requires_grad_(True)
    y = fake_quantize(leaf, "nvfp4", scale_granularity=gran)
    assert torch.equal(y.detach().cpu().view(bits), ref.view(bits))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(leaf.grad, g), "straight-through: the gradient passes unchanged"
    bad = x.clone()
    bad.view(-1)[7] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quant.fake_quantize(bad, scale_granularity=gran)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(33, 128), (3, 4, 512), (700, 384)])
def test_guided_quantize_kernel_bit_exact(shape, dtype):
    """Compact NVFP4 records of a rollout whose values differ a little: the kernel's guided
    rounding equals the CPU reference bit for bit, and `guided_quantize` on CUDA takes it,
    with the straight-through gradient."""
    from trace_common.fp4 import nvfp4
    from trace_common.fp4.fast_path import fast_path_for
    from trace_common.fp4.guided import guided_quantize
    from trace_common.fp4.record import make_record
    from trace_common.kernels import quant

    x = _nasty(shape, dtype, seed=sum(shape) + len(str(dtype)) + 2)
    g = torch.Generator(device=DEV).manual_seed(5)
    x_roll = (x.float() * (1 + 0.05 * torch.randn(shape, generator=g, device=DEV))).to(dtype)
    rec = make_record(nvfp4.quantize(x_roll.cpu(), scale_granularity="row"), "compact")
    want = guided_quantize(x.cpu(), rec)
    bits = {4: torch.int32, 2: torch.int16}[x.element_size()]
    got = quant.guided_quantize(x, rec.to(DEV))
    assert torch.equal(got.cpu().view(bits), want.view(bits)), "guided rounding differs"
    assert fast_path_for(x) is quant.FAST_PATH
    leaf = x.clone().requires_grad_(True)
    y = guided_quantize(leaf, rec.to(DEV))
    assert torch.equal(y.detach().cpu().view(bits), want.view(bits))
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(leaf.grad, grad)


@pytest.mark.parametrize("vocab", [37, 1000, 151936])
def test_sampling_kernel_matches_sample_rows(vocab):
    """Same tokens as the scheduler's PyTorch sampler for the same draws (a draw within
    rounding of a token boundary could differ; none of these does), log-probs within 1e-4,
    greedy rows the argmax; the rows are picked out of a larger logits tensor by index."""
    import numpy as np

    from trace_common.kernels.sample import sample_rows_unfiltered
    from trace_common.rollout.scheduler import sample_rows, uniforms

    n = 64
    g = torch.Generator(device=DEV).manual_seed(vocab)
    logits = (torch.randn(n + 5, vocab, generator=g, device=DEV) * 3).to(torch.bfloat16)
    rows = torch.randperm(n + 5, generator=g, device=DEV)[:n]
    temp = torch.rand(n, generator=g, device=DEV) * 1.5 + 0.2
    temp[::5] = 0.0  # greedy
    seeds = np.arange(n, dtype=np.uint64) + 11
    u = torch.from_numpy(uniforms(seeds, np.zeros(n, dtype=np.uint64))).to(DEV)
    none_k, none_p = torch.zeros(n, dtype=torch.long, device=DEV), torch.ones(n, device=DEV)
    want_tok, want_lp = sample_rows(logits[rows], temp, none_k, none_p, u, filtered=False)
    tok, lp = sample_rows_unfiltered(logits, rows, temp, u)
    assert torch.equal(tok, want_tok), (tok != want_tok).nonzero().flatten().tolist()
    assert float((lp - want_lp).abs().max()) < 1e-4
    greedy = temp <= 0
    assert torch.equal(tok[greedy], logits[rows][greedy].float().argmax(-1))


def test_quantize_scale_ties_and_subnormals():
    """Block amaxes that land exactly on e4m3 rounding midpoints, subnormal scales included."""
    from trace_common.fp4 import nvfp4
    from trace_common.kernels import quant

    # e4m3 grid values v and their midpoints; block amax = 6 * scale_2 * midpoint
    grid = torch.tensor(
        [i * 2.0**-9 for i in range(1, 8)] + [2.0**e * (1 + m / 8) for e in range(-6, 9)
                                              for m in range(8)], device=DEV)  # fmt: skip
    grid = grid[grid <= 448]
    mids = (grid[:-1] + grid[1:]) / 2
    rows = mids.numel()
    x = torch.randn(rows, 64, device=DEV) * 0.01
    g = torch.tensor(1.0 / 64, device=DEV)  # exact power of two: 6 * g * mid is exact
    x[:, 0] = 6 * g * mids  # block 0 amax on a midpoint
    x[:, 1:16] = x[:, 1:16].clamp(-1e-6, 1e-6)  # block 0 amax is x[:, 0]
    ref = nvfp4.quantize(x.cpu(), scale_granularity="tensor", per_tensor_scale=g.cpu())
    got = _to_cpu(quant.quantize(x, scale_granularity="tensor", per_tensor_scale=g))
    assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert torch.equal(got.qdata, ref.qdata)


def test_quantize_given_row_scales():
    from trace_common.fp4 import nvfp4
    from trace_common.kernels import quant

    x = _nasty((9, 256), torch.bfloat16, seed=3)
    pts = torch.rand(9, 1, device=DEV) + 0.01
    ref = nvfp4.quantize(x.cpu(), scale_granularity="row", per_tensor_scale=pts.cpu())
    got = _to_cpu(quant.quantize(x, scale_granularity="row", per_tensor_scale=pts))
    assert torch.equal(got.qdata, ref.qdata)
    assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8))


def test_capture_matches_guided_capture():
    from trace_common.fp4 import record
    from trace_common.kernels import quant

    x = _nasty((17, 2048), torch.bfloat16, seed=5)
    for mode in ("compact", "full"):
        xq_ref, rec_ref = record.capture(x.cpu(), "nvfp4", mode)
        xq, rec = quant.capture(x, mode)
        rec = rec.to("cpu")
        torch.testing.assert_close(xq.cpu(), xq_ref, rtol=0, atol=0)
        assert torch.equal(rec.payload, rec_ref.payload)
        assert torch.equal(rec.block_scales, rec_ref.block_scales)


def test_kv_append_fp4_exact_and_capture():
    from trace_common.fp4 import nvfp4
    from trace_common.fp4.record import make_record
    from trace_common.kernels import attention as attn
    from trace_common.kernels.quant import CompactRecordBuffers

    b, hkv, d, s = 3, 4, 128, 100
    cache = attn.KVCacheGPU.allocate(fp4=True, batch=b, kv_heads=hkv, capacity=s, head_dim=d,
                                     device=DEV)  # fmt: skip
    cache.fill_random_()
    kv_new = torch.randn(2, b, hkv * d, device=DEV).bfloat16()
    pos = torch.tensor([0, 57, 99], dtype=torch.int32, device=DEV)
    rec = CompactRecordBuffers.allocate(2 * b, hkv * d, DEV)
    attn.kv_append(cache, kv_new, pos, rec)
    ref = nvfp4.quantize(kv_new.cpu(), scale_granularity="row")  # [2, B, Hkv*D]
    want = make_record(ref, "compact")
    cache.codes, cache.scales, cache.row_scales = (
        cache.codes.cpu(), cache.scales.cpu(), cache.row_scales.cpu())  # fmt: skip
    rec = rec.__class__(rec.mbits.cpu(), rec.block_scales.cpu(), rec.row_scales.cpu())
    for kv in range(2):
        for i in range(b):
            p = int(pos[i])
            got_codes = cache.codes[kv, i, :, p].reshape(-1)
            got_scales = cache.scales[kv, i, :, p].reshape(-1)
            assert torch.equal(got_codes, ref.qdata[kv, i]), f"codes kv={kv} b={i}"
            assert torch.equal(got_scales, ref.scale[kv, i].view(torch.uint8))
            assert float(cache.row_scales[kv, i, p]) == float(ref.per_tensor_scale[kv, i, 0])
    assert torch.equal(rec.mbits, want.payload)
    assert torch.equal(rec.block_scales, want.block_scales)


def _canonical(sorted_pair: torch.Tensor, block_expert: torch.Tensor, block_m: int) -> dict:
    """expert -> sorted pair ids (padding included) of its blocks: the layout up to the order
    of pairs inside an expert, which the atomic slots of the kernel leave arbitrary."""
    rows = sorted_pair.view(-1, block_m)
    return {
        e: torch.sort(rows[block_expert == e].reshape(-1)).values.tolist()
        for e in block_expert.unique().tolist()
        if e >= 0
    }


@pytest.mark.parametrize("t", [1, 8, 37, 128, 256])
def test_route_align_matches_reference(t):
    """fp32 logits (no ties): ids equal torch.topk's. bf16 logits tie often; there the chosen
    probabilities (not the tie order) must equal the reference's. The block layout equals
    align_reference of the kernel's own ids: block -> expert exactly, each expert's pairs and
    padding as a set."""
    from trace_common.kernels import moe

    e, k = 128, 8
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(t, e, device=DEV).to(dtype)
        plan = moe.route_align(logits, k, moe.DECODE_BLOCK_M)
        ids, w = moe.route_reference(logits, k)
        probs = torch.softmax(logits.float(), -1)
        if dtype == torch.float32:
            assert torch.equal(plan.topk_ids, ids), "top-k expert ids"
        chosen = probs.gather(1, plan.topk_ids.long())
        torch.testing.assert_close(chosen, probs.gather(1, ids.long()), rtol=0, atol=0)
        torch.testing.assert_close(plan.topk_w, w, rtol=1e-5, atol=1e-6)
        sp, be = moe.align_reference(plan.topk_ids, e, moe.DECODE_BLOCK_M)
        assert torch.equal(plan.block_expert, be), "block -> expert map"
        got = _canonical(plan.sorted_pair, plan.block_expert, moe.DECODE_BLOCK_M)
        assert got == _canonical(sp, be, moe.DECODE_BLOCK_M), "pairs of each expert"
        assert int(plan.scratch[0].abs().sum()) == 0, "expert counters not reset"


def _moe_setup(t: int, seed: int, e: int = 16, h: int = 512, inter: int = 256, k: int = 4):
    from trace_common.kernels import moe, moe_layout

    torch.manual_seed(seed)
    block_m = moe.DECODE_BLOCK_M if t <= 64 else moe.PREFILL_BLOCK_M
    logits = torch.randn(t, e, device=DEV)
    ids, w = moe.route_reference(logits, k)
    sp, be = moe.align_reference(ids, e, block_m)
    plan = moe_layout.RoutePlan(ids, w, sp, be, block_m)
    x = torch.randn(t, h, device=DEV).bfloat16()
    wgu = (torch.randn(e, 2 * inter, h, device=DEV) * 0.05).bfloat16()
    wd = (torch.randn(e, h, inter, device=DEV) * 0.05).bfloat16()
    return plan, x, wgu, wd, k


def _dequant_experts(ew) -> torch.Tensor:
    from trace_common.fp4.nvfp4 import NVFP4Tensor, dequantize

    out = []
    for i in range(ew.codes.shape[0]):
        q = NVFP4Tensor(ew.codes[i], ew.scales[i].view(torch.float8_e4m3fn), ew.scale_2[i],
                        torch.Size((ew.n, ew.k)), torch.bfloat16)  # fmt: skip
        out.append(dequantize(q))
    return torch.stack(out)


def _dequant_rows(rows) -> torch.Tensor:
    """fp32 values of FP4Rows (codes [R, K/2], e4m3 bytes [R, K/16], scale_2 [R])."""
    from trace_common.fp4.nvfp4 import NVFP4Tensor, dequantize

    r, half = rows.codes.shape
    q = NVFP4Tensor(rows.codes, rows.scales.view(torch.float8_e4m3fn), rows.scale_2[:, None],
                    torch.Size((r, 2 * half)), torch.float32, "row")  # fmt: skip
    return dequantize(q)


@pytest.mark.parametrize("t", [1, 64, 1024])
def test_moe_gemm_bf16(t):
    from trace_common.kernels import moe, moe_layout

    plan, x, wgu, wd, k = _moe_setup(t, seed=t)
    gu = moe_layout.ExpertWeights(n=wgu.shape[1], k=wgu.shape[2], bf16=wgu)
    dn = moe_layout.ExpertWeights(n=wd.shape[1], k=wd.shape[2], bf16=wd)
    act = moe.moe_gemm(x, gu, plan, gated=True, a_div=k, mul_route_w=False)
    y = moe.moe_gemm(act, dn, plan, gated=False, a_div=1, mul_route_w=True)
    ref = moe.moe_reference(x, plan.topk_ids, plan.topk_w, wgu.float(), wd.float(), False)
    assert sqnr_db(ref, y) > 40, f"BF16 grouped GEMM SQNR {sqnr_db(ref, y):.1f} dB <= 40 dB"


@pytest.mark.parametrize("decode", ["bits", "ptx"])
@pytest.mark.parametrize("t", [1, 64, 1024])
def test_moe_gemm_fp4_w4a4(t, decode):
    """Each stage on identical FP4 inputs: only accumulation order (and the bf16 output) differ
    from fp32 math on the dequantized operands."""
    from trace_common.kernels import moe, moe_layout, quant

    plan, x, wgu, wd, k = _moe_setup(t, seed=100 + t)
    gu = moe.quantize_weights(wgu, shared_halves=True)
    dn = moe.quantize_weights(wd, shared_halves=False)
    wgu_dq, wd_dq = _dequant_experts(gu), _dequant_experts(dn)
    xq = moe_layout.FP4Rows(*quant.quantize_rows(x, scale_2=None))
    act = moe.moe_gemm(xq, gu, plan, gated=True, a_div=k, mul_route_w=False, decode=decode)
    inter = wd.shape[2]
    e_of = plan.topk_ids.reshape(-1).long()
    x_dq = _dequant_rows(xq).repeat_interleave(k, 0)  # the codes the kernel consumed
    gu_ref = torch.einsum("ph,pnh->pn", x_dq, wgu_dq[e_of].float())
    act_ref = torch.nn.functional.silu(gu_ref[:, :inter]) * gu_ref[:, inter:]
    assert sqnr_db(act_ref, act) > 40, f"FP4 gate_up SQNR {sqnr_db(act_ref, act):.1f} dB <= 40"
    aq = moe_layout.FP4Rows(*quant.quantize_rows(act, scale_2=None))
    y = moe.moe_gemm(aq, dn, plan, gated=False, a_div=1, mul_route_w=True, decode=decode)
    a_dq = _dequant_rows(aq)
    y_ref = torch.einsum("pi,phi->ph", a_dq, wd_dq[e_of].float()) * plan.topk_w.reshape(-1, 1)
    assert sqnr_db(y_ref, y) > 40, f"FP4 down SQNR {sqnr_db(y_ref, y):.1f} dB <= 40"
    full_ref = moe.moe_reference(x, plan.topk_ids, plan.topk_w, wgu_dq, wd_dq, True)
    assert sqnr_db(full_ref, y) > 25, f"W4A4 chain SQNR {sqnr_db(full_ref, y):.1f} dB <= 25"


@pytest.mark.parametrize("k", [512, 768, 2048])
def test_quantize_dq16_bit_exact(k):
    """The CUDA GEMM's activation operand: fp16 code * block scale * 2**-14 in B-fragment
    order, equal (rtol=0, atol=0) to the reference's dequantized value / scale_2 * 2**-14."""
    from trace_common.fp4 import nvfp4
    from trace_common.kernels import quant
    from trace_common.kernels.cuda_moe import dq16_permutation

    x = _nasty((37, k), torch.bfloat16, seed=k)
    dq = torch.full((37, k), float("nan"), dtype=torch.float16, device=DEV)
    quant.quantize_rows(x, scale_2=None, dq16=dq)
    ref = nvfp4.quantize(x.cpu(), scale_granularity="row")
    vals = nvfp4.dequantize(ref, torch.float32) / ref.per_tensor_scale  # code * block scale
    want = torch.empty(37, k, dtype=torch.float16)
    want.view(37, k // 16, 16)[:, :, dq16_permutation()] = (vals * 2.0**-14).half().view(
        37, k // 16, 16)  # fmt: skip
    assert torch.equal(dq.cpu().view(torch.int16), want.view(torch.int16)), "dq16 bits differ"


@pytest.mark.parametrize("kernel", ["mma", "stream"])
@pytest.mark.parametrize("block_m", [8, 16])
@pytest.mark.parametrize("t", [1, 5, 64, 256])
def test_moe_gemm_fp4_cuda(t, block_m, kernel, monkeypatch):
    """The CUDA kernels on identical FP4 operands: only accumulation order (and the bf16
    output) differ from fp32 math on the dequantized operands; and they match Triton."""
    from trace_common.kernels import cuda_moe, moe, moe_layout, quant

    monkeypatch.setattr(cuda_moe, "KERNEL_FOR", {})  # every shape: DEFAULT_CUDA_KERNEL
    monkeypatch.setattr(cuda_moe, "DEFAULT_CUDA_KERNEL", kernel)

    plan, x, wgu, wd, k = _moe_setup(t, seed=200 + t)
    plan = moe_layout.RoutePlan(plan.topk_ids, plan.topk_w,
                         *moe.align_reference(plan.topk_ids, 16, block_m), block_m)  # fmt: skip
    gu = moe.quantize_weights(wgu, shared_halves=True)
    dn = moe.quantize_weights(wd, shared_halves=False)
    wgu_dq, wd_dq = _dequant_experts(gu), _dequant_experts(dn)
    gu.pack_for_cuda_(keep_rows=True)
    dn.pack_for_cuda_(keep_rows=True)
    h, inter = wgu.shape[2], wd.shape[2]
    xq = moe_layout.FP4Rows(*quant.quantize_rows(x, scale_2=None))
    xq.dq16 = torch.empty(t, h, dtype=torch.float16, device=DEV)
    quant.quantize_rows(x, scale_2=None, dq16=xq.dq16)
    poison = torch.full((t * k, inter), float("nan"), dtype=torch.bfloat16, device=DEV)
    act = moe.moe_gemm(xq, gu, plan, gated=True, a_div=k, mul_route_w=False, out=poison,
                       impl="cuda")  # fmt: skip
    assert torch.isfinite(act.float()).all(), "unwritten output rows"
    e_of = plan.topk_ids.reshape(-1).long()
    x_dq = _dequant_rows(xq).repeat_interleave(k, 0)
    gu_ref = torch.einsum("ph,pnh->pn", x_dq, wgu_dq[e_of].float())
    act_ref = torch.nn.functional.silu(gu_ref[:, :inter]) * gu_ref[:, inter:]
    assert sqnr_db(act_ref, act) > 40, f"CUDA gate_up SQNR {sqnr_db(act_ref, act):.1f} dB <= 40"
    act_tl = moe.moe_gemm(xq, gu, moe_layout.RoutePlan(plan.topk_ids, plan.topk_w,
                          *moe.align_reference(plan.topk_ids, 16, 16), 16), gated=True,
                          a_div=k, mul_route_w=False, impl="triton")  # fmt: skip
    assert sqnr_db(act_tl, act) > 40, "CUDA and Triton gate_up disagree"
    aq = moe_layout.FP4Rows(*quant.quantize_rows(act, scale_2=None))
    aq.dq16 = torch.empty(t * k, inter, dtype=torch.float16, device=DEV)
    quant.quantize_rows(act, scale_2=None, dq16=aq.dq16)
    y = moe.moe_gemm(aq, dn, plan, gated=False, a_div=1, mul_route_w=True, impl="cuda")
    y_ref = torch.einsum("pi,phi->ph", _dequant_rows(aq), wd_dq[e_of].float())
    y_ref = y_ref * plan.topk_w.reshape(-1, 1)
    assert sqnr_db(y_ref, y) > 40, f"CUDA down SQNR {sqnr_db(y_ref, y):.1f} dB <= 40"


def _model_shape_gemms(t: int, block_m: int) -> tuple:
    """(plan, [(weights, activation rows, gated, a_div, mul_route_w, N_out)] for gate_up and
    down) at the model's expert shape: 128 experts, 2048 -> 2 x 768 -> 2048, top-8, `t`
    tokens routed at random, packed NVFP4 weights, NVFP4 rows with their dq16 operand."""
    from trace_common.kernels import moe, moe_layout, quant

    torch.manual_seed(t)
    e, h, inter, k = 128, 2048, 768, 8
    ids, w = moe.route_reference(torch.randn(t, e, device=DEV), k)
    plan = moe_layout.RoutePlan(ids, w, *moe.align_reference(ids, e, block_m), block_m)
    gu = moe.quantize_weights((torch.randn(e, 2 * inter, h, device=DEV) * 0.02).bfloat16(),
                              shared_halves=True)  # fmt: skip
    dn = moe.quantize_weights((torch.randn(e, h, inter, device=DEV) * 0.02).bfloat16(),
                              shared_halves=False)  # fmt: skip
    gu.pack_for_cuda_()
    dn.pack_for_cuda_()
    rows = {}
    for name, r, kk in (("x", t, h), ("act", t * k, inter)):
        dq = torch.empty(r, kk, dtype=torch.float16, device=DEV)
        xin = torch.randn(r, kk, device=DEV).bfloat16()
        if name == "act":  # a row of zeros and one of one huge value: the scale_2 edge cases
            xin[0] = 0
            xin[-1, 5] = 3e4
        rows[name] = moe_layout.FP4Rows(*quant.quantize_rows(xin, scale_2=None, dq16=dq), dq)
    cases = [(gu, rows["x"], True, k, False, inter), (dn, rows["act"], False, 1, True, h)]
    return plan, cases


@pytest.mark.parametrize("t,block_m", [(1, 8), (8, 8), (32, 8), (128, 16), (200, 16)])
def test_moe_gemm_fp4_stream_model_shape(t, block_m):
    """The streaming kernel at the model's expert shape (128 experts, 2048 -> 2 x 768 -> 2048,
    top-8), where a CTA walks many items and the ring wraps many times: it equals the first
    CUDA kernel up to summation order (products are exact in both), every output written, with
    the default config and two others per GEMM."""

    others = {(2048, True): [(1, 16, 2, 4, 1), (4, 8, 4, 3, 1)],
              (768, False): [(4, 12, 1, 8, 2), (8, 6, 2, 4, 2)]}  # fmt: skip
    _configs_match_reference(_model_shape_gemms(t, block_m), "stream", "mma",
                             lambda k, gated: [None, *others[(k, gated)]])  # fmt: skip


def _configs_match_reference(gemms: tuple, kernel: str, ref_kernel: str, configs) -> None:
    """For gate_up and down of `_model_shape_gemms`: `kernel` with each of configs(K, gated)
    writes every output and equals `ref_kernel` up to summation order (SQNR > 60 dB)."""
    from trace_common.kernels import cuda_moe

    plan, cases = gemms
    for wt, a, gated, a_div, mrw, n_out in cases:
        ref = cuda_moe.moe_gemm_cuda(a, wt, plan, gated=gated, a_div=a_div, mul_route_w=mrw,
                                     kernel=ref_kernel).float()  # fmt: skip
        for cfg in configs(wt.k, gated):
            got = torch.full((plan.n_pairs, n_out), float("nan"), dtype=torch.bfloat16, device=DEV)
            cuda_moe.moe_gemm_cuda(a, wt, plan, gated=gated, a_div=a_div, mul_route_w=mrw,
                                   out=got, config=cfg, kernel=kernel)  # fmt: skip
            assert torch.isfinite(got.float()).all(), f"unwritten outputs, config {cfg}"
            db = sqnr_db(ref, got)
            assert db > 60, f"{kernel} vs {ref_kernel} (gated={gated}, config {cfg}): {db:.1f} dB"


@pytest.mark.parametrize("t,block_m", [(3, 16), (64, 16), (128, 16), (200, 16), (1, 8),
                                       (8, 8), (32, 8), (80, 8)])  # fmt: skip
def test_moe_gemm_fp4_wg_model_shape(t, block_m):
    """The warpgroup-MMA kernel (`wg`, 8- or 16-slot blocks, sm_90a) at the model's expert shape
    equals the streaming kernel up to summation order (products exact in both; it sums all of
    K in one chain per output), every output written, with its default config, another, and
    3 warpgroups per CTA (items split unevenly among them)."""
    _configs_match_reference(_model_shape_gemms(t, block_m), "wg", "stream",
                             lambda k, gated: [None, (2, 4), (2, 2, 3)])  # fmt: skip


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("t", [1, 2, 8])
def test_moe_gemm_fp4_mma_by_pairs(t, pdl):
    """The mma kernel by pairs (one block per pair from the top-k ids, the block layout unread:
    poisoned here) equals it by blocks bit for bit, at the model's expert shape, the gate_up
    with its act quantize fused (codes, scales, scale_2, dq16) and the down."""
    from trace_common.kernels import cuda_moe, moe_layout

    plan, cases = _model_shape_gemms(t, 8)
    no_layout = moe_layout.RoutePlan(plan.topk_ids, plan.topk_w, torch.full_like(plan.sorted_pair, -7),
                              torch.full_like(plan.block_expert, -7), 8)  # fmt: skip
    for wt, a, gated, a_div, mrw, n_out in cases:
        outs = []
        for by_pairs, p in ((False, plan), (True, no_layout)):
            got = torch.full((p.n_pairs, n_out), float("nan"), dtype=torch.bfloat16, device=DEV)
            r = p.n_pairs
            q = moe_layout.FP4Rows(torch.zeros(r, n_out // 2, dtype=torch.uint8, device=DEV),
                            torch.zeros(r, n_out // 16, dtype=torch.uint8, device=DEV),
                            torch.zeros(r, dtype=torch.float32, device=DEV),
                            torch.zeros(r, n_out, dtype=torch.float16, device=DEV)) if gated else None  # fmt: skip
            blocks = max(p.n_pairs, p.block_expert.numel())
            counter = torch.zeros(blocks, dtype=torch.int32, device=DEV) if gated else None
            cuda_moe.moe_gemm_cuda(a, wt, p, gated=gated, a_div=a_div, mul_route_w=mrw,
                                   out=got, kernel="mma", pdl=pdl, quant_out=q,
                                   counter=counter, by_pairs=by_pairs)  # fmt: skip
            outs.append([got] + ([q.codes, q.scales, q.scale_2, q.dq16] if q else []))
            if counter is not None:
                assert int(counter.abs().sum()) == 0, "block counters not reset"
        assert torch.isfinite(outs[1][0].float()).all(), "unwritten outputs by pairs"
        for i, (x, y) in enumerate(zip(*outs, strict=True)):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{gated=}: output {i}"


@pytest.mark.parametrize("fp4,decode", [(False, None), (True, "bits"), (True, "ptx")])
@pytest.mark.parametrize("b,cap,lens", [(3, 5000, [1, 777, 5000]),
                                        (4, 33000, [32769, 100, 20000, 4097])])  # fmt: skip
def test_decode_attention(fp4, decode, b, cap, lens):
    from trace_common.kernels import attention as attn

    hq, hkv, d = 32, 4, 128
    cache = attn.KVCacheGPU.allocate(fp4=fp4, batch=b, kv_heads=hkv, capacity=cap, head_dim=d,
                                     device=DEV)  # fmt: skip
    cache.fill_random_(torch.Generator(device=DEV).manual_seed(b))
    q = torch.randn(b, hq, d, device=DEV).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    plan = attn.DecodeAttnPlan.make(batch=b, q_heads=hq, kv_heads=hkv, capacity=cap,
                                    head_dim=d, context_hint=max(lens), device=DEV)  # fmt: skip
    out = attn.decode_attention(q, cache, lens_t, plan, decode=decode)
    ref = attn.attention_reference(q, attn.dequantize_cache(cache), lens_t)
    assert sqnr_db(ref, out) > 35, f"decode attention SQNR {sqnr_db(ref, out):.1f} dB <= 35"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("b,cap,lens", [(1, 1100, [1025]), (1, 1100, [1]), (2, 700, [513, 700]),
                                        (3, 5000, [1, 777, 4097])])  # fmt: skip
def test_decode_attention_fp4_appends_in_kernel(b, cap, lens, capture, fused, monkeypatch):
    """The CUDA FP4 attention given kv_new (the split holding position lens - 1 appends the
    new token itself) writes the cache and guidance record that kv_append writes, bit for bit,
    and the same attention output as kv_append + attention: at a split's first position (fused:
    256-key splits), at position 0, at the cache's end, fused and split + reduce plans."""
    pytest.importorskip("cupy", reason="the CUDA attention kernel is launched through CuPy")
    from trace_common.kernels import attention as attn

    monkeypatch.setattr(attn, "fused_chunk", lambda *a, **k: 256)
    from trace_common.kernels.quant import CompactRecordBuffers

    hq, hkv, d = 32, 4, 128
    q = torch.randn(b, hq, d, device=DEV).bfloat16()
    kv_new = (torch.randn(2, b, hkv * d, device=DEV) * 3).bfloat16()
    kv_new[1, 0, :d] = 0  # one head of zeros: the token's scale_2 still from the others
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    results = []
    for in_kernel in (False, True):
        cache = attn.KVCacheGPU.allocate(fp4=True, batch=b, kv_heads=hkv, capacity=cap,
                                         head_dim=d, device=DEV)  # fmt: skip
        cache.fill_random_(torch.Generator(device=DEV).manual_seed(b))
        plan = attn.DecodeAttnPlan.make(batch=b, q_heads=hq, kv_heads=hkv, capacity=cap,
                                        head_dim=d, context_hint=max(lens), device=DEV,
                                        cuda_fp4=True, fused=fused)  # fmt: skip
        assert (plan.counters is not None) == fused
        rec = CompactRecordBuffers.allocate(2 * b, hkv * d, DEV) if capture else None
        if rec is not None:
            for t in (rec.mbits, rec.block_scales, rec.row_scales):
                t.fill_(0x5A if t.dtype == torch.uint8 else -1.0)
        if in_kernel:
            out = attn.decode_attention(q, cache, lens_t, plan, impl="cuda", kv_new=kv_new,
                                        kv_capture=rec)  # fmt: skip
        else:
            attn.kv_append(cache, kv_new, lens_t - 1, rec)
            out = attn.decode_attention(q, cache, lens_t, plan, impl="cuda")
        torch.cuda.synchronize()
        got = [out, cache.codes, cache.scales, cache.row_scales]
        results.append(got + ([rec.mbits, rec.block_scales, rec.row_scales] if rec else []))
    assert torch.isfinite(results[1][0].float()).all()
    for i, (x, y) in enumerate(zip(*results, strict=True)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"output {i} differs"


def test_decode_attention_fp4_cuda_shape_fallback():
    """Shapes the CUDA kernel does not handle (here 16 q / 4 kv heads) run the Triton kernel."""
    pytest.importorskip("cupy", reason="the CUDA attention kernel is launched through CuPy")
    from trace_common.kernels import attention as attn
    from trace_common.kernels.cuda_attn import supports

    assert not supports(16, 4, 128, 256) and supports(32, 4, 128, 256)
    cache = attn.KVCacheGPU.allocate(fp4=True, batch=2, kv_heads=4, capacity=500, head_dim=128,
                                     device=DEV)  # fmt: skip
    cache.fill_random_(torch.Generator(device=DEV).manual_seed(5))
    q = torch.randn(2, 16, 128, device=DEV).bfloat16()
    lens_t = torch.tensor([300, 500], dtype=torch.int32, device=DEV)
    plan = attn.DecodeAttnPlan.make(batch=2, q_heads=16, kv_heads=4, capacity=500, head_dim=128,
                                    context_hint=500, device=DEV)  # fmt: skip
    out = attn.decode_attention(q, cache, lens_t, plan, impl="cuda")
    ref = attn.attention_reference(q, attn.dequantize_cache(cache), lens_t)
    assert sqnr_db(ref, out) > 35, f"fallback SQNR {sqnr_db(ref, out):.1f} dB <= 35"


@pytest.mark.parametrize(
    "fp4,gemm,attn_impl",
    [
        (False, None, None),
        (True, "triton", "triton"),
        (True, "cuda", "triton"),
        (True, "cuda", "cuda"),
        (True, "cuda-mma", "cuda"),
        (True, "cuda-stream", "cuda"),
    ],
)
def test_engine_graph_replay_equals_eager(fp4, gemm, attn_impl, monkeypatch):
    """A captured decode step replays to the same tokens and logits as the eager step."""
    from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights

    if gemm and gemm.startswith("cuda-"):  # the CUDA GEMM with a given kernel
        from trace_common.kernels import cuda_moe

        gemm, kernel = gemm.split("-")
        monkeypatch.setattr(cuda_moe, "KERNEL_FOR", {})  # every shape: DEFAULT_CUDA_KERNEL
        monkeypatch.setattr(cuda_moe, "DEFAULT_CUDA_KERNEL", kernel)
    if "cuda" in (gemm, attn_impl):
        pytest.importorskip("cupy", reason="the CUDA kernels are launched through CuPy")
    if attn_impl:
        from trace_common.kernels import fp4_attn_impl

        for mod in ("engine", "attention"):
            monkeypatch.setattr(f"trace_common.kernels.{mod}.fp4_attn_impl",
                                lambda impl=None: fp4_attn_impl(impl or attn_impl))  # fmt: skip

    shape = EngineShape.named(
        num_layers=3, hidden_size=512, num_experts=32, moe_intermediate_size=256, vocab_size=4096
    )
    w = EngineWeights.random(shape, DEV, seed=1)
    if fp4:
        w.quantize_experts_(gemm)
        assert (w.layers[0].gate_up.packed is not None) == (gemm == "cuda")
    eng = DecodeEngine(shape, w, batch=4, capacity=600, context=500,
                       guided_layers=(2,) if fp4 else (), device=DEV)  # fmt: skip
    eng.fill_context_()
    eng.tokens.random_(0, shape.vocab)
    eng.capture(warmup=1)
    state = [eng.tokens.clone(), eng.pos.clone(), eng.lens.clone()]
    caches = [(c.values if not fp4 else c.codes).clone() for c in eng.caches]
    eng.replay()
    torch.cuda.synchronize()
    tok_graph, logits_graph = eng.tokens.clone(), eng.logits.clone()
    eng.tokens.copy_(state[0])
    eng.pos.copy_(state[1])
    eng.lens.copy_(state[2])
    for c, saved in zip(eng.caches, caches, strict=True):
        (c.values if not fp4 else c.codes).copy_(saved)
    eng.step()
    torch.cuda.synchronize()
    assert torch.isfinite(logits_graph.float()).all()
    assert torch.equal(eng.logits, logits_graph), "graph replay and eager step differ"
    assert torch.equal(eng.tokens, tok_graph)


def test_engine_bf16_decode_matches_the_policy():
    """The BF16 engine on a policy's weights (`EngineWeights.from_model`) and the policy's
    prefill KV cache computes the next decode step's logits as the policy does (bf16 rounding
    differs: fused kernels vs PyTorch ops): SQNR > 25 dB (a mis-stacked projection or another
    RoPE convention gives ~0 dB) and the same greedy token wherever the policy's top-2 margin
    exceeds twice the largest logit difference."""
    from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights
    from trace_common.model.config import ModelConfig
    from trace_common.model.kv_cache import KVCache
    from trace_common.model.model import MoECausalLM

    cfg = ModelConfig(vocab_size=4096, hidden_size=512, num_layers=2, num_heads=32,
                      num_kv_heads=4, head_dim=128, num_experts=32, top_k=8,
                      moe_intermediate_size=256)  # fmt: skip
    model = MoECausalLM(cfg).init_weights(seed=5).to(device=DEV, dtype=torch.bfloat16)
    b, t, cap = 2, 7, 16
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
    cache = KVCache(num_layers=cfg.num_layers, batch=b, max_len=cap, num_kv_heads=4,
                    head_dim=128, dtype=torch.bfloat16, device=DEV)  # fmt: skip
    ones = dict(dtype=torch.bool, device=DEV)
    with torch.no_grad():
        pos = torch.arange(t, device=DEV).expand(b, t)
        prefill = model(ids.to(DEV), pos, cache.key_valid(torch.ones(b, t, **ones)), cache=cache)
        nxt = prefill[:, -1].argmax(-1)
        want = model(nxt[:, None], torch.full((b, 1), t, device=DEV),
                     cache.key_valid(torch.ones(b, 1, **ones)), cache=cache)[:, 0].float()  # fmt: skip

    shape = EngineShape.from_model_config(cfg)
    eng = DecodeEngine(shape, EngineWeights.from_model(model, DEV), batch=b, capacity=cap,
                       context=t, small_batch=False, device=DEV)  # fmt: skip
    for li, c in enumerate(eng.caches):  # the policy's cache: [B, S, Hkv, D] per layer
        assert c.values is not None
        c.values.zero_()
        c.values[0, :, :, :t] = cache.k[li][:, :t].transpose(1, 2)
        c.values[1, :, :, :t] = cache.v[li][:, :t].transpose(1, 2)
    eng.tokens.copy_(nxt)
    eng.step()
    torch.cuda.synchronize()
    got = eng.logits.float()
    db = sqnr_db(want, got)
    assert db > 25, f"engine vs policy logits: {db:.1f} dB <= 25"
    err = float((got - want).abs().max())
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert torch.equal(eng.tokens[clear], want.argmax(-1)[clear])
