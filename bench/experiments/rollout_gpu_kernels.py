"""Per-kernel bandwidth of the FP4 fast path on one GPU: grouped expert GEMMs (one Qwen3-30B-A3B
MoE layer: 128 experts, hidden 2048, width 768, top-8) and decode attention (32 q / 4 kv heads,
head_dim 128), BF16 vs FP4: Triton with each FP4 decode ("bits": plain Triton integer ops,
"ptx": int32 words + inline PTX; the per-kernel table times "ptx") and the CUDA C++ mma.sync kernels on packed weights
("cuda": `moe_fp4_mma`, weights loaded up front; "stream": `moe_fp4_stream`, cp.async ring).
Expert selections rotate over many router draws so the weights do not sit in L2 between
repetitions; every call is timed inside a CUDA graph (no Python launch cost).

    python bench/experiments/rollout_gpu_kernels.py                 # tables
    python bench/experiments/rollout_gpu_kernels.py --cuda-sweep    # + launch configs (--cuda-sweep wg: one kernel's)
    python bench/experiments/rollout_gpu_kernels.py --attention-only --attn-cold  # attention from HBM
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository

from trace_common.kernels import attention as attn
from trace_common.kernels import cuda_launch, cuda_moe, moe, moe_layout
from trace_common.kernels.quant import quantize_rows

E, H, INTER, TOPK = 128, 2048, 768, 8
HQ, HKV, D = 32, 4, 128
N_PLANS = 16  # router draws cycled through (different experts each call)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    import triton.testing

    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e12


def _fp4_rows(x: torch.Tensor) -> moe_layout.FP4Rows:
    dq = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    return moe_layout.FP4Rows(*quantize_rows(x, scale_2=None, dq16=dq), dq)


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    err = (ref.double() - got.double()).pow(2).sum().clamp_min(1e-300)
    return float(10 * torch.log10(ref.double().pow(2).sum() / err))


def _graph_us_per_call(fns) -> float:
    """Median microseconds per call of `fns`, all captured in one CUDA graph and replayed (no
    Python launch cost; the calls use different router draws, so weights are not L2-resident
    from the call before)."""
    import triton.testing

    for fn in fns:
        fn()  # compile / load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return ms * 1e3 / len(fns)


def bench_moe(bw: float, sweep: frozenset[str], write_configs: pathlib.Path | None = None,
              tokens: tuple[int, ...] = (1, 8, 32, 128), once: bool = False) -> None:  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    wgu = torch.empty(E, 2 * INTER, H, dtype=torch.bfloat16, device="cuda").normal_(
        0, 0.02, generator=g
    )
    wd = torch.empty(E, H, INTER, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=g)
    w16 = (
        moe_layout.ExpertWeights(n=2 * INTER, k=H, bf16=wgu),
        moe_layout.ExpertWeights(n=H, k=INTER, bf16=wd),
    )
    w4 = (
        moe.quantize_weights(wgu, shared_halves=True),
        moe.quantize_weights(wd, shared_halves=False),
    )
    per_expert = {"bf16": (w16[0].nbytes() + w16[1].nbytes()) / E,
                  "fp4": (w4[0].nbytes() + w4[1].nbytes()) / E}  # fmt: skip
    for w in w4:
        w.pack_for_cuda_(keep_rows=True)
    del wgu, wd
    print(
        "Expert GEMMs, one MoE layer; each time = one call, 16 calls with different router "
        "draws captured in one CUDA graph:\n"
    )
    print("| tokens | variant | gate_up us | down us | experts | GB moved | TB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|")
    sweep_rows = []
    best: dict[str, dict[tuple, float]] = {}  # block key -> config -> summed us over tokens
    for t in tokens:
        logits = [torch.randn(t, E, device="cuda") for _ in range(N_PLANS)]
        plans = [moe.route_align(lg, TOPK, moe.DECODE_BLOCK_M) for lg in logits]
        bm = cuda_moe.block_m_for(t * TOPK, E)
        plans_cuda = [moe.route_align(lg, TOPK, bm) for lg in logits]
        used = sum(int(torch.unique(p.topk_ids).numel()) for p in plans) / N_PLANS
        x = torch.randn(t, H, device="cuda").bfloat16()
        act = torch.randn(t * TOPK, INTER, device="cuda").bfloat16()
        xq, aq = _fp4_rows(x), _fp4_rows(act)
        # (name, Triton decode, impl, CUDA kernel, gate_up config, down config)
        variants = [
            ("bf16", None, "triton", None, None, None),
            ("fp4-ptx", "ptx", "triton", None, None, None),
            ("fp4-cuda", None, "cuda", "mma", None, None),
            ("fp4-stream", None, "cuda", "stream", None, None),
            ("fp4-wg", None, "cuda", "wg", None, None),
            ("fp4-cuda-default", None, "cuda", None, None, None),  # kernel per shape (engine's)
        ]
        if "stream" in sweep:
            for cfg in SWEEP_STREAM_GATE_UP:
                if cuda_moe.stream_smem_bytes(bm, *cfg[:4], True) <= cuda_moe.STREAM_SMEM_MAX:
                    variants.append((f"stream gu{cfg}", None, "cuda", "stream", cfg, None))
            for cfg in SWEEP_STREAM_DOWN:
                if cuda_moe.stream_smem_bytes(bm, *cfg[:4], False) <= cuda_moe.STREAM_SMEM_MAX:
                    variants.append((f"stream dn{cfg}", None, "cuda", "stream", None, cfg))
        if "wg" in sweep:  # the warpgroup-MMA kernel (moe_fp4_wg)
            for gated, k, cfgs in ((True, H, SWEEP_WG_GATE_UP), (False, INTER, SWEEP_WG_DOWN)):
                for cfg in cfgs:  # (KGW, S, NWG)
                    smem = cuda_moe.wg_smem_bytes(k, cfg[0], cfg[1], gated, cfg[2], block_m=bm)
                    if smem <= cuda_moe.STREAM_SMEM_MAX:
                        variants.append((f"wg {'gu' if gated else 'dn'}{cfg}", None, "cuda", "wg",
                                         cfg if gated else None, None if gated else cfg))  # fmt: skip
        if "stream" in sweep:
            for waves in SWEEP_STREAM_WAVES:  # default configs, grid sized for more waves
                variants.append((f"stream waves {waves}", None, "cuda", "stream", None, None))
            # timing probe: the default configs without the decode + block scale (wrong values)
            variants.append(("stream probe no-decode", None, "cuda", "stream", None, None))
        ref = {}
        for variant, dec, impl, kern, cfg_gu, cfg_dn in variants:
            if once and impl != "cuda":
                continue
            fp4 = variant != "bf16"
            wg, wdn = w4 if fp4 else w16
            a_in, a_mid = (xq, aq) if fp4 else (x, act)
            pl = plans_cuda if impl == "cuda" else plans

            waves = int(variant.split()[-1]) if variant.startswith("stream waves") else 1
            probe = variant.startswith("stream probe")

            def run_gu(p, wg=wg, a_in=a_in, dec=dec, impl=impl, kern=kern, cfg=cfg_gu, waves=waves,
                       probe=probe):  # fmt: skip
                if impl == "cuda":
                    return cuda_moe.moe_gemm_cuda(a_in, wg, p, gated=True, a_div=TOPK,
                                                  mul_route_w=False, config=cfg, kernel=kern,
                                                  stream_waves=waves, stream_probe=probe)  # fmt: skip
                return moe.moe_gemm(a_in, wg, p, gated=True, a_div=TOPK, mul_route_w=False,
                                    decode=dec, impl=impl)  # fmt: skip

            def run_dn(p, wdn=wdn, a_mid=a_mid, dec=dec, impl=impl, kern=kern, cfg=cfg_dn,
                       waves=waves, probe=probe):  # fmt: skip
                if impl == "cuda":
                    return cuda_moe.moe_gemm_cuda(a_mid, wdn, p, gated=False, a_div=1,
                                                  mul_route_w=True, config=cfg, kernel=kern,
                                                  stream_waves=waves, stream_probe=probe)  # fmt: skip
                return moe.moe_gemm(a_mid, wdn, p, gated=False, a_div=1, mul_route_w=True,
                                    decode=dec, impl=impl)  # fmt: skip

            # correctness guard: every FP4 variant against the Triton ptx result (same operands)
            y_gu = run_gu(pl[0]).float()
            y_dn = run_dn(pl[0]).float()
            if variant == "fp4-ptx":
                ref = {"gu": y_gu, "dn": y_dn}
            note = ""
            db = None
            if fp4 and ref and variant != "fp4-ptx":
                db = min(_sqnr_db(ref["gu"], y_gu), _sqnr_db(ref["dn"], y_dn))
                note = f" (SQNR vs ptx {db:.0f} dB)"
            if once:  # each CUDA GEMM launched once (for a profiler), not timed
                continue
            us_gu = _graph_us_per_call([lambda p=p, f=run_gu: f(p) for p in pl])
            us_dn = _graph_us_per_call([lambda p=p, f=run_dn: f(p) for p in pl])
            gb = used * per_expert["fp4" if fp4 else "bf16"] / 1e9
            tbs = gb / ((us_gu + us_dn) * 1e-6) / 1e3
            line = (f"| {t} | {variant}{note} | {us_gu:.1f} | {us_dn:.1f} | {used:.1f} | "
                    f"{gb:.3f} | {tbs:.2f} | {100 * tbs / bw:.0f} |")  # fmt: skip
            swept = variant.startswith(("stream ", "ws ", "wg "))
            if kern in ("mma", "stream") and waves == 1 and (db is None or db > 60):  # by config
                timed = [(f"{H},{bm},True", cfg_gu, us_gu), (f"{INTER},{bm},False", cfg_dn, us_dn)]
                if variant.startswith("stream "):  # only the swept GEMM ran a new config
                    timed = timed[:1] if cfg_gu is not None else timed[1:]
                for key, cfg, us in timed:
                    k_, bm_, gated_ = _key(key)
                    if cfg is None and kern == "mma":
                        cfg = cuda_moe.default_config(k_, bm_, gated_)
                    elif cfg is None:
                        cfg = cuda_moe.default_stream_config(
                            k_, bm_, gated_, INTER if gated_ else H
                        )
                    best[key] = best.get(key, {})
                    best[key][cfg] = best[key].get(cfg, 0.0) + us
            (sweep_rows if swept else [None]).append(line)
            if not swept:
                print(line, flush=True)
    if sweep_rows:
        print("\nStreaming kernel configs (RW, WK, KGW, S, MINB) and warpgroup-MMA kernel configs "
              "(KGW, S, NWG); only the named GEMM uses it:")  # fmt: skip
        print("\n".join(sweep_rows))
        chosen = {key: list(min(cfgs, key=cfgs.get)) for key, cfgs in best.items()}
        print("fastest configs summed over the token counts of each block size (4 numbers: "
              f"moe_fp4_mma, 5: moe_fp4_stream): {chosen}")  # fmt: skip
        for key, cfgs in best.items():
            print(f"  {key}: " + ", ".join(f"{c} {us:.1f} us" for c, us in sorted(cfgs.items(),
                                                                       key=lambda x: x[1])))  # fmt: skip
        if write_configs is not None:
            write_configs.write_text(json.dumps(chosen))
    print(
        f"CUDA kernel compile seconds (NVRTC): "
        f"{ {k: round(v, 2) for k, v in cuda_launch.COMPILE_SECONDS.items()} }",
        flush=True,
    )


# Streaming kernel (RW, WK, KGW, S, MINB): output tiles per item, warps along K, 64-wide k
# groups per warp, ring stages, CTAs per SM asked of the register allocator (0: no ask)
SWEEP_STREAM_GATE_UP = [(2, 8, 4, 4, 2), (1, 16, 2, 4, 1), (4, 8, 4, 3, 1), (1, 4, 8, 3, 3)]
SWEEP_STREAM_DOWN = [(4, 6, 2, 6, 3), (2, 4, 3, 4, 3), (4, 3, 4, 4, 0), (2, 2, 6, 4, 0)]
# Warpgroup-MMA kernel (KGW, S, NWG): 64-wide k groups per ring stage, ring stages, warpgroups
# per CTA (NWG <= 4 for gate_up, <= 6 for down: more threads per CTA leave fewer registers than
# the instances use, ~120 / ~80)
SWEEP_WG_GATE_UP = [(4, 2, 4), (4, 2, 3), (4, 2, 1), (2, 2, 2), (4, 2, 2), (2, 3, 4), (2, 4, 3),
                    (2, 2, 4)]  # fmt: skip
SWEEP_WG_DOWN = [(6, 2, 4), (6, 2, 2), (3, 2, 2), (6, 2, 6), (4, 2, 6), (4, 2, 4), (3, 2, 4),
                 (6, 2, 3), (3, 3, 2)]  # fmt: skip
SWEEP_STREAM_WAVES = [3]  # the default configs with the grid sized for 3 waves of resident CTAs
SWEEP_KERNELS = ("stream", "wg")  # --cuda-sweep's choices


ATTN_SWEEP = [("ring", 4, 4, 4), ("ring", 4, 4, 3), ("ring", 4, 5, 3),
              ("ring", 4, 5, 4), ("ring", 4, 3, 4), ("ring", 8, 2, 2)]  # fmt: skip
ATTN_RING = ("ring", 4, 4, 4)


def cold_copies(nbytes: int, cap: int = 64) -> int:
    """Caches to cycle through so that each call reads its cache from HBM, as the engine's
    layers do (each has its own): enough for 3x the L2 cache, at most `cap`."""
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    return max(1, min(cap, -(-3 * l2 // max(nbytes, 1))))


def bench_attention(bw: float, sweep: bool = False, cold: bool = False) -> None:
    from trace_common.kernels import cuda_attn

    default = cuda_attn.DEFAULT_CONFIG
    print("\nDecode attention, each call captured in a CUDA graph (split + reduce kernels)"
          + (", cycling through copies of the cache so that every call reads it from HBM:"
             if cold else ":"))  # fmt: skip
    print("\n| batch | context | variant | us | GB KV | TB/s | % copy | SQNR vs Triton dB |")
    print("|---|---|---|---|---|---|---|---|")
    shapes = [(1, 32768), (8, 32768), (128, 32768), (32, 8192), (128, 1024), (1, 1024)]
    if sweep:
        shapes[1:1] = [(32, 32768)]
    for b, ctx in shapes:
        for variant in ("bf16", "fp4-ptx", "fp4-cuda"):
            fp4 = variant != "bf16"
            gb = b * ctx * attn.KVCacheGPU.bytes_per_token(fp4=fp4, kv_heads=HKV, head_dim=D) / 1e9
            caches = []
            for _ in range(cold_copies(int(gb * 1e9)) if cold else 1):
                caches.append(attn.KVCacheGPU.allocate(fp4=fp4, batch=b, kv_heads=HKV,
                                                       capacity=ctx, head_dim=D, device="cuda"))  # fmt: skip
                caches[-1].fill_random_()
            cache = caches[0]
            q = torch.randn(b, HQ, D, device="cuda").bfloat16()
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            plan = attn.DecodeAttnPlan.make(batch=b, q_heads=HQ, kv_heads=HKV, capacity=ctx,
                                            head_dim=D, context_hint=ctx, device="cuda")  # fmt: skip
            ref = (
                attn.decode_attention(q, cache, lens, plan, impl="triton").float() if fp4 else None
            )
            cuda = variant == "fp4-cuda"
            target0 = attn.TARGET_PROGRAMS
            runs: list = [(None, target0)]
            if cuda:
                runs = [(default, None)]  # the engine's plan (cuda_fp4=True)
                if sweep:
                    runs += [(c, None) for c in ATTN_SWEEP if c != default]
                    runs += [(ATTN_RING, int(t * target0)) for t in (0.5, 1, 2, 4)]
                    runs += [(ATTN_RING, "split")]  # the split kernel alone, engine plan
            for cfg, target in runs:
                split_only = target == "split"
                target = None if split_only else target
                impl = "cuda" if cuda else "triton"
                if cuda:
                    cuda_attn.set_default_config(cfg)  # what decode_attention launches
                attn.TARGET_PROGRAMS = target or target0
                plan = attn.DecodeAttnPlan.make(batch=b, q_heads=HQ, kv_heads=HKV, capacity=ctx,
                                                head_dim=D, context_hint=ctx, device="cuda",
                                                cuda_fp4=cuda and target is None)  # fmt: skip
                attn.TARGET_PROGRAMS = target0

                def run(q=q, cache=cache, lens=lens, plan=plan, impl=impl):
                    return attn.decode_attention(q, cache, lens, plan, impl=impl)

                def split(q=q, c=cache, lens=lens, p=plan):
                    cuda_attn.decode_attn_split_cuda(q, c.codes, c.scales, c.row_scales, lens,
                                                     p.part_o, p.part_ml, chunk=p.chunk,
                                                     qk_scale=D**-0.5 * attn.LOG2E)  # fmt: skip

                # one call per cache copy (each call reads other HBM when `cold`)
                fn, key = (split, "c") if split_only else (run, "cache")
                us = _graph_us_per_call([functools.partial(fn, **{key: c}) for c in caches])
                db = "" if ref is None or split_only else f"{_sqnr_db(ref, run().float()):.1f}"
                tbs = gb / (us * 1e-6) / 1e3
                name = variant if cfg is None else f"{variant} {cfg} splits {plan.nsplit}"
                name += " (split kernel only)" if split_only else ""
                print(f"| {b} | {ctx} | {name} | {us:.1f} | {gb:.3f} | {tbs:.2f} | "
                      f"{100 * tbs / bw:.0f} | {db} |", flush=True)  # fmt: skip
            cuda_attn.set_default_config(default)
            del cache, caches


def _key(key: str) -> tuple[int, int, bool]:
    k, bm, gated = key.split(",")
    return int(k), int(bm), gated == "True"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cuda-sweep", nargs="*", choices=SWEEP_KERNELS,
        help="time launch configs of these CUDA expert-GEMM kernels too (none named: all)",
    )  # fmt: skip
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--launch-once", action="store_true",
                    help="launch each CUDA expert GEMM once per token count, untimed (for ncu)")  # fmt: skip
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--attn-sweep", action="store_true", help="time CUDA attention configs too")
    ap.add_argument("--attn-cold", action="store_true",
                    help="attention calls cycle through copies of the cache (>= 3x L2), so each "
                         "reads its KV from HBM as the engine's layers do")  # fmt: skip
    ap.add_argument("--write-configs", type=pathlib.Path,
                    help="json of the fastest configs (KernelSettings.expert_gemm_configs)")  # fmt: skip
    args = ap.parse_args()
    if args.launch_once:
        bench_moe(0.0, frozenset(), None, tuple(args.tokens), once=True)
        return
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.2f} TB/s (read + write)\n")
    if not args.attention_only:
        swept = args.cuda_sweep
        sweep = frozenset() if swept is None else frozenset(swept or SWEEP_KERNELS)
        bench_moe(bw, sweep, args.write_configs, tuple(args.tokens))
    if not args.no_attention:
        bench_attention(bw, args.attn_sweep, args.attn_cold)


if __name__ == "__main__":
    main()
