"""FP4 vs BF16 decode throughput on one GPU (H200): the Qwen3-30B-A3B shape, random weights.

Same engine (trace_common.kernels.engine: Triton kernels + cuBLAS for the BF16 projections,
the whole decode step captured as one CUDA graph) with BF16 weights/KV, and with NVFP4 expert
weights + activations (W4A4) + FP4 KV. Prints, per (context, batch): tokens/s, ms/step, the
HBM bytes the step had to move (weights it touched + KV), achieved bandwidth vs the copy
bandwidth measured in the same run; then the largest batch fitting a fixed memory budget at
the long context; the guidance-capture slowdown; and transformers `generate` (BF16) as the
outside baseline. Writes JSON + a PNG under --out.

    python bench/rollout_gpu.py --out /tmp/rollout_gpu            # full run (~1.5 min on H200)
    python bench/rollout_gpu.py --layers 4 --quick                  # smoke
    python bench/rollout_gpu.py --contexts 1024 --batches 1 8 --budget-gib 0 --hf-batches \
        --small both --no-capture --profile --gemv-table              # small-batch kernels A/B
    python bench/rollout_gpu.py --contexts 1024 --batches 1 8 --budget-gib 0 --hf-batches \
        --pdl both --no-capture                                        # PDL A/B (small path)
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from trace_common.kernels import cuda_small, fp4_attn_impl
from trace_common.kernels.cuda_launch import pdl_enabled
from trace_common.kernels.engine import (
    DecodeEngine,
    EngineShape,
    EngineWeights,
    kv_bytes_per_sequence,
    largest_batch,
    small_batch_supported,
)
from trace_common.kernels.moe import MAX_FUSED_ROUTE_TOKENS
from trace_common.kernels.settings import KernelSettings

GIB = 1 << 30
STEP_MARGIN = 64  # cache capacity beyond the context: warm-up + timed steps
FIT_HEADROOM = 4 * GIB  # left free for scratch, cuBLAS workspace, graph pools


@dataclass(slots=True)
class Row:
    engine: str  # "bf16" | "fp4" | "fp4+capture" | "transformers"
    context: int
    batch: int
    tok_s: float | None
    ms_step: float | None
    gb_step: float | None = None
    bw_tb_s: float | None = None
    bw_frac: float | None = None  # achieved / copy bandwidth
    note: str = ""
    small: bool = False  # the small-batch kernels (trace_common/kernels/cuda_small.py)
    pdl: bool = False  # ... launched as programmatic dependent launches (cuda_launch.launch_ex)


def copy_bandwidth(nbytes: int = 4 * GIB, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    sec = start.elapsed_time(end) / 1e3 / reps
    del a, b
    return 2 * nbytes / sec / 1e12


def seconds_per_replay(replay, reps: int) -> float:
    """Seconds per call of `replay` (a graph replay): one untimed call, then CUDA events around
    `reps` back-to-back calls."""
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def time_engine(
    shape: EngineShape, weights: EngineWeights, *, batch: int, context: int, steps: int,
    guided: tuple[int, ...] = (),
    profile: bool = False,
    small: bool = False,
    pdl: bool = False,
    settings: KernelSettings | None = None,
) -> tuple[float, int]:  # fmt: skip
    """(seconds per decode step, bytes the step moved) for one captured configuration
    (`settings`: the kernels' launch shapes; default the built-in ones)."""
    eng = DecodeEngine(shape, weights, batch=batch, capacity=context + STEP_MARGIN,
                       context=context, guided_layers=guided, small_batch=small,
                       pdl=pdl, settings=settings)  # fmt: skip
    eng.fill_context_()
    eng.tokens.random_(0, shape.vocab)
    eng.capture(warmup=2)
    sec = seconds_per_replay(eng.replay, steps)
    nbytes = eng.bytes_last_step(context + 2 + steps)
    if profile and batch in (1, 32) and context <= 1024:  # kernel time by name, 2 eager steps
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.step()
            eng.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10), flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return sec, nbytes


def fits(weight_bytes: int, shape: EngineShape, *, fp4: bool, batch: int, context: int) -> bool:
    need = batch * kv_bytes_per_sequence(shape, fp4=fp4, tokens=context + STEP_MARGIN)
    free, _ = torch.cuda.mem_get_info()
    return need + FIT_HEADROOM <= free


def transformers_baseline(
    shape: EngineShape, layers: int, batches: list[int], context: int, new_tokens: int
) -> list[Row]:
    """HF `generate` (BF16, greedy) on the same shape with `layers` layers: decode time per
    token from the difference of two generate lengths (the prefill cancels)."""
    try:
        import transformers
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError as exc:
        return [Row("transformers", context, b, None, None, note=f"unavailable: {exc}")
                for b in batches]  # fmt: skip
    cfg = Qwen3MoeConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=layers,
        num_attention_heads=shape.q_heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k, moe_intermediate_size=shape.moe_inter,
        intermediate_size=6144, max_position_embeddings=40960, rope_theta=shape.rope_theta,
    )  # fmt: skip
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: fp32 would need 2x the memory
    try:
        with torch.device("cuda"):
            model = Qwen3MoeForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    rows = []
    for b in batches:
        ids = torch.randint(0, shape.vocab, (b, context), device="cuda")

        def run(n: int, ids: torch.Tensor = ids, model: torch.nn.Module = model) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)  # fmt: skip
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        run(2)  # warm-up: first-call setup stays out of the numbers
        short = min(run(1) for _ in range(2))
        long = min(run(1 + new_tokens) for _ in range(2))
        sec = (long - short) / new_tokens
        rows.append(Row("transformers", context, b, b / sec, sec * 1e3,
                        note=f"transformers {transformers.__version__}, {layers} layers"))  # fmt: skip
        print(f"transformers batch {b}: generate(1) {short:.2f}s, generate({1 + new_tokens}) "
              f"{long:.2f}s -> {b / sec:.1f} tok/s", flush=True)  # fmt: skip
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def check_fp4_decode() -> str:
    """Check that the Triton kernels' inline-PTX FP4 decode compiles and agrees with the plain
    one here; returns "ptx" (a disagreement raises: the Triton FP4 path would be wrong)."""
    from trace_common.kernels import moe, moe_layout
    from trace_common.kernels.quant import quantize_rows

    try:
        w = moe.quantize_weights(torch.randn(8, 256, 256, device="cuda").bfloat16(),
                                 shared_halves=False)  # fmt: skip
        plan = moe.route_align(torch.randn(4, 8, device="cuda"), 2, moe.DECODE_BLOCK_M)
        xq = moe_layout.FP4Rows(*quantize_rows(torch.randn(4, 256, device="cuda").bfloat16(),
                                        scale_2=None))  # fmt: skip
        outs = [moe.moe_gemm(xq, w, plan, gated=False, a_div=2, mul_route_w=False, decode=d)
                for d in ("bits", "ptx")]  # fmt: skip
        if not torch.equal(outs[0], outs[1]):
            raise RuntimeError("ptx and bits decodes disagree")
    except Exception as exc:
        raise RuntimeError(f"the FP4 ptx decode is unusable here: {exc}") from exc
    return "ptx"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--steps", type=int, default=10, help="timed graph replays per config")
    ap.add_argument(
        "--budget-gib",
        type=float,
        default=120.0,
        help="memory budget for weights + KV cache at the longest context",
    )
    ap.add_argument("--hf-layers", type=int, default=48)
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--hf-tokens", type=int, default=32)
    ap.add_argument("--hf-only", action="store_true", help="only the transformers baseline")
    ap.add_argument("--quick", action="store_true", help="smoke: 1K context, batches 1 and 8")
    ap.add_argument("--profile", action="store_true", help="kernel-time table per config")
    ap.add_argument("--fp4-gemm", choices=("cuda", "triton"), default="cuda",
                    help="FP4 expert GEMM: CUDA C++ mma.sync kernel or Triton (the fallback "
                         "without CuPy)")  # fmt: skip
    ap.add_argument("--small", choices=("auto", "off", "on", "both"), default="auto",
                    help="small-batch kernels (cuda_small) at batch <= 8: the engine's default "
                         "(cuda_small.small_batch_enabled), off, on, or both (each configuration "
                         "twice)")  # fmt: skip
    ap.add_argument("--pdl", choices=("auto", "off", "on", "both"), default="auto",
                    help="programmatic dependent launch of the small-batch kernels: the engine's "
                         "default (on from sm_90), off, on, or both (A/B)")  # fmt: skip
    ap.add_argument("--no-capture", action="store_true", help="skip the guidance-capture rows")
    ap.add_argument(
        "--gemv-table",
        action="store_true",
        help="time the small-batch GEMVs against cuBLAS / the Triton expert GEMM",
    )
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("rollout_gpu_out"))
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.batches = [1024], [1, 8]
    decode = check_fp4_decode()
    args.out.mkdir(parents=True, exist_ok=True)
    shape = EngineShape.named(num_layers=args.layers)
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
        "command": " ".join(sys.argv), "fp4_decode": decode, "fp4_gemm": args.fp4_gemm,
        "fp4_attn": fp4_attn_impl(), "small": args.small, "pdl": args.pdl,
        "small_launch": cuda_small.config(),
    }  # fmt: skip
    print(env, flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.2f} TB/s (read + write)", flush=True)
    rows: list[Row] = []
    if args.hf_batches:
        t0 = time.perf_counter()
        rows += transformers_baseline(shape, args.hf_layers, args.hf_batches, 1024, args.hf_tokens)
        print(f"transformers baseline done in {time.perf_counter() - t0:.0f}s", flush=True)
    if args.hf_only:
        (args.out / "transformers.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
        return
    t0 = time.perf_counter()
    weights = EngineWeights.random(shape, "cuda")
    print(f"random weights {weights.nbytes() / GIB:.1f} GiB in {time.perf_counter() - t0:.0f}s")
    long_ctx = max(args.contexts)
    budget = int(args.budget_gib * GIB)
    guided = tuple(range(shape.num_layers // 2, shape.num_layers))  # the deeper half

    smalls = {"auto": [None], "off": [False], "on": [True], "both": [False, True]}[args.small]
    pdls = {"auto": [None], "off": [False], "on": [True], "both": [False, True]}[args.pdl]

    def use_small(small: bool | None, b: int) -> bool:
        on = cuda_small.small_batch_enabled(b) if small is None else small
        return on and small_batch_supported(shape, b)

    def use_pdl(pdl: bool | None, small: bool) -> bool:
        return small and (pdl_enabled() if pdl is None else pdl)

    def record(engine: str, ctx: int, b: int, guided_layers: tuple[int, ...] = (),
               small: bool = False, pdl: bool = False) -> Row:  # fmt: skip
        sec, nbytes = time_engine(shape, weights, batch=b, context=ctx, steps=args.steps,
                                  guided=guided_layers, profile=args.profile,
                                  small=small, pdl=pdl)  # fmt: skip
        r = Row(engine, ctx, b, b / sec, sec * 1e3, nbytes / 1e9, nbytes / sec / 1e12,
                nbytes / sec / 1e12 / bw, small=small, pdl=pdl)  # fmt: skip
        print(f"{engine:12s} ctx {ctx:6d} batch {b:4d} small {int(small)} pdl {int(pdl)}: "
              f"{r.tok_s:9.1f} tok/s "
              f"{r.ms_step:7.2f} ms/step {r.gb_step:6.2f} GB/step {r.bw_tb_s:5.2f} TB/s "
              f"({100 * r.bw_frac:.0f}% of copy)", flush=True)  # fmt: skip
        rows.append(r)
        return r

    budget_rows = {}
    for engine in ("bf16", "fp4"):
        fp4 = engine == "fp4"
        if fp4:
            t0 = time.perf_counter()
            weights.quantize_experts_(args.fp4_gemm)
            gc.collect()
            torch.cuda.empty_cache()
            print(f"quantized experts: {weights.nbytes() / GIB:.1f} GiB in "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
        wbytes = weights.nbytes()
        for small in smalls:
            for ctx in args.contexts:
                for b in args.batches:
                    if small and not small_batch_supported(shape, b):
                        continue  # --small on/both: batches the kernels do not take run once
                    sm = use_small(small, b)
                    if not fits(wbytes, shape, fp4=fp4, batch=b, context=ctx):
                        rows.append(Row(engine, ctx, b, None, None, note="does not fit in memory",
                                        small=sm))  # fmt: skip
                        print(f"{engine:12s} ctx {ctx:6d} batch {b:4d}: does not fit", flush=True)
                        continue
                    for pd in sorted({use_pdl(p, sm) for p in pdls}):  # PDL: small path only
                        try:
                            record(engine, ctx, b, small=sm, pdl=pd)
                        except Exception as exc:  # a failed PDL launch keeps the other rows
                            if not pd:
                                raise
                            print(f"{engine} ctx {ctx} batch {b} PDL failed: {exc!r}", flush=True)
        if not fp4 and args.gemv_table:
            try:
                gemv_table(weights, shape)
            except Exception as exc:  # the engine rows above are kept either way
                print(f"gemv table failed: {exc!r}", flush=True)
        per_seq = kv_bytes_per_sequence(shape, fp4=fp4, tokens=long_ctx + STEP_MARGIN)
        bmax = min(largest_batch(budget, wbytes, per_seq), MAX_FUSED_ROUTE_TOKENS)
        if (
            not args.quick
            and bmax > 0
            and fits(wbytes, shape, fp4=fp4, batch=bmax, context=long_ctx)
        ):
            budget_rows[engine] = record(engine, long_ctx, bmax)
            budget_rows[engine].note = f"largest batch in a {args.budget_gib:.0f} GiB budget"
        if fp4 and not args.no_capture:
            ctx = min(args.contexts)
            for b in sorted({min(32, max(args.batches)), 1} & set(args.batches), reverse=True):
                small_b = use_small(smalls[-1], b)
                pdl_b = use_pdl(pdls[-1], small_b)
                base = next((r for r in rows if (r.engine, r.context, r.batch, r.small, r.pdl)
                             == ("fp4", ctx, b, small_b, pdl_b) and r.tok_s), None)  # fmt: skip
                if base is None:  # did not fit (or its PDL launch failed)
                    continue
                cap = record("fp4+capture", ctx, b, guided, small=small_b, pdl=pdl_b)
                cap.note = (f"capture on layers {guided[0]}-{guided[-1]}: "
                            f"{100 * (1 - cap.tok_s / base.tok_s):+.1f}% slowdown")  # fmt: skip
    summarize(rows, budget_rows, env, bw, args)


def gemv_table(weights: EngineWeights, shape: EngineShape, batches: tuple[int, ...] = (1, 8),
               reps: int = 3) -> None:  # fmt: skip
    """Per call, inside a CUDA graph over the layers' own weights (no L2 reuse): the small-batch
    GEMVs (cuda_small) against cuBLAS (projections, LM head) and the Triton grouped GEMM
    (BF16 experts, gate_up + down). Bytes = weights read; TB/s = bytes / time."""
    from trace_common.kernels import moe

    s, layers = shape, weights.layers
    dev = "cuda"
    per_expert = (layers[0].gate_up.nbytes() + layers[0].down.nbytes()) / s.num_experts

    def timed(fn, calls: int) -> float:
        fn()  # compile / warm up outside the graph
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return seconds_per_replay(g.replay, reps) / calls

    print("\n| op | tokens | MB/call | small-batch us | TB/s | reference us | TB/s |\n"
          "|---|---|---|---|---|---|---|", flush=True)  # fmt: skip
    for b in batches:
        x_h = torch.randn(b, s.hidden, device=dev).bfloat16()
        x_o = torch.randn(b, s.q_heads * s.head_dim, device=dev).bfloat16()
        ops = []
        for name, attr, x in (("qkv", "w_qkv", x_h), ("o", "w_o", x_o), ("router", "router", x_h)):
            n = getattr(layers[0], attr).shape[0]
            out = torch.empty(b, n, dtype=torch.bfloat16, device=dev)
            warps = cuda_small.WARPS[name]
            ops.append((name, getattr(layers[0], attr).numel() * 2, len(layers),
                        lambda attr=attr, x=x, out=out, warps=warps: [
                            cuda_small.gemv(x, getattr(lw, attr), out, warps=warps)
                            for lw in layers],
                        lambda attr=attr, x=x, out=out: [
                            torch.mm(x, getattr(lw, attr).t(), out=out) for lw in layers]))  # fmt: skip
        logits = torch.empty(b, s.vocab, dtype=torch.bfloat16, device=dev)
        ops.append(("lm_head", weights.lm_head.numel() * 2, 4,
                    lambda x=x_h, o=logits: [cuda_small.gemv(x, weights.lm_head, o,
                                             warps=cuda_small.WARPS["lm_head"])
                                             for _ in range(4)],
                    lambda x=x_h, o=logits: [torch.mm(x, weights.lm_head.t(), out=o)
                                             for _ in range(4)]))  # fmt: skip
        g = torch.Generator(device=dev).manual_seed(b)
        p8, p16 = [], []
        used = 0
        for _ in layers:
            lg = torch.randn(b, s.num_experts, device=dev, generator=g)
            p8.append(moe.route_align(lg, s.top_k, 8))
            p16.append(moe.route_align(lg, s.top_k, moe.DECODE_BLOCK_M))
            used += int(torch.unique(p8[-1].topk_ids).numel())
        act = torch.empty(b * s.top_k, s.moe_inter, dtype=torch.bfloat16, device=dev)
        ysum = torch.empty(b, s.hidden, dtype=torch.bfloat16, device=dev)
        ypair = torch.empty(b * s.top_k, s.hidden, dtype=torch.bfloat16, device=dev)

        def small_moe(x=x_h, act=act, ysum=ysum, p8=p8) -> None:
            for lw, p in zip(layers, p8, strict=True):
                cuda_small.moe_gate_up(x, lw.gate_up.bf16, p.sorted_pair, p.block_expert, act,
                                       top_k=s.top_k)  # fmt: skip
                cuda_small.moe_down(act, lw.down.bf16, p.topk_ids, p.topk_w, ysum)

        def triton_moe(x=x_h, act=act, ypair=ypair, p16=p16) -> None:
            for lw, p in zip(layers, p16, strict=True):
                moe.moe_gemm(x, lw.gate_up, p, gated=True, a_div=s.top_k, mul_route_w=False,
                             out=act)  # fmt: skip
                moe.moe_gemm(act, lw.down, p, gated=False, a_div=1, mul_route_w=True, out=ypair)

        ops.append(("experts (gate_up + down)", used * per_expert / len(layers), len(layers),
                    small_moe, triton_moe))  # fmt: skip
        for name, nbytes, calls, mine, ref in ops:
            t_m, t_r = timed(mine, calls), timed(ref, calls)
            print(f"| {name} | {b} | {nbytes / 1e6:.1f} | {t_m * 1e6:.1f} | "
                  f"{nbytes / t_m / 1e12:.2f} | {t_r * 1e6:.1f} | {nbytes / t_r / 1e12:.2f} |",
                  flush=True)  # fmt: skip


def summarize(rows: list[Row], budget_rows: dict, env: dict, bw: float, args) -> None:
    def get(engine: str, ctx: int, b: int, small: bool, pdl: bool) -> Row | None:
        return next((r for r in rows if (r.engine, r.context, r.batch, r.small, r.pdl)
                     == (engine, ctx, b, small, pdl)), None)  # fmt: skip

    # "ceiling": BF16 bytes / FP4 bytes per step, the FP4/BF16 ratio if both ran at the same
    # bandwidth (the most FP4 can gain at this batch and context)
    print("\n| context | batch | small | PDL | BF16 tok/s | FP4 tok/s | FP4/BF16 | ceiling | "
          "BF16 % copy BW | FP4 % copy BW |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for ctx, b, small, pdl in sorted({(r.context, r.batch, r.small, r.pdl) for r in rows
                                      if r.engine in ("bf16", "fp4")}):  # fmt: skip
        r16, r4 = get("bf16", ctx, b, small, pdl), get("fp4", ctx, b, small, pdl)

        def fmt(r: Row | None, key: str, scale: float = 1.0, nd: int = 0) -> str:
            v = None if r is None else getattr(r, key)
            return "n/f" if v is None else f"{v * scale:.{nd}f}"

        ratio = (f"{r4.tok_s / r16.tok_s:.2f}x" if r16 and r4 and r16.tok_s and r4.tok_s
                 else "-")  # fmt: skip
        ceiling = (f"{r16.gb_step / r4.gb_step:.2f}x" if r16 and r4 and r16.gb_step
                   and r4.gb_step else "-")  # fmt: skip
        print(f"| {ctx} | {b} | {'on' if small else 'off'} | {'on' if pdl else 'off'} | "
              f"{fmt(r16, 'tok_s')} | "
              f"{fmt(r4, 'tok_s')} | {ratio} | {ceiling} | "
              f"{fmt(r16, 'bw_frac', 100)} | {fmt(r4, 'bw_frac', 100)} |")  # fmt: skip
    for name, r in budget_rows.items():
        print(f"budget {args.budget_gib:.0f} GiB, ctx {r.context}: {name} batch {r.batch} -> "
              f"{r.tok_s:.0f} tok/s")  # fmt: skip
    if len(budget_rows) == 2:
        print(
            f"FP4/BF16 at the same budget: {budget_rows['fp4'].tok_s / budget_rows['bf16'].tok_s:.2f}x"
        )
    for r in rows:
        if r.engine in ("fp4+capture", "transformers"):
            print(f"{r.engine} ctx {r.context} batch {r.batch}: "
                  f"{'n/a' if r.tok_s is None else f'{r.tok_s:.1f} tok/s'} {r.note}")  # fmt: skip
    out = {"env": env, "copy_bw_tb_s": bw, "rows": [asdict(r) for r in rows]}
    (args.out / "rollout_gpu.json").write_text(json.dumps(out, indent=1))
    plot(rows, args)


def plot(rows: list[Row], args, path: pathlib.Path | None = None) -> None:
    """Bars of tokens/s per batch, one panel per context (args.contexts, args.batches,
    args.layers), into `path` (default args.out / rollout_gpu.png); nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(args.contexts), figsize=(6 * len(args.contexts), 4))
    axes = [axes] if len(args.contexts) == 1 else list(axes)
    for ax, ctx in zip(axes, args.contexts, strict=True):
        xs = list(range(len(args.batches)))
        for off, engine in ((-0.2, "bf16"), (0.2, "fp4")):
            vals = []
            for b in args.batches:
                # the faster variant where --small / --pdl both ran a configuration twice
                r = max((r for r in rows if (r.engine, r.context, r.batch) == (engine, ctx, b)
                         and r.tok_s), key=lambda r: r.tok_s, default=None)  # fmt: skip
                vals.append(0 if r is None or r.tok_s is None else r.tok_s)
            ax.bar([x + off for x in xs], vals, width=0.4, label=engine.upper())
        ax.set_xticks(xs, [str(b) for b in args.batches])
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{args.layers} layers, context {ctx} (0 = does not fit)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path or args.out / "rollout_gpu.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
