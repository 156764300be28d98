"""The fused launches of the standard decode step (trace_common/kernels/fused.py) against the
launches they replace, bit for bit (rtol=0, atol=0): residual, normalized rows, NVFP4 codes,
e4m3 block scales, scale_2, dq16 operand, compact records, the KV cache (BF16 and FP4); and
the engine's step with and without them. Outputs are poisoned before each call.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _rand(*shape: int, std: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * std).bfloat16()


def _rows(t: int, h: int, dq16: bool):
    from trace_common.kernels.moe_layout import FP4Rows

    u8 = dict(dtype=torch.uint8, device=DEV)
    dq = torch.full((t, h), float("nan"), dtype=torch.float16, device=DEV) if dq16 else None
    return FP4Rows(torch.full((t, h // 2), 0xAB, **u8), torch.full((t, h // 16), 0xCD, **u8),
                   torch.full((t,), float("nan"), device=DEV), dq)  # fmt: skip


def _records(rows: int, k: int):
    from trace_common.kernels.quant import CompactRecordBuffers

    rec = CompactRecordBuffers.allocate(rows, k, DEV)
    rec.mbits.fill_(0x5A)
    rec.block_scales.fill_(0xA5)
    rec.row_scales.fill_(float("nan"))
    return rec


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included)."""
    if a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


@pytest.mark.parametrize("capture,dq16", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("t,h,nsum", [(1, 2048, 1), (32, 2048, 1), (5, 512, 8), (3, 256, 0)])
def test_add_rmsnorm_quant_equals_unfused(t, h, nsum, capture, dq16):
    """add_rmsnorm + quantize_rows (per-row scale_2, record, dq16) vs the fused kernel."""
    from trace_common.kernels import attention as attn
    from trace_common.kernels import fused, quant

    resid = _rand(t, h, std=3.0, seed=t + h)
    delta = _rand(max(1, t * nsum), h, std=2.0, seed=nsum)
    if t > 2:
        resid[2] = 0
        delta[2 * max(nsum, 1) : 3 * max(nsum, 1)] = 0  # an all-zero row after the add
    w = _rand(h, std=0.5, seed=7) + 1
    eps = 1e-6
    resid_ref, out_ref = resid.clone(), torch.full_like(resid, float("nan"))
    q_ref, rec_ref = _rows(t, h, dq16), _records(t, h) if capture else None
    attn.add_rmsnorm(delta if nsum else None, resid_ref, w, out_ref, nsum=nsum, eps=eps)
    quant.quantize_rows(out_ref, scale_2=None, capture=rec_ref,
                        out=(q_ref.codes, q_ref.scales, q_ref.scale_2), dq16=q_ref.dq16)  # fmt: skip
    resid_got, out_got = resid.clone(), torch.full_like(resid, float("nan"))
    q_got, rec_got = _rows(t, h, dq16), _records(t, h) if capture else None
    fused.add_rmsnorm_quant(delta if nsum else None, resid_got, w, out_got, q_got, nsum=nsum,
                            eps=eps, capture=rec_got)  # fmt: skip
    assert _equal(resid_got, resid_ref), "residual"
    assert _equal(out_got, out_ref), "normalized rows"
    assert _equal(q_got.codes, q_ref.codes), "codes"
    assert _equal(q_got.scales, q_ref.scales), "e4m3 block scales"
    assert _equal(q_got.scale_2, q_ref.scale_2), "scale_2"
    if dq16:
        assert _equal(q_got.dq16, q_ref.dq16), "dq16 operand"
    if capture:
        assert _equal(rec_got.mbits, rec_ref.mbits), "record mantissa bits"
        assert _equal(rec_got.block_scales, rec_ref.block_scales), "record block scales"
        assert _equal(rec_got.row_scales, rec_ref.row_scales), "record row scales"


def _cache(fp4: bool, b: int, hkv: int, s: int, d: int):
    from trace_common.kernels import attention as attn

    cache = attn.KVCacheGPU.allocate(fp4=fp4, batch=b, kv_heads=hkv, capacity=s, head_dim=d,
                                     device=DEV)  # fmt: skip
    cache.fill_random_(torch.Generator(device=DEV).manual_seed(3))
    return cache


def _cache_tensors(cache) -> list[torch.Tensor]:
    if cache.fp4:
        return [cache.codes, cache.scales, cache.row_scales]
    return [cache.values]


@pytest.mark.parametrize(
    "fp4,capture", [(False, False), (True, False), (True, True)]
)  # fmt: skip
@pytest.mark.parametrize("b,hq,hkv", [(3, 32, 4), (32, 32, 4), (2, 8, 2)])
def test_qk_norm_rope_append_equals_unfused(b, hq, hkv, fp4, capture):
    """qk_norm_rope + kv_append (BF16 cache, FP4 cache with and without records) vs fused."""
    from trace_common.kernels import attention as attn
    from trace_common.kernels import fused

    d, s, eps = 128, 40, 1e-6
    qkv = _rand(b, (hq + 2 * hkv) * d, std=2.0, seed=b + hq)
    norm_w = _rand(2, d, std=0.3, seed=1) + 1
    pos = torch.arange(b, dtype=torch.int32, device=DEV) * 13 % s
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d))
    cache_ref, cache_got = _cache(fp4, b, hkv, s, d), _cache(fp4, b, hkv, s, d)
    rec_ref = _records(2 * b, hkv * d) if capture else None
    rec_got = _records(2 * b, hkv * d) if capture else None
    q_ref = torch.full((b, hq, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    q_got = q_ref.clone()
    kv_new = torch.full((2, b, hkv * d), float("nan"), dtype=torch.bfloat16, device=DEV)
    attn.qk_norm_rope(qkv, norm_w, pos, inv_freq, q_ref, kv_new, q_heads=hq, kv_heads=hkv,
                      eps=eps)  # fmt: skip
    attn.kv_append(cache_ref, kv_new, pos, rec_ref)
    fused.qk_norm_rope_append(qkv, norm_w, pos, inv_freq, q_got, cache_got, rec_got, q_heads=hq,
                              kv_heads=hkv, eps=eps)  # fmt: skip
    assert _equal(q_got, q_ref), "q heads"
    for got, ref in zip(_cache_tensors(cache_got), _cache_tensors(cache_ref), strict=True):
        assert _equal(got, ref), "cache contents"
    if capture:
        for name in ("mbits", "block_scales", "row_scales"):
            assert _equal(getattr(rec_got, name), getattr(rec_ref, name)), f"record {name}"


@pytest.mark.parametrize("fp4,gemm", [(False, None), (True, "triton"), (True, "cuda")])
def test_engine_fused_step_equals_unfused(fp4, gemm, monkeypatch):
    """One eager step with every fusion (fused.FUSED_PARTS) and one with none, from the
    same state: same tokens, logits, KV caches and guidance records, bit for bit; then graph
    replay of the fused step equals its eager step."""
    from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights

    if gemm == "cuda":
        pytest.importorskip("cupy", reason="the CUDA kernels are launched through CuPy")
    shape = EngineShape.named(
        num_layers=3, hidden_size=512, num_experts=32, moe_intermediate_size=256, vocab_size=4096
    )
    w = EngineWeights.random(shape, DEV, seed=2)
    if fp4:
        w.quantize_experts_(gemm)
    tokens = torch.randint(0, shape.vocab, (6,), device=DEV)

    def make(parts: str) -> DecodeEngine:  # the engine reads fused.FUSED_PARTS when built
        from trace_common.kernels import fused

        every = frozenset({"norm_quant", "qk_kv"})
        monkeypatch.setattr(fused, "FUSED_PARTS", every if parts == "all" else frozenset())
        eng = DecodeEngine(shape, w, batch=6, capacity=300, context=250,
                           guided_layers=(1, 2) if fp4 else (), device=DEV,
                           small_batch=False)  # fmt: skip
        eng.fill_context_()
        eng.tokens.copy_(tokens)
        return eng

    def state(eng: DecodeEngine) -> list[torch.Tensor]:
        ts = [eng.tokens, eng.pos, eng.lens, eng.logits]
        for c in eng.caches:
            ts += _cache_tensors(c)
        for rec in getattr(eng, "records", {}).values():
            ts += [r for buf in rec for r in (buf.mbits, buf.block_scales, buf.row_scales)]
        return ts

    def run(
        eng: DecodeEngine, start: list[torch.Tensor], graph: bool = False
    ) -> list[torch.Tensor]:
        for t, saved in zip(state(eng), start, strict=True):
            t.copy_(saved)
        if graph:
            eng.capture(warmup=1)
            for t, saved in zip(state(eng), start, strict=True):
                t.copy_(saved)
            eng.replay()
        else:
            eng.step()
        if DEV == "cuda":
            torch.cuda.synchronize()
        return [t.clone() for t in state(eng)]

    plain, fused_eng = make("none"), make("all")
    assert not (plain.qk_kv or plain.norm_quant), "no fused parts, yet a fusion is on"
    assert fused_eng.qk_kv and fused_eng.norm_quant == fp4, "every fused part: fusions off"
    start = [t.clone() for t in state(plain)]
    unfused = run(plain, start)
    fused_eager = run(fused_eng, start)
    assert torch.isfinite(unfused[3].float()).all()
    for i, (a, b) in enumerate(zip(fused_eager, unfused, strict=True)):
        assert _equal(a, b), f"state tensor {i} differs between fused and unfused steps"
    if DEV == "cuda":
        fused_graph = run(fused_eng, start, graph=True)
        for i, (a, b) in enumerate(zip(fused_graph, fused_eager, strict=True)):
            assert _equal(a, b), f"state tensor {i}: graph replay differs from eager"
