"""CPU tests of the GPU fast path's plain-Python parts (layouts, sizes, configs, lazy import),
and, where Triton is installed, its quantize kernel under Triton's CPU interpreter."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trace_common.kernels import attention as attn
from trace_common.kernels import engine, moe, moe_layout


def test_align_reference_layout_by_hand():
    # 2 tokens, top-2, 4 experts, blocks of 2: pairs p = t*2 + j
    ids = torch.tensor([[0, 1], [1, 3]], dtype=torch.int32)  # pair 0->e0, 1->e1, 2->e1, 3->e3
    sp, be = moe.align_reference(ids, num_experts=4, block_m=2)
    assert moe_layout.max_blocks(4, 4, 2) == 2 + 4
    # e0: [0, pad], e1: pairs ordered by (j, t): pair 2 (t=1, j=0) then pair 1 (t=0, j=1); e3: [3, pad]
    assert sp.tolist() == [0, 4, 2, 1, 3, 4, 4, 4, 4, 4, 4, 4]
    assert be.tolist() == [0, 1, 3, -1, -1, -1]


@pytest.mark.parametrize("t,e,k,bm", [(1, 128, 8, 16), (37, 16, 4, 16), (300, 8, 2, 64)])
def test_align_reference_is_a_padded_permutation(t, e, k, bm):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int()
    sp, be = moe.align_reference(ids, e, bm)
    n = t * k
    real = sp[sp < n]
    assert sorted(real.tolist()) == list(range(n)), "every pair exactly once"
    rows = sp.view(-1, bm)
    for b, expert in enumerate(be.tolist()):
        pairs = rows[b][rows[b] < n]
        if expert < 0:
            assert pairs.numel() == 0
        else:
            assert (ids.reshape(-1)[pairs.long()] == expert).all(), f"block {b} mixes experts"


def test_cache_and_budget_arithmetic():
    assert attn.KVCacheGPU.bytes_per_token(fp4=False, kv_heads=4, head_dim=128) == 2 * 512 * 2
    # FP4: per K and V, 512 codes / 2 + 512 / 16 e4m3 scales + one fp32 per-token scale
    assert attn.KVCacheGPU.bytes_per_token(fp4=True, kv_heads=4, head_dim=128) == 2 * (256 + 32 + 4)
    shape = engine.EngineShape.named()
    per = engine.kv_bytes_per_sequence(shape, fp4=False, tokens=1000)
    assert per == 48 * 1000 * 2048
    assert engine.largest_batch(10 * per + 5, 5, per) == 10
    assert engine.largest_batch(3, 5, per) == 0


@pytest.mark.parametrize("fp4", [True, False])
def test_cache_copy_prefix_copies_the_positions_and_nothing_else(fp4: bool) -> None:
    cache = attn.KVCacheGPU.allocate(fp4=fp4, batch=4, kv_heads=2, capacity=10, head_dim=32,
                                     device="cpu")  # fmt: skip
    cache.fill_random_(torch.Generator().manual_seed(0))
    names = ("codes", "scales", "row_scales") if fp4 else ("values",)
    if fp4:
        cache.row_scales.uniform_()
    before = {n: getattr(cache, n).clone() for n in names}
    cache.copy_prefix_(1, torch.tensor([0, 3]), 6)
    for n in names:
        t, b = getattr(cache, n), before[n]
        for slot in range(4):  # [2, B, Hkv, S, .] or row scales [2, B, S]
            head = (slice(None), slot, slice(None), slice(0, 6)) if t.dim() == 5 else \
                (slice(None), slot, slice(0, 6))  # fmt: skip
            tail = (slice(None), slot, slice(None), slice(6, None)) if t.dim() == 5 else \
                (slice(None), slot, slice(6, None))  # fmt: skip
            src = (slice(None), 1, *head[2:])
            want = b[src] if slot in (0, 3) else b[head]
            assert torch.equal(t[head], want), (n, slot)
            assert torch.equal(t[tail], b[tail]), (n, slot)


def test_engine_shape_validation():
    with pytest.raises(ValueError, match="num_heads=30"):
        engine.EngineShape.named(num_heads=30, num_kv_heads=4)
    with pytest.raises(ValueError, match="num_experts=96"):
        engine.EngineShape.named(num_experts=96)


def test_decode_mode_validation(monkeypatch):
    from trace_common.kernels import fp4_decode_words

    with pytest.raises(ValueError, match="'fast'"):
        fp4_decode_words("cuda", "fast")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fp4_decode_words("cuda") is True
    assert fp4_decode_words("cpu") is False  # inline PTX never on CPU
    assert fp4_decode_words("cuda", "bits") is False


def test_missing_triton_names_the_install_command(monkeypatch):
    import trace_common.kernels as kernels

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    with pytest.raises(ImportError, match="pip install"):
        kernels.load_kernels("_tl_fp4")


_INTERPRETED = textwrap.dedent(
    """
    import torch
    from trace_common.fp4 import nvfp4
    from trace_common.fp4.record import make_record
    from trace_common.kernels import quant
    torch.manual_seed(0)
    for shape, gran, dt in [((6, 64), "row", torch.float32), ((3, 48), "tensor", torch.bfloat16),
                            ((2, 512), "row", torch.bfloat16)]:
        x = torch.randn(shape, dtype=torch.float32) * torch.logspace(-12, 3, shape[-1])
        x = x.to(dt)
        x[0, :16] = 0
        ref = nvfp4.quantize(x, scale_granularity=gran)
        got, rec = quant.quantize_and_record(x, scale_granularity=gran)
        want = make_record(ref, "compact")
        assert torch.equal(ref.qdata, got.qdata), shape
        assert torch.equal(ref.scale.view(torch.uint8), got.scale.view(torch.uint8)), shape
        assert torch.equal(ref.per_tensor_scale, got.per_tensor_scale), shape
        assert torch.equal(want.payload, rec.payload), shape
        # fake quantization: the kernel's codes decoded, bit for bit the reference's values
        fq = quant.fake_quantize(x, scale_granularity=gran)
        bits = {4: torch.int32, 2: torch.int16}[x.element_size()]
        assert torch.equal(fq.view(bits), ref.dequantize(dt).view(bits)), shape

    # rollout-guided rounding, compact records of a rollout whose values differ a little
    from trace_common.fp4.guided import guided_quantize
    for shape, dt in [((6, 64), torch.float32), ((3, 4, 48), torch.bfloat16),
                      ((5, 512), torch.float16)]:
        x = (torch.randn(shape) * torch.logspace(-4, 2, shape[-1])).to(dt)
        x_roll = (x.float() * (1 + 0.05 * torch.randn(shape))).to(dt)
        rec = make_record(nvfp4.quantize(x_roll, scale_granularity="row"), "compact")
        bits = {4: torch.int32, 2: torch.int16}[x.element_size()]
        want = guided_quantize(x, rec)
        assert torch.equal(quant.guided_quantize(x, rec).view(bits), want.view(bits)), shape

    import numpy as np
    from trace_common.kernels.sample import sample_rows_unfiltered
    from trace_common.rollout.scheduler import sample_rows, uniforms
    for vocab, n in [(37, 16), (1000, 32)]:
        logits = (torch.randn(n + 3, vocab) * 3).to(torch.bfloat16)
        rows = torch.randperm(n + 3)[:n]
        temp = torch.rand(n) * 1.5 + 0.2
        temp[::5] = 0.0
        u = torch.from_numpy(uniforms(np.arange(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)))
        want_tok, want_lp = sample_rows(logits[rows], temp, torch.zeros(n, dtype=torch.long),
                                        torch.ones(n), u, filtered=False)
        tok, lp = sample_rows_unfiltered(logits, rows, temp, u)
        assert torch.equal(tok, want_tok), vocab
        assert float((lp - want_lp).abs().max()) < 1e-4, vocab
    print("ok")
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install 'trace-rl[gpu]'); the interpreter test needs it",
)
def test_quantize_fake_quant_guided_and_sampling_kernels_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install 'trace-rl[gpu]'); compiling needs it",
)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("kernel", ["sample", "guided"])
def test_new_kernels_compile_for_hopper(kernel: str, dtype: str) -> None:
    """The sampling and guided-rounding kernels through Triton's whole pipeline for sm_90 (to a
    cubin, with the wheel's ptxas), as on the H200: no GPU needed to catch what the
    interpreter lets pass (types of loop-carried values, unsupported ops)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trace_common.kernels import _tl_fp4, _tl_sample

    if kernel == "sample":
        fn = _tl_sample.sample_kernel
        sig = {"logits_ptr": f"*{dtype}", "row_stride": "i64", "rows_ptr": "*i64",
               "temp_ptr": "*fp32", "u_ptr": "*fp64", "tok_ptr": "*i64", "logp_ptr": "*fp32"}  # fmt: skip
        const = {"V": 151936, "BLOCK": 4096}
    else:
        fn = _tl_fp4.guided_compact_kernel
        sig = {"x_ptr": f"*{dtype}", "x_row_stride": "i64", "mbits_ptr": "*u8",
               "scale_ptr": "*u8", "g_ptr": "*fp32", "y_ptr": f"*{dtype}"}  # fmt: skip
        const = {"C": 384, "BLOCK_C": 512, "OUT_BF16": dtype == "bf16"}
    sig |= dict.fromkeys(const, "constexpr")
    src = ASTSource(fn=fn, signature=sig, constexprs=const)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"], "no cubin"
