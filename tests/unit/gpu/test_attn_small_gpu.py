"""The fused (one-launch) decode attention of the small-batch step (`cuda_attn`: BF16
`attn_bf16_fused`, FP4 `attn_fp4_ring` with FUSED) on the H200, skipped without a GPU and CuPy:
> 40 dB SQNR per sequence against fp32 attention over the (dequantized) cache and against the
split + reduce kernels, garbage past each length ignored, the arrival counters left at zero,
repeated launches bit-identical (fixed combine order), PDL launches equal to plain ones, and
the engine's batch-1 step with it (graph replay == eager; close to the unfused step)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the fused attention kernels are launched through CuPy")

DEV = "cuda"


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref = ref.double()
    err = (ref - got.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-300)))


def _cache(fp4: bool, b: int, cap: int, seed: int):
    """A random cache and q whose scores spread over several units (a peaky softmax)."""
    from trace_common.kernels import attention as attn

    g = torch.Generator(device=DEV).manual_seed(seed)
    cache = attn.KVCacheGPU.allocate(fp4=fp4, batch=b, kv_heads=4, capacity=cap, head_dim=128,
                                     device=DEV)  # fmt: skip
    cache.fill_random_(g)
    if fp4:
        cache.row_scales.uniform_(0.0625, 0.25, generator=g)
    q = ((3.0 if fp4 else 1.0) * torch.randn(b, 32, 128, device=DEV, generator=g)).bfloat16()
    return cache, q


def _plans(b: int, cap: int, context: int, fp4: bool, chunk: int | None, monkeypatch):
    """(fused plan, split + reduce plan) for the same shape."""
    from trace_common.kernels import attention as attn

    planned = attn.fused_chunk
    if chunk:
        monkeypatch.setattr(attn, "fused_chunk", lambda *a, **k: chunk)
    kw = dict(batch=b, q_heads=32, kv_heads=4, capacity=cap, head_dim=128, context_hint=context,
              device=DEV, cuda_fp4=fp4)  # fmt: skip
    fused = attn.DecodeAttnPlan.make(**kw, fused=True)
    if fused.counters is None:  # long: the plan takes split + reduce; the kernel must still work
        monkeypatch.setattr(attn, "fused_chunk", lambda *a, **k: 256)
        fused = attn.DecodeAttnPlan.make(**kw, fused=True)
    monkeypatch.setattr(attn, "fused_chunk", planned)
    assert fused.counters is not None
    if chunk:
        assert fused.chunk == chunk
    return fused, attn.DecodeAttnPlan.make(**kw)


# lengths: 1, inside one tile, past a split (non-multiples of it), long; chunks of 1, 2 and 4
# warps (16, 32, 64 tokens per split, and 128: two tiles per warp), and the plan's own rule
CASES = [(1, 41, [1]), (1, 301, [17]), (1, 1100, [1025]), (1, 33001, [32769]),
         (8, 2053, [1, 15, 16, 17, 1000, 2053, 777, 64]), (3, 9001, [8191, 4097, 9001])]  # fmt: skip


@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("b,cap,lens", CASES)
@pytest.mark.parametrize("chunk", [None, 16, 32, 128])
def test_fused_attention(fp4, b, cap, lens, chunk, monkeypatch):
    from trace_common.kernels import attention as attn

    if chunk and chunk < 64 and max(lens) > 10000:
        pytest.skip("thousands of splits: slow, and covered by the shorter cases")
    cache, q = _cache(fp4, b, cap, seed=cap + 3 * b)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    fused, split = _plans(b, cap, max(lens), fp4, chunk, monkeypatch)
    outs = []
    for pdl in (False, True, False):
        out = torch.full((b, 32 * 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        attn.decode_attention(q, cache, lens_t, fused, out=out, impl="cuda", pdl=pdl)
        outs.append(out)
    torch.cuda.synchronize()
    assert int(fused.counters.abs().sum()) == 0, "arrival counters not reset to zero"  # type: ignore[union-attr]
    assert torch.isfinite(outs[0].float()).all(), "unwritten or non-finite outputs"
    for i, got in enumerate(outs[1:]):
        assert torch.equal(outs[0], got), f"launch {i + 1} (pdl={i == 0}) differs from launch 0"
    ref = attn.attention_reference(q, attn.dequantize_cache(cache), lens_t)
    for i in range(b):
        got = sqnr_db(ref[i], outs[0][i])
        assert got > 40, f"fp4={fp4} chunk={fused.chunk}, sequence {i} (len {lens[i]}): " \
                         f"{got:.1f} dB <= 40 against fp32 attention"  # fmt: skip
    two = attn.decode_attention(q, cache, lens_t, split, impl="cuda")
    got = sqnr_db(two, outs[0])
    assert got > 40, f"fp4={fp4}: fused vs split + reduce {got:.1f} dB <= 40"


@pytest.mark.parametrize("fp4", [False, True])
def test_fused_attention_ignores_garbage_past_len(fp4, monkeypatch):
    """Cache slots at and past lens[b] hold NaN (BF16 values; FP4 row scales and e4m3 block
    scales 0x7F): they are never read (zero-filled), so the output equals the clean cache's."""
    from trace_common.kernels import attention as attn

    b, cap, lens = 3, 1200, [1000, 7, 333]
    cache, q = _cache(fp4, b, cap, seed=11)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    fused, _ = _plans(b, cap, max(lens), fp4, None, monkeypatch)
    clean = attn.decode_attention(q, cache, lens_t, fused, impl="cuda").clone()
    for i, n in enumerate(lens):
        if fp4:
            cache.row_scales[:, i, n:] = float("nan")
            cache.scales[:, i, :, n:] = 0x7F
        else:
            cache.values[:, i, :, n:] = float("nan")  # type: ignore[index]
    dirty = attn.decode_attention(q, cache, lens_t, fused, impl="cuda", pdl=True)
    assert torch.equal(clean, dirty), "data past lens[b] changed the output"


def test_fused_bf16_pdl_after_qkv_append():
    """The BF16 kernel as a PDL launch right after the PDL qkv kernel that appends the newest
    K/V row and writes q (it reads the older rows before its griddepcontrol.wait): equal, bit
    for bit, to plain launches of both."""
    from trace_common.kernels import attention as attn
    from trace_common.kernels import cuda_small

    h, cap, ctx = 512, 700, 600
    g = torch.Generator(device=DEV).manual_seed(5)
    w_qkv = (0.02 * torch.randn(40 * 128, h, device=DEV, generator=g)).bfloat16()
    xn = torch.randn(1, h, device=DEV, generator=g).bfloat16()
    norm_w = torch.ones(2, 128, dtype=torch.bfloat16, device=DEV)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device=DEV, dtype=torch.float32) / 128))
    cache, _ = _cache(False, 1, cap, seed=6)
    saved = cache.values.clone()  # type: ignore[union-attr]
    plan = attn.DecodeAttnPlan.make(batch=1, q_heads=32, kv_heads=4, capacity=cap, head_dim=128,
                                    context_hint=ctx, device=DEV, fused=True)  # fmt: skip
    assert plan.counters is not None
    outs = {}
    for pdl in (False, True):
        cache.values.copy_(saved)  # type: ignore[union-attr]
        pos = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        lens = pos + 1  # made before: no kernel between the two launched below
        q = torch.full((1, 32, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        qkv = torch.empty(1, 40 * 128, dtype=torch.bfloat16, device=DEV)
        kv_new = torch.empty(2, 1, 4 * 128, dtype=torch.bfloat16, device=DEV)
        out = torch.full((1, 32 * 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        torch.cuda.synchronize()
        cuda_small.qkv_rope(w_qkv=w_qkv, qkv=qkv, norm_w=norm_w, pos=pos,
                            inv_freq=inv_freq, q_out=q, kv_new=kv_new, cache=cache.values,
                            q_heads=32, kv_heads=4, eps=1e-6, xn=xn, pdl=pdl)  # fmt: skip
        attn.decode_attention(q, cache, lens, plan, out=out, pdl=pdl)
        torch.cuda.synchronize()
        outs[pdl] = (out, q)
    ref = attn.attention_reference(outs[False][1], cache.values.float(),  # type: ignore[union-attr]
                                   torch.tensor([ctx + 1], device=DEV))  # fmt: skip
    assert sqnr_db(ref, outs[False][0]) > 40
    assert torch.equal(outs[True][0], outs[False][0]), "PDL launches differ from plain ones"


def _engine(fp4: bool, fused: str, monkeypatch, batch: int = 1, small: bool = True):
    from trace_common.kernels import cuda_attn
    from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights

    # fused: "on" the small-batch step's attention (the default rule there), "all" the
    # standard step's too, "off" neither
    monkeypatch.setattr(cuda_attn, "fused_enabled", lambda *, small_batch=True, **_: (
        fused == "all" or (fused == "on" and small_batch)))  # fmt: skip
    shape = EngineShape.named(
        num_layers=3, hidden_size=512, num_experts=32, moe_intermediate_size=256, vocab_size=4096
    )
    w = EngineWeights.random(shape, DEV, seed=1)
    if fp4:
        w.quantize_experts_("cuda")
    eng = DecodeEngine(shape, w, batch=batch, capacity=1200, context=1000, device=DEV,
                       small_batch=small)  # fmt: skip
    assert (eng.attn_plan.counters is not None) == (fused == "all" or (fused == "on" and small))
    eng.fill_context_()
    eng.tokens.random_(0, shape.vocab, generator=torch.Generator(device=DEV).manual_seed(3))
    return eng


@pytest.mark.parametrize("batch,small,mode", [(1, True, "on"), (6, False, "all")])
@pytest.mark.parametrize("fp4", [False, True])
def test_engine_fused_attention(fp4, batch, small, mode, monkeypatch):
    """Batch-1 small-batch step (fused attention) and the standard step at batch 6 (forced):
    with the fused attention (PDL on where the step uses it) three graph replays equal three
    eager steps with plain launches bit for bit, and the first step's logits are close to the
    step's with split + reduce attention from the same state (> 20 dB: the attention output
    differs in rounding only, but a near-tie in the routing may flip an expert)."""
    eng = _engine(fp4, mode, monkeypatch, batch, small)
    ref = _engine(fp4, "off", monkeypatch, batch, small)
    state = [eng.tokens, eng.pos, eng.lens, *(c.codes if fp4 else c.values for c in eng.caches)]
    saved = [t.clone() for t in state]
    eng.pdl = True
    eng.capture(warmup=1)  # its warm-up step moved the state on: back to the saved one
    for t, before in zip(state, saved, strict=True):
        t.copy_(before)
    replays = []
    for _ in range(3):
        eng.replay()
        replays.append((eng.tokens.clone(), eng.logits.clone()))
    ref.step()
    torch.cuda.synchronize()
    got = sqnr_db(ref.logits, replays[0][1])
    print(f"fp4={fp4}: fused vs split + reduce attention, logits SQNR {got:.1f} dB")
    assert got > 20, f"fused vs unfused attention step: logits SQNR {got:.1f} dB <= 20"
    for t, before in zip(state, saved, strict=True):
        t.copy_(before)
    eng.pdl = False
    for i, (tokens, logits) in enumerate(replays):
        eng.step()
        torch.cuda.synchronize()
        assert torch.isfinite(logits.float()).all()
        assert torch.equal(eng.logits, logits), f"step {i}: graph replay (PDL) and eager differ"
        assert torch.equal(eng.tokens, tokens), f"step {i}: tokens differ"
