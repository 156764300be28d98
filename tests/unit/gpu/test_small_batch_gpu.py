"""The small-batch decode kernels (trace_common/kernels/cuda_small.py) vs plain-PyTorch math.

Exact (rtol=0, atol=0) where the algorithm is the same: the residual add, the block layout of
the routing, the KV rows written to the cache vs kv_new, the counters left at zero. SQNR bounds
(stated in each assertion) where the accumulation order differs: GEMVs, norms after them,
RoPE, expert outputs. Outputs are poisoned (NaN) before each call.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the small-batch kernels are launched through CuPy")

DEV = "cuda"
D = 128


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref = ref.double()
    err = (ref - got.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-300)))


def _rand(*shape: int, std: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * std).bfloat16()


def _nan(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _norm_weight(*shape: int, seed: int) -> torch.Tensor:
    """An RMSNorm weight near 1 (bf16)."""
    return (1 + 0.1 * _rand(*shape, seed=seed).float()).bfloat16()


def _rope_inv_freq() -> torch.Tensor:
    """RoPE inverse frequencies of head_dim D, theta 1e6."""
    return 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV, dtype=torch.float32) / D))


def ref_add_rmsnorm(resid, delta, nsum, w, eps):
    """(new residual, normalized rows): add_rmsnorm_kernel's roundings, fp32 sum in order j."""
    x = resid.float()
    if nsum:
        d = torch.zeros_like(x)
        for j in range(nsum):
            d += delta.view(-1, nsum, x.shape[1])[:, j].float()
        x = (x + d.bfloat16().float()).bfloat16().float()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = ((x * r).bfloat16().float() * w.float()).bfloat16()
    return x.bfloat16(), y


@pytest.mark.parametrize("t", [1, 3, 8, 9, 16, 27, 32])  # > 8: gemv_bf16_tiles
@pytest.mark.parametrize("n,k,site", [(5120, 2048, "qkv"), (2048, 4096, "o"),
                                      (128, 2048, "router"), (4096, 2048, "lm_head"),
                                      (512, 512, "qkv")])  # fmt: skip
def test_gemv(t, n, k, site):
    from trace_common.kernels import cuda_small

    w = _rand(n, k, std=0.02, seed=n + k)
    x = _rand(t, k, seed=t)
    guard = _nan(t + 1, n)  # a row past the tokens: must stay unwritten
    out = guard[:t]
    cuda_small.gemv(x, w, out, warps=cuda_small.WARPS[site])
    ref = x.float() @ w.float().t()
    assert torch.isfinite(out.float()).all(), "unwritten outputs"
    assert torch.isnan(guard[t].float()).all(), "wrote past the last token"
    assert sqnr_db(ref, out) > 40, f"GEMV {site} SQNR {sqnr_db(ref, out):.1f} dB <= 40"


def _qkv_reference(xn, w_qkv, norm_w, pos, inv_freq, hq, hkv, eps):
    """(q [T, hq, D], kv_new [2, T, hkv D]) of the model's attention input path."""
    t = xn.shape[0]
    heads = (xn.float() @ w_qkv.float().t()).bfloat16().float().view(t, hq + 2 * hkv, D)
    qk = heads[:, : hq + hkv]
    r = torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)
    nw = torch.cat([norm_w[0:1].expand(hq, D), norm_w[1:2].expand(hkv, D)]).float()
    y = ((qk * r).bfloat16().float() * nw).bfloat16().float()
    ang = pos.float()[:, None] * inv_freq[None]  # [T, D/2]
    c = torch.cos(ang).bfloat16().float()[:, None]
    s = torch.sin(ang).bfloat16().float()[:, None]
    y1, y2 = y[..., : D // 2], y[..., D // 2 :]
    o = torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], -1).bfloat16()
    kv = torch.stack([o[:, hq:].reshape(t, -1), heads[:, hq + hkv :].bfloat16().reshape(t, -1)])
    return o[:, :hq], kv


@pytest.mark.parametrize("h", [512, 2048])
@pytest.mark.parametrize("t,nsum,pro", [(1, 0, True), (1, 1, True), (1, 8, True), (4, 1, True),
                                        (8, 1, False), (5, 8, False)])  # fmt: skip
def test_qkv_rope(h, t, nsum, pro):
    from trace_common.kernels import cuda_small

    hq, hkv, cap, eps = 32, 4, 300, 1e-6
    n = (hq + 2 * hkv) * D
    w = _rand(n, h, std=0.02, seed=h)
    resid = _rand(t, h, seed=1)
    delta = _rand(t * nsum, h, std=0.5, seed=2) if nsum else None
    ln_w = _norm_weight(h, seed=3)
    norm_w = _norm_weight(2, D, seed=4)
    pos = torch.randint(0, cap, (t,), dtype=torch.int32, device=DEV)
    inv_freq = _rope_inv_freq()
    r_ref, xn_ref = ref_add_rmsnorm(resid, delta, nsum, ln_w, eps)
    cache = _rand(2, t, hkv, cap, D, seed=5)
    cache_before = cache.clone()
    q, kv, qkv = _nan(t, hq, D), _nan(2, t, hkv * D), _nan(t, n)
    common = dict(w_qkv=w, qkv=qkv, norm_w=norm_w, pos=pos,
                  inv_freq=inv_freq, q_out=q, kv_new=kv, cache=cache, q_heads=hq,
                  kv_heads=hkv, eps=eps)  # fmt: skip
    if pro:
        r_out = _nan(t, h)
        cuda_small.qkv_rope(**common, resid_in=resid, delta=delta, nsum=nsum, ln_w=ln_w,
                            resid_out=r_out)  # fmt: skip
        torch.testing.assert_close(r_out, r_ref, rtol=0, atol=0)
    else:
        cuda_small.qkv_rope(**common, xn=xn_ref)
    q_ref, kv_ref = _qkv_reference(xn_ref, w, norm_w, pos, inv_freq, hq, hkv, eps)
    assert sqnr_db(q_ref, q) > 40, f"q SQNR {sqnr_db(q_ref, q):.1f} dB <= 40"
    assert sqnr_db(kv_ref, kv) > 40, f"k/v SQNR {sqnr_db(kv_ref, kv):.1f} dB <= 40"
    want = cache_before.clone()
    for b in range(t):
        want[:, b, :, int(pos[b])] = kv[:, b].view(2, hkv, D)
    assert torch.equal(cache, want), "cache: k/v rows at pos (== kv_new), nothing else"


# warps: the router CTA's warps (8 by default); fewer threads than experts make each thread
# count and scan a run of experts in the block layout (256 experts over 64 or 32 threads)
@pytest.mark.parametrize("t,e,k,bm,warps", [(1, 128, 8, 8, 8), (5, 128, 8, 16, 8),
                                            (8, 128, 8, 8, 8), (4, 32, 8, 8, 8),
                                            (8, 64, 4, 16, 8), (8, 256, 8, 8, 2),
                                            (3, 256, 8, 16, 1)])  # fmt: skip
def test_router_topk(t, e, k, bm, warps, monkeypatch):
    from trace_common.kernels import cuda_small, moe, moe_layout

    monkeypatch.setitem(cuda_small.WARPS, "router", warps)
    h, eps = 2048, 1e-6
    resid, delta = _rand(t, h, seed=11), _rand(t, h, std=0.5, seed=12)
    ln_w = _norm_weight(h, seed=13)
    w = _rand(e, h, std=0.02, seed=14)
    plan = moe_layout.RoutePlan.allocate(t, e, k, bm, DEV)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    outs = []
    for _ in range(2):  # the second call must give the same (counter reset, deterministic)
        r_out, xn, logits = _nan(t, h), _nan(t, h), _nan(t, e)
        plan.topk_ids.fill_(-7)
        plan.topk_w.fill_(float("nan"))
        plan.sorted_pair.fill_(-7)
        plan.block_expert.fill_(-7)
        cuda_small.router_topk(resid_in=resid, delta=delta, nsum=1, ln_w=ln_w, eps=eps,
                               resid_out=r_out, xn_out=xn, w_router=w, logits=logits,
                               counter=counter, topk_ids=plan.topk_ids, topk_w=plan.topk_w,
                               sorted_pair=plan.sorted_pair, block_expert=plan.block_expert,
                               block_m=bm)  # fmt: skip
        outs.append([x.clone() for x in (r_out, xn, logits, plan.topk_ids, plan.topk_w,
                                         plan.sorted_pair, plan.block_expert)])  # fmt: skip
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "second call differs"
    r_ref, xn_ref = ref_add_rmsnorm(resid, delta, 1, ln_w, eps)
    torch.testing.assert_close(r_out, r_ref, rtol=0, atol=0)
    assert sqnr_db(xn_ref, xn) > 40, f"xn SQNR {sqnr_db(xn_ref, xn):.1f} dB <= 40"
    lg_ref = xn_ref.float() @ w.float().t()
    assert sqnr_db(lg_ref, logits) > 40, f"logits SQNR {sqnr_db(lg_ref, logits):.1f} dB"
    ids, wts = moe.route_reference(logits, k)  # the kernel's own logits: ties decide alike
    probs = torch.softmax(logits.float(), -1)
    chosen = probs.gather(1, plan.topk_ids.long())
    torch.testing.assert_close(chosen, probs.gather(1, ids.long()), rtol=0, atol=0)
    torch.testing.assert_close(plan.topk_w, wts, rtol=1e-5, atol=1e-6)
    sp, be = moe.align_reference(plan.topk_ids, e, bm)
    assert torch.equal(plan.block_expert, be), "block -> expert"
    assert torch.equal(plan.sorted_pair, sp), "pair slots (each expert's pairs in (j, t) order)"
    assert int(counter) == 0, "counter not reset"


@pytest.mark.parametrize("t,e,cluster", [(1, 128, True), (2, 128, False), (8, 64, True),
                                         (3, 256, False)])  # fmt: skip
def test_router_topk_ties_and_no_layout(t, e, cluster):
    """Experts whose router rows equal the top expert's tie with it: the picks are ordered by
    logit, then by the lower index (a stable descending sort of the kernel's own logits), the
    weights are the reference's; without sorted_pair / block_expert the plan's layout is left
    untouched."""
    from trace_common.kernels import cuda_small, moe, moe_layout

    h, k, eps = 2048, 8, 1e-6
    resid, delta = _rand(t, h, seed=31), _rand(t, h, std=0.5, seed=32)
    ln_w = _norm_weight(h, seed=33)
    w = _rand(e, h, std=0.02, seed=34)
    _, xn_ref = ref_add_rmsnorm(resid, delta, 1, ln_w, eps)
    top = int((xn_ref[0].float() @ w.float().t()).argmax())
    for j in (0, top // 2, e - 1, (top + 5) % e):  # below and above the top expert's index
        w[j] = w[top]
    plan = moe_layout.RoutePlan.allocate(t, e, k, 8, DEV)
    plan.sorted_pair.fill_(-7)
    plan.block_expert.fill_(-7)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    logits = _nan(t, e)
    cuda_small.router_topk(resid_in=resid, delta=delta, nsum=1, ln_w=ln_w, eps=eps,
                           resid_out=_nan(t, h), xn_out=_nan(t, h), w_router=w, logits=logits,
                           counter=counter, topk_ids=plan.topk_ids, topk_w=plan.topk_w,
                           sorted_pair=None, block_expert=None, block_m=8,
                           cluster=cluster)  # fmt: skip
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(plan.topk_ids, order.int()), "picks: by logit, ties by lower index"
    ties = [j for j in range(e) if torch.equal(w[j], w[top])]
    assert len(ties) > 1 and all(j in plan.topk_ids[0].tolist() for j in ties)
    _, wts = moe.route_reference(logits, k)
    torch.testing.assert_close(plan.topk_w, wts, rtol=1e-5, atol=1e-6)
    assert int((plan.sorted_pair != -7).sum() + (plan.block_expert != -7).sum()) == 0
    assert int(counter) == 0, "counter not reset"


@pytest.mark.parametrize("t,e,h,inter,k", [(1, 16, 512, 256, 8), (4, 16, 512, 256, 8),
                                           (8, 32, 2048, 768, 8), (1, 32, 2048, 768, 8),
                                           (3, 16, 512, 256, 4)])  # fmt: skip
def test_moe_experts(t, e, h, inter, k):
    from trace_common.kernels import cuda_small, moe

    torch.manual_seed(t + h)
    x = _rand(t, h, seed=21)
    wgu = _rand(e, 2 * inter, h, std=0.05, seed=22)
    wd = _rand(e, h, inter, std=0.05, seed=23)
    ids, wts = moe.route_reference(torch.randn(t, e, device=DEV), k)
    sp, be = moe.align_reference(ids, e, 8)
    act = _nan(t * k, inter)
    cuda_small.moe_gate_up(x, wgu, sp, be, act, top_k=k)
    assert torch.isfinite(act.float()).all(), "unwritten act rows"
    by_pairs = _nan(t * k, inter)  # one pair per CTA: the same MMA column, the same bits
    cuda_small.moe_gate_up(x, wgu, None, None, by_pairs, top_k=k, topk_ids=ids)
    assert torch.equal(by_pairs, act), "gate_up by pairs differs from by blocks"
    e_of = ids.reshape(-1).long()
    rows = x.float().repeat_interleave(k, 0)
    gu = torch.einsum("ph,pnh->pn", rows, wgu[e_of].float())
    act_ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    assert sqnr_db(act_ref, act) > 40, f"gate_up SQNR {sqnr_db(act_ref, act):.1f} dB <= 40"
    y = _nan(t, h)
    cuda_small.moe_down(act, wd, ids, wts, y)
    pair = torch.einsum("pi,phi->ph", act.float(), wd[e_of].float()) * wts.reshape(-1, 1)
    pair = pair.bfloat16().float().view(t, k, h)
    y_ref = torch.zeros(t, h, device=DEV)
    for j in range(k):
        y_ref += pair[:, j]
    assert sqnr_db(y_ref, y) > 40, f"down + top-k sum SQNR {sqnr_db(y_ref, y):.1f} dB <= 40"


def _engine(fp4: bool, gemm: str | None, batch: int, small: bool, layers: int = 3):
    from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights

    shape = EngineShape.named(
        num_layers=layers, hidden_size=512, num_experts=32, moe_intermediate_size=256,
        vocab_size=4096,
    )  # fmt: skip
    w = EngineWeights.random(shape, DEV, seed=1)
    if fp4:
        w.quantize_experts_(gemm)
    eng = DecodeEngine(shape, w, batch=batch, capacity=600, context=500,
                       guided_layers=(2,) if fp4 else (), device=DEV,
                       small_batch=small)  # fmt: skip
    eng.fill_context_()
    eng.tokens.random_(0, shape.vocab, generator=torch.Generator(device=DEV).manual_seed(3))
    return eng, shape, w


@pytest.mark.parametrize("fp4,gemm,batch", [(False, None, 1), (False, None, 4), (False, None, 8),
                                            (True, "cuda", 1), (True, "cuda", 4),
                                            (True, "triton", 4)])  # fmt: skip
def test_engine_small_graph_replay_equals_eager(fp4, gemm, batch):
    """The small-batch step (both prologue paths) replays to the eager step's logits."""
    eng, _, _ = _engine(fp4, gemm, batch, small=True)
    assert eng.small
    eng.capture(warmup=1)
    state = [eng.tokens, eng.pos, eng.lens, *(c.codes if fp4 else c.values for c in eng.caches)]
    saved = [t.clone() for t in state]
    eng.replay()
    torch.cuda.synchronize()
    replayed = {"tokens": eng.tokens.clone(), "logits": eng.logits.clone()}
    for t, before in zip(state, saved, strict=True):
        t.copy_(before)
    eng.step()  # eager, from the same state
    torch.cuda.synchronize()
    assert torch.isfinite(replayed["logits"].float()).all()
    for name, got in replayed.items():
        assert torch.equal(getattr(eng, name), got), f"graph replay and eager step: {name} differ"


def test_engine_small_matches_standard_step():
    """One eager BF16 step on the small-batch kernels vs the standard kernels (cuBLAS, Triton)
    from the same state: same math up to accumulation order (a routing tie can flip an
    expert, hence the loose bound)."""
    from trace_common.kernels.engine import DecodeEngine

    eng, shape, w = _engine(False, None, 4, small=True, layers=2)
    ref = DecodeEngine(shape, w, batch=4, capacity=600, context=500, device=DEV,
                       small_batch=False)  # fmt: skip
    ref.fill_context_()
    ref.tokens.copy_(eng.tokens)
    _steps_agree(ref, eng, "small-batch step vs standard step")


def _steps_agree(ref, eng, what: str) -> None:
    """One eager step of each engine (from the same state): same math up to accumulation
    order, so their logits agree within 20 dB SQNR (a routing tie can flip an expert)."""
    ref.step()
    eng.step()
    torch.cuda.synchronize()
    got = sqnr_db(ref.logits, eng.logits)
    print(f"{what}: logits SQNR {got:.1f} dB")
    assert got > 20, f"{what}: logits SQNR {got:.1f} dB <= 20"


@pytest.mark.parametrize("fp4", [False, True])
def test_engine_standard_step_gemv_sites(fp4, monkeypatch):
    """The standard step with all its projections on the small-batch GEMV vs on cuBLAS, from
    the same state: same math up to accumulation order (logits SQNR > 20 dB, a routing tie can
    flip an expert); its graph replay equals its eager step."""
    from trace_common.kernels import engine

    monkeypatch.setattr(engine, "step_gemv_sites", lambda *a: frozenset(engine.STEP_GEMV_SITES))
    eng, _, _ = _engine(fp4, "cuda" if fp4 else None, 6, small=False, layers=2)
    assert eng.gemv_sites == {"qkv", "o", "router"}
    monkeypatch.setattr(engine, "step_gemv_sites", lambda *a: frozenset())
    ref, _, _ = _engine(fp4, "cuda" if fp4 else None, 6, small=False, layers=2)
    assert not ref.gemv_sites
    state = [eng.tokens, eng.pos, eng.lens, *(c.codes if fp4 else c.values for c in eng.caches)]
    saved = [t.clone() for t in state]
    _steps_agree(ref, eng, "standard step, GEMV vs cuBLAS projections")
    eager = eng.logits.clone()
    eng.capture(warmup=1)
    for t, before in zip(state, saved, strict=True):
        t.copy_(before)
    eng.replay()
    torch.cuda.synchronize()
    assert torch.equal(eng.logits, eager), "graph replay and eager step differ"


def test_gemv_pdl_waits_for_its_predecessor():
    """A PDL-launched GEMV right after a slow kernel that writes its input reads the finished
    input (griddepcontrol.wait after the weight prefetch), and a normal launch after it reads
    its finished output: bit-identical to the plain launch."""
    from trace_common.kernels import cuda_small

    k, n, m = 2048, 2048, 1 << 16
    w = _rand(n, k, std=0.02, seed=1)
    a = _rand(1, m, std=0.02, seed=2)
    b = _rand(m, k, seed=3)  # x = a @ b: ~270 MB read, long enough for an early start to show
    x = torch.empty(1, k, dtype=torch.bfloat16, device=DEV)
    outs = {}
    for pdl in (False, True):
        for _ in range(3):
            x.fill_(float("nan"))
            out = _nan(1, n)
            torch.cuda.synchronize()
            torch.mm(a, b, out=x)
            cuda_small.gemv(x, w, out, warps=8, pdl=pdl)
            outs.setdefault(pdl, []).append(out.clone())  # a normal launch after the PDL one
        torch.cuda.synchronize()
    ref = (x.float() @ w.float().t()).bfloat16()
    assert sqnr_db(ref, outs[False][0]) > 40
    for got in outs[True]:
        assert torch.isfinite(got.float()).all(), "the PDL GEMV read its input before the wait"
        assert torch.equal(got, outs[False][0]), "PDL and plain GEMV launches differ"


@pytest.mark.parametrize("fp4,gemm,batch", [(False, None, 1), (False, None, 8),
                                            (True, "cuda", 1)])  # fmt: skip
def test_engine_small_pdl_equals_plain_launches(fp4, gemm, batch):
    """Three graph replays of the step with programmatic dependent launches give, step by step,
    the tokens and logits of three eager steps with plain launches from the same state (the
    kernels are deterministic; PDL only changes when they start)."""
    eng, _, _ = _engine(fp4, gemm, batch, small=True)
    eng.pdl = True
    eng.capture(warmup=1)
    state = [eng.tokens, eng.pos, eng.lens, *(c.codes if fp4 else c.values for c in eng.caches)]
    saved = [t.clone() for t in state]
    with_pdl = []
    for _ in range(3):
        eng.replay()
        with_pdl.append((eng.tokens.clone(), eng.logits.clone()))
    torch.cuda.synchronize()
    for t, before in zip(state, saved, strict=True):
        t.copy_(before)
    eng.pdl = False
    for i, (tokens, logits) in enumerate(with_pdl):
        eng.step()
        torch.cuda.synchronize()
        assert torch.isfinite(logits.float()).all()
        assert torch.equal(eng.logits, logits), f"step {i}: logits differ with PDL"
        assert torch.equal(eng.tokens, tokens), f"step {i}: tokens differ with PDL"


def _fp4_rows(rows: int, k: int):
    """Poisoned NVFP4 row buffers with the dq16 operand, and compact-record buffers."""
    from trace_common.kernels import moe_layout
    from trace_common.kernels.quant import CompactRecordBuffers

    u8 = dict(dtype=torch.uint8, device=DEV)
    xq = moe_layout.FP4Rows(torch.full((rows, k // 2), 0xA5, **u8), torch.full((rows, k // 16), 0xA5, **u8),
                     _nan(rows, dtype=torch.float32), _nan(rows, k, dtype=torch.float16))  # fmt: skip
    rec = CompactRecordBuffers.allocate(rows, k, DEV)
    rec.mbits.fill_(0xA5)
    rec.block_scales.fill_(0xA5)
    rec.row_scales.fill_(float("nan"))
    return xq, rec


def _assert_rows_equal(xq, rec, x, what: str) -> None:
    """xq (and rec, if given) equal quant.quantize_rows(x, ...) bit for bit."""
    from trace_common.kernels.quant import quantize_rows

    ref_q, ref_rec = _fp4_rows(*x.shape)
    quantize_rows(x, scale_2=None, capture=None if rec is None else ref_rec, dq16=ref_q.dq16,
                  out=(ref_q.codes, ref_q.scales, ref_q.scale_2))  # fmt: skip
    pairs = [("codes", xq.codes, ref_q.codes), ("scales", xq.scales, ref_q.scales),
             ("scale_2", xq.scale_2, ref_q.scale_2), ("dq16", xq.dq16, ref_q.dq16)]  # fmt: skip
    if rec is not None:
        pairs += [("record mbits", rec.mbits, ref_rec.mbits),
                  ("record scales", rec.block_scales, ref_rec.block_scales),
                  ("record scale_2", rec.row_scales, ref_rec.row_scales)]  # fmt: skip
    for name, got, ref in pairs:
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), f"{what}: {name}"


@pytest.mark.parametrize("t,e,h,capture", [(1, 128, 2048, True), (3, 128, 2048, False),
                                           (8, 128, 2048, True), (4, 32, 512, True)])  # fmt: skip
def test_router_topk_quantizes_xn(t, e, h, capture):
    """router_topk with xq: its extra CTA's NVFP4 rows of xn (codes, scales, scale_2, dq16 and
    the compact record) equal quant.quantize_rows(xn) bit for bit; every other output equals
    the launch without it."""
    from trace_common.kernels import cuda_small, moe_layout

    eps, k, bm = 1e-6, 8, 8
    resid, delta = _rand(t, h, seed=31), _rand(t, h, std=0.5, seed=32)
    resid[0, :16] = 0  # an all-zero block
    delta[0, :16] = 0
    ln_w = _norm_weight(h, seed=33)
    w = _rand(e, h, std=0.02, seed=34)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    outs = {}
    for fused in (False, True):
        plan = moe_layout.RoutePlan.allocate(t, e, k, bm, DEV)
        r_out, xn, logits = _nan(t, h), _nan(t, h), _nan(t, e)
        xq, rec = _fp4_rows(t, h)
        cuda_small.router_topk(resid_in=resid, delta=delta, nsum=1, ln_w=ln_w, eps=eps,
                               resid_out=r_out, xn_out=xn, w_router=w, logits=logits,
                               counter=counter, topk_ids=plan.topk_ids, topk_w=plan.topk_w,
                               sorted_pair=plan.sorted_pair, block_expert=plan.block_expert,
                               block_m=bm, pdl=fused, xq=xq if fused else None,
                               capture=rec if fused and capture else None)  # fmt: skip
        outs[fused] = (r_out, xn, logits, plan.topk_ids, plan.topk_w, plan.sorted_pair,
                       plan.block_expert)  # fmt: skip
    torch.cuda.synchronize()
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "router outputs differ"
    _assert_rows_equal(xq, rec if capture else None, outs[True][1], "router xq")
    assert int(counter) == 0, "counter not reset"


@pytest.mark.parametrize("t,e,h,inter", [(1, 128, 2048, 768), (8, 128, 2048, 768),
                                         (4, 32, 512, 256)])  # fmt: skip
def test_fp4_gate_up_quantizes_act(t, e, h, inter):
    """The CUDA FP4 gate_up with quant_out (each expert block's last CTA) and PDL: act equal to
    the plain launch, its NVFP4 rows equal quant.quantize_rows(act) bit for bit, the counters
    left at zero; the down GEMM after it (PDL) equal to the plain one."""
    from trace_common.kernels import cuda_moe, moe, moe_layout
    from trace_common.kernels.quant import quantize_rows

    k = 8
    gu = moe.quantize_weights(_rand(e, 2 * inter, h, std=0.05, seed=41), shared_halves=True)
    dn = moe.quantize_weights(_rand(e, h, inter, std=0.05, seed=42), shared_halves=False)
    gu.pack_for_cuda_()
    dn.pack_for_cuda_()
    plan = moe_layout.RoutePlan.allocate(t, e, k, 8, DEV)
    ids, wts = moe.route_reference(torch.randn(t, e, device=DEV), k)
    plan.topk_ids.copy_(ids)
    plan.topk_w.copy_(wts)
    sp, be = moe.align_reference(ids, e, 8)
    plan.sorted_pair.copy_(sp)
    plan.block_expert.copy_(be)
    xq, _ = _fp4_rows(t, h)
    quantize_rows(_rand(t, h, seed=43), scale_2=None, dq16=xq.dq16,
                  out=(xq.codes, xq.scales, xq.scale_2))  # fmt: skip
    counter = torch.zeros(plan.block_expert.numel(), dtype=torch.int32, device=DEV)
    acts, ys = {}, {}
    for fused in (False, True):
        act = _nan(t * k, inter)
        actq, _ = _fp4_rows(t * k, inter)
        cuda_moe.moe_gemm_cuda(xq, gu, plan, gated=True, a_div=k, mul_route_w=False, out=act,
                               kernel="mma", pdl=fused, quant_out=actq if fused else None,
                               counter=counter)  # fmt: skip
        if not fused:
            quantize_rows(act, scale_2=None, dq16=actq.dq16,
                          out=(actq.codes, actq.scales, actq.scale_2))  # fmt: skip
        y = _nan(t * k, h)
        cuda_moe.moe_gemm_cuda(actq, dn, plan, gated=False, a_div=1, mul_route_w=True, out=y,
                               kernel="mma", pdl=fused)  # fmt: skip
        acts[fused], ys[fused] = act, y
        torch.cuda.synchronize()
        if fused:
            _assert_rows_equal(actq, None, act, "gate_up quant_out")
    assert torch.isfinite(acts[True].float()).all(), "unwritten act rows"
    assert torch.equal(acts[False], acts[True]), "gate_up output differs with quant_out/PDL"
    assert torch.equal(ys[False], ys[True]), "down output differs"
    assert int(counter.abs().sum()) == 0, "counters not reset"


@pytest.mark.parametrize("batch", [1, 4])
def test_engine_small_fp4_fusions_equal_unfused(batch, monkeypatch):
    """The FP4 small-batch step with its fusions (cuda_small.FP4_FUSE: quantizes folded into
    router_topk and gate_up, the KV append into the attention kernel, PDL expert GEMMs) equals
    the step without them bit for bit (logits, tokens, FP4 KV cache, guidance records), eager
    and replayed."""
    from trace_common.kernels import cuda_small

    default = cuda_small.FP4_FUSE
    results = {}
    for spec in ("none", "default"):
        monkeypatch.setattr(cuda_small, "FP4_FUSE", default if spec == "default" else frozenset())
        eng, _, _ = _engine(True, "cuda", batch, small=True)
        eng.pdl = True
        eng.step()
        eng.capture(warmup=1)
        eng.replay()
        torch.cuda.synchronize()
        rec = eng.records[2]
        results[spec] = [eng.logits, eng.tokens,
                         *(t for c in eng.caches for t in (c.codes, c.scales, c.row_scales)),
                         *(t for r in rec for t in (r.mbits, r.block_scales, r.row_scales))]  # fmt: skip
        assert eng.kv_append_site == ("launch" if spec == "none" else "attention")
    for i, (a, b) in enumerate(zip(results["none"], results["default"], strict=True)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"output {i} differs"


@pytest.mark.parametrize("t,e,h,quant", [(1, 128, 2048, False), (1, 128, 2048, True),
                                         (8, 128, 2048, True), (3, 32, 512, True),
                                         (5, 64, 2048, False), (2, 256, 2048, True)])  # fmt: skip
def test_router_topk_cluster_equals_counter_path(t, e, h, quant):
    """router_topk as one thread-block cluster (logits exchanged in CTA 0's shared memory, the
    quantize in the last CTA) writes what the counter path writes, bit for bit: residual, xn,
    logits, routing, block layout, NVFP4 rows and record; PDL and plain launches, twice. (256
    experts = 16 CTAs, past the portable cluster size: the counter path runs.)"""
    from trace_common.kernels import cuda_small, moe_layout

    eps, k, bm = 1e-6, 8, 8
    resid, delta = _rand(t, h, seed=41), _rand(t, h, std=0.5, seed=42)
    ln_w = _norm_weight(h, seed=43)
    w = _rand(e, h, std=0.02, seed=44)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    outs = {}
    for cluster in (False, True):
        for pdl in (False, True):
            plan = moe_layout.RoutePlan.allocate(t, e, k, bm, DEV)
            plan.block_expert.fill_(-7)
            plan.sorted_pair.fill_(-7)
            r_out, xn, logits = _nan(t, h), _nan(t, h), _nan(t, e)
            xq, rec = _fp4_rows(t, h) if quant else (None, None)
            cuda_small.router_topk(resid_in=resid, delta=delta, nsum=1, ln_w=ln_w, eps=eps,
                                   resid_out=r_out, xn_out=xn, w_router=w, logits=logits,
                                   counter=counter, topk_ids=plan.topk_ids, topk_w=plan.topk_w,
                                   sorted_pair=plan.sorted_pair, block_expert=plan.block_expert,
                                   block_m=bm, pdl=pdl, xq=xq, capture=rec, cluster=cluster)  # fmt: skip
            got = [r_out, xn, logits, plan.topk_ids, plan.topk_w, plan.sorted_pair,
                   plan.block_expert]  # fmt: skip
            if quant:
                got += [xq.codes, xq.scales, xq.scale_2, xq.dq16, rec.mbits, rec.block_scales,
                        rec.row_scales]  # fmt: skip
            outs[cluster, pdl] = got
    torch.cuda.synchronize()
    assert torch.isfinite(outs[True, True][2].float()).all()
    ref = outs[False, False]
    for key, got in outs.items():
        for i, (a, b) in enumerate(zip(ref, got, strict=True)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{key}: output {i}"
    assert int(counter) == 0, "counter not reset"


def _replayed_outputs(fp4: bool, gemm: str | None, batch: int) -> tuple:
    """(engine, [logits, tokens, KV caches, layer 2's guidance records (FP4)]) of a small-batch
    engine built under the current environment: one eager step, then captured and replayed
    twice with PDL."""
    eng, _, _ = _engine(fp4, gemm, batch, small=True)
    eng.pdl = True
    eng.step()
    eng.capture(warmup=1)
    eng.replay()
    eng.replay()
    torch.cuda.synchronize()
    out = [eng.logits, eng.tokens]
    for c in eng.caches:
        out += [c.codes, c.scales, c.row_scales] if fp4 else [c.values]
    if fp4:
        out += [t for r in eng.records[2] for t in (r.mbits, r.block_scales, r.row_scales)]
    return eng, out


def _assert_same_bytes(ref: list, got: list) -> None:
    assert torch.isfinite(got[0].float()).all(), "non-finite logits"
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"output {i} differs"


@pytest.mark.parametrize("fp4,gemm", [(False, None), (True, "cuda")])
@pytest.mark.parametrize("batch", [1, 2])
def test_engine_small_experts_by_pairs_equals_blocks(batch, fp4, gemm, monkeypatch):
    """The small-batch step with the expert GEMMs by pairs (the router lays out no blocks)
    equals the step by blocks (logits, tokens, KV cache, guidance records), eager and replayed
    with PDL."""
    results = {}
    from trace_common.kernels import cuda_small

    default = cuda_small.PAIRS_MAX_BATCH
    for mode in ("blocks", "pairs"):
        monkeypatch.setattr(cuda_small, "PAIRS_MAX_BATCH", default if mode == "pairs" else 0)
        eng, results[mode] = _replayed_outputs(fp4, gemm, batch)
        assert eng.experts_by_pairs == (mode == "pairs")
    _assert_same_bytes(results["blocks"], results["pairs"])
