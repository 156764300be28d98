"""Per-kernel bandwidth of the FP4 fast path on one GPU: grouped expert GEMMs (one Qwen3-30B-A3B
MoE layer: 128 experts, hidden 2048, width 768, top-8) and decode attention (32 q / 4 kv heads,
head_dim 128), BF16 vs FP4 with each FP4 decode ("bits": plain Triton integer ops, "ptx":
int32 words + inline PTX). Expert selections rotate over many router draws so the weights do
not sit in L2 between repetitions.

    python bench/rollout_gpu_kernels.py
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from trace_common.kernels import attention as attn
from trace_common.kernels import moe
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


def bench_moe(bw: float) -> None:
    import triton.testing

    g = torch.Generator(device="cuda").manual_seed(0)
    wgu = torch.empty(E, 2 * INTER, H, dtype=torch.bfloat16, device="cuda").normal_(
        0, 0.02, generator=g
    )
    wd = torch.empty(E, H, INTER, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=g)
    w16 = (moe.ExpertWeights(n=2 * INTER, k=H, bf16=wgu), moe.ExpertWeights(n=H, k=INTER, bf16=wd))
    w4 = (
        moe.quantize_weights(wgu, shared_halves=True),
        moe.quantize_weights(wd, shared_halves=False),
    )
    per_expert = {"bf16": (w16[0].nbytes() + w16[1].nbytes()) / E,
                  "fp4": (w4[0].nbytes() + w4[1].nbytes()) / E}  # fmt: skip
    print("| tokens | variant | gate_up us | down us | experts | GB moved | TB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|")
    for t in (1, 8, 32, 128):
        plans = [moe.route_align(torch.randn(t, E, device="cuda"), TOPK, moe.DECODE_BLOCK_M)
                 for _ in range(N_PLANS)]  # fmt: skip
        used = sum(int(torch.unique(p.topk_ids).numel()) for p in plans) / N_PLANS
        x = torch.randn(t, H, device="cuda").bfloat16()
        act = torch.randn(t * TOPK, INTER, device="cuda").bfloat16()
        xq = moe.FP4Rows(*quantize_rows(x, scale_2=None))
        aq = moe.FP4Rows(*quantize_rows(act, scale_2=None))
        for variant, dec, bk in (("bf16", None, 128), ("fp4-bits", "bits", 128),
                                 ("fp4-ptx", "ptx", 128), ("fp4-ptx-bk256", "ptx", 256)):  # fmt: skip
            fp4 = variant != "bf16"
            wg, wdn = w4 if fp4 else w16
            a_in, a_mid = (xq, aq) if fp4 else (x, act)
            i = [0]

            def gate_up(wg=wg, a_in=a_in, dec=dec, i=i, bk=bk, plans=plans) -> None:
                i[0] += 1
                moe.moe_gemm(a_in, wg, plans[i[0] % N_PLANS], gated=True, a_div=TOPK,
                             mul_route_w=False, decode=dec, block_k=bk)  # fmt: skip

            def down(wdn=wdn, a_mid=a_mid, dec=dec, i=i, bk=bk, plans=plans) -> None:
                i[0] += 1
                moe.moe_gemm(a_mid, wdn, plans[i[0] % N_PLANS], gated=False, a_div=1,
                             mul_route_w=True, decode=dec, block_k=bk)  # fmt: skip

            us_gu = triton.testing.do_bench(gate_up, warmup=25, rep=200, return_mode="median") * 1e3
            us_dn = triton.testing.do_bench(down, warmup=25, rep=200, return_mode="median") * 1e3
            gb = used * per_expert["fp4" if fp4 else "bf16"] / 1e9
            tbs = gb / ((us_gu + us_dn) * 1e-6) / 1e3
            print(f"| {t} | {variant} | {us_gu:.1f} | {us_dn:.1f} | {used:.1f} | {gb:.3f} | "
                  f"{tbs:.2f} | {100 * tbs / bw:.0f} |", flush=True)  # fmt: skip


def bench_attention(bw: float) -> None:
    import triton.testing

    print("\n| batch | context | variant | us | GB KV | TB/s | % copy |")
    print("|---|---|---|---|---|---|---|")
    for b, ctx in ((1, 32768), (8, 32768), (32, 8192), (128, 1024)):
        for variant in ("bf16", "fp4-bits", "fp4-ptx"):
            fp4 = variant != "bf16"
            cache = attn.KVCacheGPU.allocate(fp4=fp4, batch=b, kv_heads=HKV, capacity=ctx,
                                             head_dim=D, device="cuda")  # fmt: skip
            cache.fill_random_()
            q = torch.randn(b, HQ, D, device="cuda").bfloat16()
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            plan = attn.DecodeAttnPlan.make(batch=b, q_heads=HQ, kv_heads=HKV, capacity=ctx,
                                            head_dim=D, context_hint=ctx, device="cuda")  # fmt: skip
            dec = variant.split("-")[1] if fp4 else None
            us = triton.testing.do_bench(
                lambda q=q, cache=cache, lens=lens, plan=plan, dec=dec: attn.decode_attention(
                    q, cache, lens, plan, decode=dec), warmup=25, rep=200, return_mode="median",
            ) * 1e3  # fmt: skip
            gb = b * ctx * attn.KVCacheGPU.bytes_per_token(fp4=fp4, kv_heads=HKV, head_dim=D) / 1e9
            tbs = gb / (us * 1e-6) / 1e3
            print(f"| {b} | {ctx} | {variant} | {us:.1f} | {gb:.3f} | {tbs:.2f} | "
                  f"{100 * tbs / bw:.0f} |", flush=True)  # fmt: skip
            del cache


def main() -> None:
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.2f} TB/s (read + write)\n")
    bench_moe(bw)
    bench_attention(bw)


if __name__ == "__main__":
    main()
