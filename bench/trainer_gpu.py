"""One trainer step on the GPU for a named shape (default mid-1b): forward_logprobs +
backward + AdamW over B sequences x T tokens with routing replay, per configuration:

  fp32 / trace        fp32 eager (no autocast): the baseline
  bf16 / none|rtn|trace   bf16 autocast over fp32 master weights; none = no fake quant (what
                      the FP4 sites cost is rtn - none), trace = guided QAT from records
  ... + ckpt          the same with activation checkpointing per decoder layer

Reported per configuration: median step time, tokens/s, MFU against the bf16 dense peak,
peak memory; and the guided-vs-RTN overhead. Prints a table, writes JSON to --out.

`--profile`: one more step per configuration under torch.profiler: how many times the host
waited for the device (`aten::_local_scalar_dense`, the op behind `.item()`, `bool(t)` and
`int(t)`, and explicit synchronizes), how many kernels it launched, the device's busy time
against the step's wall time, and the ops that take the most host and device time. On the
CPU (`--device cpu`) the wait and op counts are the ones a CUDA step would have.

MFU counts 6 x active parameters per token (the GEMMs of the experts a token is routed to,
attention projections, router, LM head) plus 6 x layers x T x heads x head_dim for causal
attention (half the full score matrix), over the peak given by --peak-tflops (H200 SXM bf16
dense: 989). The records come from one FP4 rollout-path forward over the same tokens (what a
prefill would record): compact guidance at the deeper half, routing at every MoE layer.

    python bench/trainer_gpu.py --out runs/trainer_gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trace_common.device import resolve_device  # noqa: E402
from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig, get_config  # noqa: E402
from trace_common.model.config import ModelConfig  # noqa: E402
from trace_common.model.records import SampleRecords  # noqa: E402
from trace_common.model.runtime import RolloutHooks  # noqa: E402
from trace_common.model.train_forward import forward_logprobs  # noqa: E402
from trace_common.rl.policy import LearnerConfig, ModelLearner  # noqa: E402
from trace_common.tasks import CharTokenizer  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0

# (name, compute dtype, qat mode, activation checkpointing)
CONFIGS: tuple[tuple[str, str, str, bool], ...] = (
    ("fp32 trace", "float32", "trace", False),
    ("bf16 none", "bfloat16", "none", False),
    ("bf16 rtn", "bfloat16", "rtn", False),
    ("bf16 trace", "bfloat16", "trace", False),
    ("bf16 rtn ckpt", "bfloat16", "rtn", True),
    ("bf16 trace ckpt", "bfloat16", "trace", True),
)


@dataclass(kw_only=True, slots=True)
class Result:
    name: str
    compute_dtype: str
    qat_mode: str
    activation_checkpointing: bool
    step_s_median: float
    step_s_all: list[float]
    tokens_per_s: float
    mfu: float
    peak_memory_gib: float
    profile: dict[str, Any] | None = None


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward multiplies with (routed experts: top_k of them)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2  # q, o; k, v
    n = 0
    for layer in range(cfg.num_layers):
        n += attn
        if cfg.is_moe_layer(layer):
            n += h * cfg.num_experts + cfg.top_k * 3 * h * cfg.moe_intermediate_size
            if cfg.shared_expert_intermediate_size:
                n += 3 * h * cfg.shared_expert_intermediate_size
        else:
            n += 3 * h * cfg.intermediate_size
    return n + h * cfg.vocab_size  # LM head


def train_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    attn = 6 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim  # causal: half of 12
    return 6.0 * active_params(cfg) + attn


def build_model(cfg: ModelConfig, device: torch.device, seed: int) -> MoECausalLM:
    """Random init straight on the device (init_weights draws on the CPU: slow at 1B)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = MoECausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


@torch.no_grad()
def rollout_records(
    model: MoECausalLM, tokens: torch.Tensor, guidance: GuidanceConfig, quant: QuantConfig
) -> list[SampleRecords]:
    """Per-sample records of one FP4 rollout-path forward over tokens [B, T] (all length T)."""
    b, t = tokens.shape
    cfg = model.cfg
    guided = frozenset(guidance.resolve(cfg, quant))
    hooks = RolloutHooks(quant, guided, guidance.mode)
    inputs = tokens[:, :-1]
    positions = torch.arange(t - 1, device=tokens.device)[None].expand(b, -1)
    valid = torch.ones(b, t - 1, dtype=torch.bool, device=tokens.device)
    with torch.autocast(device_type=tokens.device.type, dtype=torch.bfloat16):
        model(inputs, positions, valid, hooks)
    rows = t - 1
    moe = cfg.moe_layers
    routing = torch.stack([hooks.routing[layer] for layer in moe], 1).cpu()  # [B*R, n_moe, k]
    captured = {k: g.to("cpu") for k, g in hooks.captured.items()}  # records are parsed on CPU
    out = []
    for i in range(b):
        lo, hi = i * rows, (i + 1) * rows
        rec = SampleRecords(
            tokens=tokens[i].cpu(),
            prompt_len=1,
            fmt=quant.format,
            mode=guidance.mode,
            guidance={k: g.rows(lo, hi) for k, g in captured.items()},
            moe_layers=moe,
            routing=routing[lo:hi],
        )
        rec.validate(cfg)
        out.append(rec)
    return out


def time_config(
    model: MoECausalLM,
    tokens: torch.Tensor,
    records: list[SampleRecords],
    spec: tuple[str, str, str, bool],
    args: argparse.Namespace,
    flops_per_token: float,
) -> Result:
    name, dtype, qat, ckpt = spec
    device = tokens.device
    learner = ModelLearner(
        model,
        LearnerConfig(mode="trace", lr=1e-5, compute_dtype=dtype, activation_checkpointing=ckpt),
        quant=QuantConfig(),
        guidance=None,
        eos_id=0,
        pad_id=0,
        device=device,
    )
    b, t = tokens.shape
    lengths = torch.full((b,), t, device=device)
    adv = torch.linspace(-1.0, 1.0, b, device=device)[:, None]  # [B, 1] stand-in advantages
    n_tokens = b * (t - 1)

    def step() -> None:
        with learner.compute():
            out = forward_logprobs(
                model, tokens, lengths=lengths, qat_mode=qat, records=records,
                routing_replay=True,
            )  # fmt: skip
        loss = -(out.logprobs * adv).sum() / n_tokens
        learner.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        learner.optimizer.step()

    cuda = device.type == "cuda"
    for _ in range(args.warmup):
        step()
    profile = profile_step(step, device, args.top) if args.profile else None
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tps = n_tokens / med
    res = Result(
        name=name,
        compute_dtype=dtype,
        qat_mode=qat,
        activation_checkpointing=ckpt,
        step_s_median=med,
        step_s_all=times,
        tokens_per_s=tps,
        mfu=tps * flops_per_token / (args.peak_tflops * 1e12),
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
        profile=profile,
    )
    model.zero_grad(set_to_none=True)
    return res


HOST_WAITS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaEventSynchronize")  # fmt: skip
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def profile_step(step, device: torch.device, top: int) -> dict[str, Any]:
    """One `step()` under torch.profiler: host waits, kernel launches, device busy time and
    the top ops by host and by device self time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    ev = prof.key_averages()
    counts = {e.key: e.count for e in ev}
    waits = {k: counts[k] for k in HOST_WAITS if k in counts}
    launches = sum(counts.get(k, 0) for k in LAUNCHES)
    ops = sum(e.count for e in ev if e.key.startswith("aten::"))

    def device_us(e) -> float:
        return float(
            getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        )

    kernels = [e for e in ev if device_us(e) > 0 and not e.key.startswith(("aten::", "cuda"))]
    busy_us = sum(device_us(e) for e in kernels)
    by_host = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_dev = sorted(kernels, key=device_us, reverse=True)[:top]
    return {
        "wall_s": wall,
        "host_waits": waits,
        "host_waits_total": sum(waits.values()),
        "kernel_launches": launches,
        "aten_ops": ops,
        "device_busy_s": busy_us / 1e6,
        "top_host_self_ms": [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in by_host],
        "top_device_self_ms": [(e.key[:90], e.count, device_us(e) / 1e3) for e in by_dev],
    }


def print_profile(name: str, pr: dict[str, Any]) -> None:
    busy = f", device busy {pr['device_busy_s']:.3f} s" if pr["device_busy_s"] else ""
    print(f"\n{name} profiled step: {pr['wall_s']:.3f} s wall{busy}; host waited for the "
          f"device {pr['host_waits_total']} times {pr['host_waits']}; "
          f"{pr['kernel_launches']} kernel launches, {pr['aten_ops']} aten ops")  # fmt: skip
    print("  top host self time (op, calls, ms):")
    for k, n, ms in pr["top_host_self_ms"]:
        print(f"    {ms:9.1f}  {n:6d}  {k}")
    if pr["top_device_self_ms"]:
        print("  top device self time (kernel, calls, ms):")
        for k, n, ms in pr["top_device_self_ms"]:
            print(f"    {ms:9.1f}  {n:6d}  {k}")


def overheads(results: list[Result]) -> dict[str, float]:
    by = {r.name: r.step_s_median for r in results}
    out = {}
    for suffix in ("", " ckpt"):
        rtn, trace = by.get(f"bf16 rtn{suffix}"), by.get(f"bf16 trace{suffix}")
        if rtn and trace:
            out[f"guided_vs_rtn{suffix.replace(' ', '_')}"] = trace / rtn - 1.0
    if by.get("bf16 none") and by.get("bf16 rtn"):
        out["rtn_vs_none"] = by["bf16 rtn"] / by["bf16 none"] - 1.0
    if by.get("bf16 trace") and by.get("bf16 trace ckpt"):
        out["ckpt_overhead_trace"] = by["bf16 trace ckpt"] / by["bf16 trace"] - 1.0
    if by.get("fp32 trace") and by.get("bf16 trace"):
        out["bf16_speedup_vs_fp32_trace"] = by["fp32 trace"] / by["bf16 trace"]
    return out


def table(results: list[Result], extra: dict[str, float]) -> str:
    lines = [
        f"{'config':<18}{'step s':>9}{'tokens/s':>11}{'MFU %':>8}{'peak GiB':>10}",
        "-" * 56,
    ]
    for r in results:
        lines.append(
            f"{r.name:<18}{r.step_s_median:>9.3f}{r.tokens_per_s:>11.0f}"
            f"{100 * r.mfu:>8.2f}{r.peak_memory_gib:>10.1f}"
        )
    lines.append("-" * 56)
    for k, v in extra.items():
        lines.append(f"{k}: {v:+.1%}" if "speedup" not in k else f"{k}: {v:.2f}x")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, required=True, help="JSON results path")
    p.add_argument("--shape", default="mid-1b")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--seq", type=int, default=160, help="tokens per sequence")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--configs", default=",".join(c[0] for c in CONFIGS),
                   help="comma-separated names from: " + ", ".join(c[0] for c in CONFIGS))  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--device", default="cuda", help="cuda | cuda:N (cpu: a smoke test only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="profile one more step per configuration (module docstring)")  # fmt: skip
    p.add_argument("--top", type=int, default=15, help="--profile: ops listed per table")
    args = p.parse_args(argv)
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(wanted) - {c[0] for c in CONFIGS})
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {[c[0] for c in CONFIGS]}")
    specs = [c for c in CONFIGS if c[0] in wanted]
    device = resolve_device(args.device)
    tok = CharTokenizer()
    cfg = get_config(args.shape).replace(vocab_size=tok.vocab_size)
    t0 = time.perf_counter()
    model = build_model(cfg, device, args.seed)
    quant, guidance = QuantConfig(), GuidanceConfig()
    from trace_common.model.quant import quantize_policy

    quantize_policy(model, quant)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    tokens = torch.randint(0, tok.vocab_size, (args.batch, args.seq), generator=g).to(device)
    records = rollout_records(model, tokens, guidance, quant)
    setup_s = time.perf_counter() - t0
    fpt = train_flops_per_token(cfg, args.seq)
    results = []
    for spec in specs:
        results.append(time_config(model, tokens, records, spec, args, fpt))
        gc.collect()  # the configuration's optimizer state goes before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = results[-1]
        print(f"{r.name}: {r.step_s_median:.3f} s/step, {r.tokens_per_s:.0f} tokens/s", flush=True)
        if r.profile is not None:
            print_profile(r.name, r.profile)
    extra = overheads(results)
    report = {
        "bench": "trainer_gpu",
        "commit": git_commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_active_per_token": active_params(cfg),
        "train_flops_per_token": fpt,
        "peak_tflops": args.peak_tflops,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_per_step": args.batch * (args.seq - 1),
        "guided_sites": [list(k) for k in guidance.resolve(cfg, quant)],
        "guidance_mode": guidance.mode,
        "warmup": args.warmup,
        "iters": args.iters,
        "setup_s": setup_s,
        "results": [asdict(r) for r in results],
        "overheads": extra,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print()
    print(table(results, extra))
    print(f"\nJSON: {args.out}")
    return report


if __name__ == "__main__":
    main()
