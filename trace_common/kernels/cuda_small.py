"""Small-batch (1-8 tokens) BF16 decode kernels in CUDA C++ (`cuda/small_batch.cu`).

At batch 1 the decode step is ~13 launches per layer, most of them tiny, and cuBLAS reads the
projection weights at about half the copy bandwidth. These kernels stream the weights through
the tensor cores (swap-AB `mma.sync`, a cp.async ring per warp, see the .cu) and fold the small
ops into them, so a layer is 7 launches: qkv (+ add/RMSNorm prologue, q/k norm + RoPE + BF16
KV append), attention split + reduce (unchanged), o, router (+ add/RMSNorm, softmax, top-k,
block layout), expert gate_up, expert down (+ routing weights and the top-k sum).

On the FP4 engine some of them also take over NVFP4 quantize launches, bit-exact with
`quant.quantize_rows` (FP4_FUSE): router_topk writes the experts' input rows (`xq`) and
gate_up the down GEMM's input rows.

Compiled by NVRTC through CuPy on first use and launched on PyTorch's current stream, so the
engine's CUDA graph captures them (`cuda_launch`). Importing this module needs neither CuPy
nor a GPU. The engine uses them up to AUTO_MAX_BATCH tokens (`small_batch_enabled`).

`pdl=True` launches a kernel as a programmatic dependent launch (`cuda_launch.launch_ex`;
the engine's default on sm_90): it starts while the kernel before it drains, and streams its weights
into its cp.async ring before `griddepcontrol.wait` (the expert kernels wait first: their
weights depend on the routing). Every kernel here waits before it touches activations, so any
neighbour (PDL or not, ours or cuBLAS/Triton) is safe.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trace_common.kernels import cupy_available
from trace_common.kernels.cuda_launch import (
    MAX_PORTABLE_CLUSTER,
    compiled_function,
    launch_on_torch_stream,
    pointers,
)
from trace_common.kernels.quant import check_buffer as _check

if TYPE_CHECKING:
    from trace_common.kernels.moe_layout import FP4Rows
    from trace_common.kernels.quant import CompactRecordBuffers

SOURCE = pathlib.Path(__file__).with_name("cuda") / "small_batch.cu"
MAX_TOKENS = 8  # MMA N: the tokens of one step are the 8 columns of the B operand
GEMV_MAX_TOKENS = 32  # `gemv` alone: up to 4 such columns per weight stage
HEAD_DIM = 128
TILE_ROWS = 16  # weight rows per MMA tile (A operand)
CHUNK = 32  # k per lane-quad load round: 4 lanes x 8 bf16
MAX_EXPERTS = 256
MAX_TOP_K = 8
MAX_SLOTS = 1536  # sorted_pair entries the router lays out in shared memory (.cu MAX_SLOTS)
RING_BYTES_PER_TILE_CHUNK = 2 * 32 * 16  # rows g and g + 8, 32 lanes, 16 bytes
# Loads per ring stage (chunks per warp per stage) and stages: 4 chunks x 2 rows x 512 bytes
# = 4 KB per warp per stage (RT = 1), 3 stages in flight. Warps per CTA per call site below.
DEFAULT_RING = {"RING_STAGES": 3, "RING_STAGE_CHUNKS": 4}
RING_KNOBS = tuple(DEFAULT_RING)
# in force: DEFAULT_RING with the configured launch shapes on top (configure() below)
RING_STAGES, RING_STAGE_CHUNKS = DEFAULT_RING["RING_STAGES"], DEFAULT_RING["RING_STAGE_CHUNKS"]
# The add + RMSNorm prologue is recomputed by every CTA of the qkv GEMV: worth it while the rows
# it sums are few (tokens x (delta rows + residual)); else one add_rmsnorm launch before it.
PROLOGUE_MAX_ROWS = 9
# The engine takes these kernels up to this batch. On an H200 they beat the standard kernels
# at batch 1-2 and lose from batch 4 on: the expert GEMVs re-read an expert once per token that
# chose it, and past PROLOGUE_MAX_ROWS the fused prologues give way to add_rmsnorm launches.
AUTO_MAX_BATCH = 2


# The FP4 expert path's fusions on the small-batch step (engine._step_small), all bit-exact:
# "pdl": the expert GEMMs as programmatic dependent launches; "xq": the experts' input quantize
# (and the `moe_in` record) in router_topk (the last CTA of its cluster, or an extra CTA);
# "act": the activation quantize in the gate_up GEMM (last CTA of each expert block);
# "kv_attn": the FP4 KV append (and the k, v records) inside the attention kernel (the CTAs of
# the split holding the new token, attention.decode_attention's kv_new).
FP4_FUSE = frozenset({"pdl", "xq", "act", "kv_attn"})


# router_topk as one thread-block cluster (E / 16 <= 8 CTAs): the logits meet in CTA 0's shared
# memory behind one cluster barrier instead of a fence, an atomic counter and L2 reads by the
# last CTA, and the FP4 engine's quantize runs in the last CTA beside CTA 0's tail instead of in
# an extra CTA the tail waited for. More experts than a portable cluster holds take the
# counter path.
#
# qkv_rope in clusters of 8 CTAs, one per head: the head's rows meet in CTA 0's shared memory
# behind one cluster barrier.

# The small step's expert GEMMs by pairs (one expert per CTA row, from topk_ids) instead of by
# the router's block layout, which the router then skips: BF16 moe_gate_up here, FP4 the CUDA
# mma kernel (cuda_moe.moe_gemm_cuda by_pairs), up to PAIRS_MAX_BATCH tokens, where tokens
# rarely share an expert, so a block layout would only add the router's layout work.
PAIRS_MAX_BATCH = 2


def experts_by_pairs(batch: int) -> bool:
    """Whether the small-batch step runs its expert GEMMs by pairs at `batch` tokens."""
    return batch <= PAIRS_MAX_BATCH


def small_batch_enabled(batch: int) -> bool:
    """Whether the engine uses these kernels for `batch` tokens by default: up to
    AUTO_MAX_BATCH tokens, where CuPy is importable."""
    return batch <= AUTO_MAX_BATCH and cupy_available()


@dataclass(frozen=True, slots=True)
class Split:
    """How one GEMV splits K: WK warps, KCW 32-wide chunks per warp, U chunks per ring stage,
    NS stages; `smem` = the warps' rings in bytes (dynamic shared memory)."""

    wk: int
    kcw: int
    u: int
    ns: int
    smem: int


def supports(batch: int, *, hidden: int, head_dim: int, moe_inter: int, num_experts: int,
             top_k: int, vocab: int) -> bool:  # fmt: skip
    """Whether these kernels handle a decode step of `batch` tokens of this model shape."""
    return (
        0 < batch <= MAX_TOKENS
        and head_dim == HEAD_DIM
        and hidden % 256 == 0
        and hidden <= 2048  # the prologue keeps <= 8 normalized rows in static shared memory
        and moe_inter % 32 == 0
        and num_experts % 16 == 0
        and num_experts <= MAX_EXPERTS
        and top_k <= MAX_TOP_K
        and vocab % 16 == 0
    )


def gemv_supported(n: int, k: int) -> bool:
    """Whether `gemv` takes a weight of [n, k] (whole 16-row tiles, whole 32-wide k chunks)."""
    return n > 0 and k > 0 and n % TILE_ROWS == 0 and k % CHUNK == 0


def split_k(k: int, warps: int, rt: int = 1, stages: int | None = None) -> Split:
    """Split K over `warps` warps (fewer if K is too short) for tiles of `rt` x 16 rows, with
    `stages` ring stages (default RING_STAGES; at most one per round)."""
    if k % CHUNK:
        raise ValueError(f"K={k} must be a multiple of {CHUNK}")
    wk = warps
    while wk > 1 and k % (CHUNK * wk):
        wk //= 2
    kcw = k // (CHUNK * wk)
    u = max(d for d in range(1, max(1, RING_STAGE_CHUNKS // rt) + 1) if kcw % d == 0)
    ns = min(stages or RING_STAGES, kcw // u)
    return Split(wk, kcw, u, ns, wk * ns * u * rt * RING_BYTES_PER_TILE_CHUNK)


# warps per CTA of each call site (tuned by hand for the Qwen3-30B-A3B shape on an H200: each
# CTA's rings fit 2-4 CTAs per SM; docs in the module docstring of the .cu)
DEFAULT_WARPS = {"qkv": 8, "o": 8, "router": 8, "lm_head": 4, "gate_up": 4}
# Ring stages of one call site instead of RING_STAGES ("<site>_stages" in `configure`).
STAGE_SITES = ("qkv", "router", "gate_up", "down")
# Launch shapes by token count where the best differs, used unless `configure` names the key
# (bench/experiments/small_batch_sweep.py): down's ring 5 deep at batch 1 (one
# CTA per SM, whose stages stream while gate_up runs; a sixth stage no longer fits beside a
# gate_up CTA), 3 at batch 2 (two CTAs per SM share the shared memory); gate_up on 8 warps at
# batch 2.
BY_TOKENS: dict[tuple[str, int], int] = {("down_stages", 1): 5, ("down_stages", 2): 3,
                                         ("gate_up", 2): 8}  # fmt: skip
WARPS = dict(DEFAULT_WARPS)
STAGES: dict[str, int] = {}
_NAMED: set[str] = set()  # the keys the configuration in force names


def stages_of(site: str, tokens: int) -> int | None:
    """Ring stages of call site `site` for `tokens` tokens (None: RING_STAGES)."""
    key = f"{site}_stages"
    return STAGES[site] if key in _NAMED else BY_TOKENS.get((key, tokens))


def warps_of(site: str, tokens: int) -> int:
    """Warps per CTA of call site `site` for `tokens` tokens."""
    return WARPS[site] if site in _NAMED else BY_TOKENS.get((site, tokens), WARPS[site])


def config() -> dict[str, int]:
    """The launch shapes in force: every site's warps, the ring knobs, site stages where set."""
    return {**WARPS, "RING_STAGES": RING_STAGES, "RING_STAGE_CHUNKS": RING_STAGE_CHUNKS,
            **{f"{k}_stages": v for k, v in STAGES.items()}}  # fmt: skip


def check_config(spec: str | dict[str, int] | None) -> dict[str, int]:
    """The launch shapes `spec` names (a dict, its JSON text, or None: none), checked: keys of
    WARPS, RING_KNOBS or "<site>_stages" of a STAGE_SITES site, positive integers; a bad key or
    value raises ValueError naming it."""
    cfg = json.loads(spec) if isinstance(spec, str) else dict(spec or {})
    stage_keys = tuple(f"{site}_stages" for site in STAGE_SITES)
    for key, val in cfg.items():
        if key not in DEFAULT_WARPS and key not in RING_KNOBS and key not in stage_keys:
            raise ValueError(f"small-batch launch shape key {key!r}: expected one of "
                             f"{(*DEFAULT_WARPS, *RING_KNOBS, *stage_keys)}")  # fmt: skip
        if type(val) is not int or val < 1:
            raise ValueError(f"small-batch launch shape {key}={val!r}: expected a positive "
                             "integer")  # fmt: skip
    return cfg


def configure(spec: str | dict[str, int] | None = None) -> dict[str, int]:
    """Set the launch shapes: the defaults, with `spec` (a dict or its JSON text; None: none)
    on top (`KernelSettings.small_launch`), e.g.
    '{"qkv": 16, "RING_STAGES": 4, "down_stages": 4}': keys of WARPS (warps per CTA of a call site), RING_KNOBS or "<site>_stages" (a STAGE_SITES
    site's ring stages), positive integers (bench/experiments/small_batch_sweep.py searches
    them). A key it names also replaces that key's BY_TOKENS values; `configure({})` restores the
    defaults. Returns config(); a bad key or value raises ValueError naming it and changes
    nothing."""
    global RING_STAGES, RING_STAGE_CHUNKS
    cfg = check_config(spec)
    stage_keys = tuple(f"{site}_stages" for site in STAGE_SITES)
    WARPS.clear()
    WARPS.update({k: cfg.get(k, v) for k, v in DEFAULT_WARPS.items()})
    _NAMED.clear()
    _NAMED.update(cfg)
    STAGES.clear()
    STAGES.update({k.removesuffix("_stages"): v for k, v in cfg.items() if k in stage_keys})
    RING_STAGES = cfg.get("RING_STAGES", DEFAULT_RING["RING_STAGES"])
    RING_STAGE_CHUNKS = cfg.get("RING_STAGE_CHUNKS", DEFAULT_RING["RING_STAGE_CHUNKS"])
    return config()


configure()


def _tokens(t: int) -> None:
    if not 0 < t <= MAX_TOKENS:
        raise ValueError(f"{t} tokens: the small-batch kernels take 1..{MAX_TOKENS}")


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, warps: int = 8,
         pdl: bool = False) -> None:  # fmt: skip
    """out [T, N] = x [T, K] @ w [N, K]^T in bf16 (fp32 accumulate), T <= GEMV_MAX_TOKENS:
    up to MAX_TOKENS as one 8-token MMA column (`gemv_bf16`), more as ceil(T / 8) columns per
    weight stage (`gemv_bf16_tiles`; not a programmatic dependent launch, `pdl` must be off)."""
    import numpy as np

    t, k = x.shape
    n = w.shape[0]
    if not 0 < t <= GEMV_MAX_TOKENS:
        raise ValueError(f"{t} tokens: gemv takes 1..{GEMV_MAX_TOKENS}")
    if n % TILE_ROWS:
        raise ValueError(f"N={n} must be a multiple of {TILE_ROWS}")
    _check("w", w, torch.bfloat16, (n, k))
    _check("x", x, torch.bfloat16, (t, k))
    _check("out", out, torch.bfloat16, (t, n))
    sp = split_k(k, warps)
    shape = f"{sp.wk}, {sp.kcw}, {sp.u}, {sp.ns}"
    args = (*pointers(w, x, out), np.int32(n))
    if t <= MAX_TOKENS:
        fn = compiled_function(SOURCE, f"gemv_bf16<{t}, {shape}>", sp.smem)
    else:
        if pdl:
            raise ValueError(f"gemv of {t} > {MAX_TOKENS} tokens is not launched with PDL")
        fn = compiled_function(SOURCE, f"gemv_bf16_tiles<{-(-t // 8)}, {shape}>", sp.smem)
        args += (np.int32(t),)
    launch_on_torch_stream(fn, (n // TILE_ROWS,), (sp.wk * 32,), args, out.device, sp.smem,
                           pdl)  # fmt: skip


def _prologue_args(resid_in: torch.Tensor, delta: torch.Tensor | None, nsum: int,
                   ln_w: torch.Tensor, resid_out: torch.Tensor) -> tuple:  # fmt: skip
    import numpy as np

    t, h = resid_in.shape
    _check("resid_in", resid_in, torch.bfloat16, (t, h))
    _check("resid_out", resid_out, torch.bfloat16, (t, h))
    _check("ln_w", ln_w, torch.bfloat16, (h,))
    if nsum < 0 or (nsum > 0) != (delta is not None):
        raise ValueError(f"nsum={nsum} with delta {'given' if delta is not None else 'None'}")
    if delta is not None:
        _check("delta", delta, torch.bfloat16, (t * nsum, h))
    return (*pointers(resid_in, delta), np.int32(nsum), *pointers(ln_w))


def qkv_rope(
    *,
    w_qkv: torch.Tensor,  # bf16 [(HQ + 2 HKV) 128, H]
    qkv: torch.Tensor,  # bf16 [T, (HQ + 2 HKV) 128] scratch
    norm_w: torch.Tensor,  # bf16 [2, 128]: q norm, k norm
    pos: torch.Tensor,  # int32 [T]
    inv_freq: torch.Tensor,  # fp32 [64]
    q_out: torch.Tensor,  # bf16 [T, HQ, 128]
    kv_new: torch.Tensor,  # bf16 [2, T, HKV 128]
    cache: torch.Tensor | None,  # bf16 [2, T, HKV, S, 128]: k, v appended at pos
    q_heads: int,
    kv_heads: int,
    eps: float,
    xn: torch.Tensor | None = None,  # bf16 [T, H] normalized input, or the prologue below
    resid_in: torch.Tensor | None = None,  # bf16 [T, H]
    delta: torch.Tensor | None = None,  # bf16 [T nsum, H] summed into the residual
    nsum: int = 0,
    ln_w: torch.Tensor | None = None,  # bf16 [H]
    resid_out: torch.Tensor | None = None,  # bf16 [T, H]
    pdl: bool = False,
) -> None:
    """q, k, v of the new tokens: (RMSNorm(resid_in + sum delta) * ln_w, or xn) @ w_qkv^T, then
    per-head RMSNorm + RoPE of q and k; k and v into kv_new (and the BF16 cache at pos). Each
    head's CTAs run as one thread-block cluster that finishes the head in its CTA 0."""
    import numpy as np

    n, h = w_qkv.shape
    t = q_out.shape[0]
    _tokens(t)
    if n != (q_heads + 2 * kv_heads) * HEAD_DIM:
        raise ValueError(f"w_qkv has {n} rows; {q_heads}+2*{kv_heads} heads of {HEAD_DIM}")
    _check("w_qkv", w_qkv, torch.bfloat16, (n, h))
    _check("qkv", qkv, torch.bfloat16, (t, n))
    _check("q_out", q_out, torch.bfloat16, (t, q_heads, HEAD_DIM))
    _check("kv_new", kv_new, torch.bfloat16, (2, t, kv_heads * HEAD_DIM))
    _check("norm_w", norm_w, torch.bfloat16, (2, HEAD_DIM))
    _check("pos", pos, torch.int32, (t,))
    _check("inv_freq", inv_freq, torch.float32, (HEAD_DIM // 2,))
    cap = 0
    if cache is not None:
        cap = cache.shape[3]
        _check("cache", cache, torch.bfloat16, (2, t, kv_heads, cap, HEAD_DIM))
    pro = xn is None
    if pro:
        if resid_in is None or ln_w is None or resid_out is None:
            raise ValueError("without xn, resid_in, ln_w and resid_out are needed")
        pargs = _prologue_args(resid_in, delta, nsum, ln_w, resid_out)
        rout = resid_out
    else:
        assert xn is not None
        _check("xn", xn, torch.bfloat16, (t, h))
        pargs = (*pointers(None, None), np.int32(0), *pointers(None))
        rout = None
    sp = split_k(h, warps_of("qkv", t), stages=stages_of("qkv", t))
    name = f"qkv_rope_bf16<{t}, {sp.wk}, {sp.kcw}, {sp.u}, {sp.ns}, {str(pro).lower()}>"
    fn = compiled_function(SOURCE, name, sp.smem)
    args = (*pargs, np.float32(eps), *pointers(rout, xn, w_qkv, qkv, norm_w, pos, inv_freq,
            q_out, kv_new, cache), np.int32(cap), np.int32(q_heads), np.int32(kv_heads))  # fmt: skip
    launch_on_torch_stream(fn, (n // TILE_ROWS,), (sp.wk * 32,), args, q_out.device, sp.smem,
                           pdl, cluster=HEAD_DIM // TILE_ROWS)  # fmt: skip


def router_topk(
    *,
    resid_in: torch.Tensor,  # bf16 [T, H]
    delta: torch.Tensor,  # bf16 [T nsum, H]
    nsum: int,
    ln_w: torch.Tensor,  # bf16 [H]
    eps: float,
    resid_out: torch.Tensor,  # bf16 [T, H]
    xn_out: torch.Tensor,  # bf16 [T, H]
    w_router: torch.Tensor,  # bf16 [E, H]
    logits: torch.Tensor,  # bf16 [T, E]
    counter: torch.Tensor,  # int32 [>= 1], zero
    topk_ids: torch.Tensor,  # int32 [T, k]
    topk_w: torch.Tensor,  # fp32 [T, k]
    sorted_pair: torch.Tensor | None,  # int32 [maxb * bm]; None: no block layout
    block_expert: torch.Tensor | None,  # int32 [maxb]
    block_m: int,
    pdl: bool = False,
    xq: FP4Rows | None = None,  # NVFP4 rows of xn: codes [T, H/2], scales [T, H/16], g [T]
    capture: CompactRecordBuffers | None = None,  # rows [T, H]: the `moe_in` record
    cluster: bool = True,
) -> None:
    """xn = RMSNorm(resid_in + sum delta) * ln_w (CTA 0 stores it and the residual), router
    logits, softmax top-k (renormalized) and, unless sorted_pair and block_expert are None,
    the grouped GEMMs' block layout (moe_layout.RoutePlan, pairs of each expert in (j, t) order as
    moe.align_reference). With `xq`, one more CTA also writes xn's NVFP4 rows (and xq.dq16,
    and the compact record into `capture`), equal to quant.quantize_rows(xn, scale_2=None,
    capture=capture, dq16=xq.dq16). `cluster`
    (default True): the E / 16 CTAs as one cluster (E <= 128; more
    experts take the counter path), the same results; `counter` is then unused."""
    import numpy as np

    t, h = resid_in.shape
    e = w_router.shape[0]
    k = topk_ids.shape[1]
    _tokens(t)
    if (sorted_pair is None) != (block_expert is None):
        raise ValueError("sorted_pair and block_expert: both tensors or both None (no layout)")
    maxb = 0 if block_expert is None else block_expert.numel()
    if e % TILE_ROWS or e > MAX_EXPERTS or not 0 < k <= MAX_TOP_K:
        raise ValueError(f"E={e} (multiple of {TILE_ROWS}, <= {MAX_EXPERTS}), top_k={k} "
                         f"(<= {MAX_TOP_K})")  # fmt: skip
    if (h + 32) * 2 < e * 4:  # the logits take the normalized rows' shared memory
        raise ValueError(f"H={h} too small for {e} experts' logits in shared memory")
    if sorted_pair is not None and (maxb * block_m > MAX_SLOTS
                                    or sorted_pair.numel() != maxb * block_m):  # fmt: skip
        raise ValueError(f"block layout of {maxb} x {block_m} slots (<= {MAX_SLOTS}) does not "
                         f"match sorted_pair [{sorted_pair.numel()}]")  # fmt: skip
    pargs = _prologue_args(resid_in, delta, nsum, ln_w, resid_out)
    _check("xn_out", xn_out, torch.bfloat16, (t, h))
    _check("w_router", w_router, torch.bfloat16, (e, h))
    _check("logits", logits, torch.bfloat16, (t, e))
    _check("topk_ids", topk_ids, torch.int32, (t, k))
    _check("topk_w", topk_w, torch.float32, (t, k))
    qargs = _quant_args(xq, capture, t, h)
    sp = split_k(h, warps_of("router", t), stages=stages_of("router", t))
    qx = str(xq is not None).lower()
    cl = e // TILE_ROWS if cluster and e // TILE_ROWS <= MAX_PORTABLE_CLUSTER else 0
    fn = compiled_function(
        SOURCE, f"router_topk_bf16<{t}, {sp.wk}, {sp.kcw}, {sp.u}, {sp.ns}, {qx}, {cl}>", sp.smem
    )
    args = (*pargs, np.float32(eps), *pointers(resid_out, xn_out, w_router, logits, counter,
            topk_ids, topk_w, sorted_pair, block_expert), np.int32(e), np.int32(k),
            np.int32(block_m), np.int32(maxb), *qargs)  # fmt: skip
    grid = e // TILE_ROWS + (xq is not None and not cl)  # + the quantizing CTA
    launch_on_torch_stream(fn, (grid,), (sp.wk * 32,), args, xn_out.device, sp.smem, pdl,
                           cluster=cl)  # fmt: skip


def _quant_args(xq: FP4Rows | None, capture: CompactRecordBuffers | None, t: int,
                h: int) -> tuple:  # fmt: skip
    """Pointers of the router's fused quantize outputs (zeros where there are none)."""
    if xq is None:
        if capture is not None:
            raise ValueError("capture needs xq (the record is written by the quantizing CTA)")
        return pointers(*(None,) * 7)
    xq.check(t, h, "xq")
    rec: tuple = (None, None, None)
    if capture is not None:
        capture.check(t, h, "capture")
        rec = (capture.mbits, capture.block_scales, capture.row_scales)
    return pointers(xq.codes, xq.scales, xq.scale_2, xq.dq16, *rec)


def moe_gate_up(x: torch.Tensor, w: torch.Tensor, sorted_pair: torch.Tensor | None,
                block_expert: torch.Tensor | None, act: torch.Tensor, *, top_k: int,
                topk_ids: torch.Tensor | None = None, pdl: bool = False) -> None:  # fmt: skip
    """act [P, I] = silu(x W_gate^T) * (x W_up^T) per pair p (token p // top_k); w [E, 2I, H]
    (gate rows then up rows). The expert of a pair: its block's in the plan's layout (blocks of
    8 pair slots, block_m 8), or with `topk_ids` [T, top_k] (sorted_pair and block_expert
    None) topk_ids[p], one pair per CTA (`experts_by_pairs`)."""
    import numpy as np

    t, h = x.shape
    e, two_i, _ = w.shape
    inter = two_i // 2
    n_pairs = act.shape[0]
    if topk_ids is not None:
        if sorted_pair is not None or block_expert is not None:
            raise ValueError("gate_up: topk_ids (by pairs) or sorted_pair/block_expert, not both")
        _check("topk_ids", topk_ids, torch.int32, (t, top_k))
        blocks = n_pairs
    elif sorted_pair is None or block_expert is None:
        raise ValueError("gate_up: needs sorted_pair and block_expert, or topk_ids")
    else:
        blocks = block_expert.numel()
        if sorted_pair.numel() != blocks * 8:
            raise ValueError(f"gate_up: {blocks} blocks of 8 slots vs sorted_pair "
                             f"[{sorted_pair.numel()}]")  # fmt: skip
    if inter % TILE_ROWS or n_pairs != t * top_k:
        raise ValueError(f"gate_up: I={inter} (multiple of {TILE_ROWS}), {n_pairs} act rows "
                         f"for {t} tokens x top_k {top_k}")  # fmt: skip
    _check("w", w, torch.bfloat16, (e, two_i, h))
    _check("x", x, torch.bfloat16, (t, h))
    _check("act", act, torch.bfloat16, (n_pairs, inter))
    sp = split_k(h, warps_of("gate_up", t), rt=2, stages=stages_of("gate_up", t))
    fn = compiled_function(SOURCE, f"moe_gate_up_bf16<{sp.wk}, {sp.kcw}, {sp.u}, {sp.ns}>", sp.smem)
    args = (*pointers(w, x, sorted_pair, block_expert, topk_ids, act), np.int32(inter),
            np.int32(n_pairs), np.int32(top_k))  # fmt: skip
    launch_on_torch_stream(fn, (blocks, inter // TILE_ROWS), (sp.wk * 32,), args, act.device,
                           sp.smem, pdl)  # fmt: skip


def moe_down(act: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
             y: torch.Tensor, *, pdl: bool = False) -> None:  # fmt: skip
    """y [T, H] = sum_j bf16(topk_w[t, j] * act[t k + j] @ w[topk_ids[t, j]]^T) (fp32 sum in
    order j, then bf16): the down projection, routing weights and top-k sum of each token.
    With `pdl` it reads topk_ids and streams its weights before it waits: launch it right after
    `moe_gate_up` (whose CTAs wait for the routing before they let it start), or after a
    kernel that has the routing complete by then."""
    import numpy as np

    t, k = topk_ids.shape
    e, h, inter = w.shape
    _tokens(t)
    if h % TILE_ROWS or not 0 < k <= MAX_TOP_K:
        raise ValueError(f"down: H={h} (multiple of {TILE_ROWS}), top_k={k} (<= {MAX_TOP_K})")
    _check("w", w, torch.bfloat16, (e, h, inter))
    _check("act", act, torch.bfloat16, (t * k, inter))
    _check("topk_w", topk_w, torch.float32, (t, k))
    _check("y", y, torch.bfloat16, (t, h))
    sp = split_k(inter, 1, stages=stages_of("down", t))  # one warp per expert, all of K
    fn = compiled_function(SOURCE, f"moe_down_bf16<{k}, {sp.kcw}, {sp.u}, {sp.ns}>", k * sp.smem)
    args = (*pointers(w, act, topk_ids, topk_w, y), np.int32(h))
    launch_on_torch_stream(fn, (t, h // TILE_ROWS), (k * 32,), args, y.device, k * sp.smem, pdl)


__all__ = [
    "AUTO_MAX_BATCH",
    "FP4_FUSE",
    "GEMV_MAX_TOKENS",
    "MAX_TOKENS",
    "PAIRS_MAX_BATCH",
    "PROLOGUE_MAX_ROWS",
    "Split",
    "check_config",
    "configure",
    "experts_by_pairs",
    "gemv",
    "gemv_supported",
    "moe_down",
    "moe_gate_up",
    "qkv_rope",
    "router_topk",
    "small_batch_enabled",
    "split_k",
    "supports",
]
