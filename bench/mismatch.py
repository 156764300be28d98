"""Train-rollout mismatch of the FP4 policy in every QAT mode (the paper's central claim).

1. Briefly trains a small MoE (default 8 layers, 8 experts top-2) by next-token prediction on
   the project's digit tasks (sort / reverse / addition), so activations carry signal.
2. Quantizes it once, exports the FP4 policy and loads it as the rollout engine (in
   --rollout-dtype), and samples a batch with the FP4 rollout path (W4A4 experts + FP4 KV),
   recording full guidance at every layer and site plus routing.
3. Runs the training path (fp32 master weights by default, --train-dtype; the same FP4 weight
   codes) in every mode: none, rtn,
   trace-full (all layers), trace-compact with the deeper 100/50/25/12.5% of layers guided,
   each with and without routing replay; prints one table of all discrepancy metrics and
   guidance bytes per token, and saves a PNG (per-layer D_act at the expert input, and
   mean |dlogp| per mode).

D_act and code flips are measured at every layer's expert input and K/V (all are recorded in
full by the rollout for measurement; each mode only *uses* the records it would have).
Train-side values are cast to the rollout dtype before comparison.

    .venv/bin/python bench/mismatch.py [--steps 300] [--rollout-dtype bf16] [--plot docs/mismatch.png]
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from trace_common.model import (
    GuidanceConfig,
    ModelConfig,
    MoECausalLM,
    QuantConfig,
    SamplingConfig,
    export_quantized_state_dict,
    forward_logprobs,
    generate,
    load_quantized_state_dict,
    quantize_policy,
)
from trace_common.model.discrepancy import (
    activation_discrepancy,
    logprob_discrepancy,
    rollout_reference,
    routing_mismatch,
)
from trace_common.model.records import batch_routing
from trace_common.tasks import CharTokenizer, exact_match_reward, make_task

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GUIDED_FRACTIONS = (1.0, 0.5, 0.25, 0.125)
EXACT_FLOOR = 1e-9  # log-scale plots show exact agreement (0) at this value


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    layers: int = 8
    hidden: int = 128
    experts: int = 8
    top_k: int = 2
    steps: int = 300  # training steps (AdamW, next-token CE)
    batch: int = 64  # training batch
    lr: float = 3e-3
    samples: int = 32  # rollout batch
    max_new_tokens: int = 12
    temperature: float = 1.0
    fmt: str = "nvfp4"
    rollout_dtypes: tuple[str, ...] = ("bf16", "fp32")  # one rollout engine per dtype
    train_dtype: str = "fp32"  # dtype of the training path being measured
    device: str = "cpu"
    difficulty: int = 4
    seed: int = 0
    threads: int = 1
    plot: str | None = "docs/mismatch.png"


def build_model(cfg: BenchConfig, vocab: int) -> MoECausalLM:
    mcfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=cfg.hidden,
        num_layers=cfg.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        num_experts=cfg.experts,
        top_k=cfg.top_k,
        moe_intermediate_size=cfg.hidden // 2,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    return MoECausalLM(mcfg).init_weights(seed=cfg.seed, std=0.05)


def problems(cfg: BenchConfig, tok: CharTokenizer, n: int, rng: random.Random):
    task = make_task("mixed", cfg.difficulty)
    out = []
    for _ in range(n):
        p = task.sample(rng)
        out.append(([tok.bos_id, *tok.encode(p.prompt)], [*tok.encode(p.answer), tok.eos_id], p))
    return out


def train(model: MoECausalLM, cfg: BenchConfig, tok: CharTokenizer, console: Console) -> None:
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    loss_val = float("nan")
    for step in track(range(cfg.steps), description="training (next-token CE)", console=console):
        batch = problems(cfg, tok, cfg.batch, rng)
        seqs = [p + a for p, a, _ in batch]
        res = forward_logprobs(model, seqs, qat_mode="none")
        loss = -(res.logprobs.sum() / res.mask.sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_val = float(loss.detach())
        if step % 100 == 0 or step == cfg.steps - 1:
            console.log(f"step {step}: loss {loss_val:.3f}")
    model.eval()


def mode_list(num_layers: int) -> list[tuple[str, str, GuidanceConfig | None]]:
    """(label, qat_mode, guidance the mode uses)."""
    modes: list[tuple[str, str, GuidanceConfig | None]] = [
        ("none", "none", None),
        ("rtn", "rtn", None),
    ]
    modes.append(("trace-full 100%", "trace", GuidanceConfig.deepest(1.0, num_layers, mode="full")))
    for f in GUIDED_FRACTIONS:
        g = GuidanceConfig.deepest(f, num_layers, mode="compact")
        modes.append((f"trace-compact {f * 100:g}% ({len(g.layers)}L)", "trace", g))
    return modes


def run(cfg: BenchConfig, console: Console) -> None:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = CharTokenizer()
    model = build_model(cfg, tok.vocab_size).to(cfg.device)
    t0 = time.perf_counter()
    train(model, cfg, tok, console)
    console.log(f"trained {cfg.steps} steps in {time.perf_counter() - t0:.1f}s")

    quantize_policy(model, QuantConfig(format=cfg.fmt))
    all_results = {}
    for name in cfg.rollout_dtypes:
        all_results[name] = evaluate(model, cfg, tok, name, console)
    if cfg.plot:
        _plot(all_results, cfg, cfg.plot)
        console.log(f"plot written to {cfg.plot}")


def evaluate(
    model: MoECausalLM, cfg: BenchConfig, tok: CharTokenizer, dtype_name: str, console: Console
) -> list[dict]:
    """Roll out with an engine in `dtype_name` loaded from the exported policy, then run the
    training path in every mode against it; prints the table, returns the rows."""
    tensors, meta = export_quantized_state_dict(model)
    rdtype = DTYPES[dtype_name]
    engine = load_quantized_state_dict(tensors, meta, dtype=rdtype).to(cfg.device)
    # The measured training path: same master weights and FP4 codes (buffers), in train dtype.
    trainer = copy.deepcopy(model).to(DTYPES[cfg.train_dtype])
    batch = problems(cfg, tok, cfg.samples, random.Random(cfg.seed + 1))
    all_layers = tuple(range(cfg.layers))
    t0 = time.perf_counter()
    out = generate(
        engine,
        [p for p, _, _ in batch],
        SamplingConfig(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            stop_token_ids=(tok.eos_id,),
            seed=cfg.seed,
        ),
        guidance=GuidanceConfig(layers=all_layers, mode="full"),
    )
    n_gen = sum(map(len, out.tokens))
    acc = sum(
        exact_match_reward(t, p.answer, tok) for t, (_, _, p) in zip(out.tokens, batch, strict=True)
    ) / len(batch)
    console.log(
        f"rollout ({dtype_name}, FP4 {cfg.fmt} W4A4 + KV): {len(batch)} samples, "
        f"{n_gen} tokens in {time.perf_counter() - t0:.1f}s, exact-match accuracy {acc:.2f}"
    )
    seqs = [p + t for p, t in zip(out.prompts, out.tokens, strict=True)]
    ref_values, ref_codes = rollout_reference(out.records, rdtype)
    rollout_lp = torch.tensor([lp for row in out.logprobs for lp in row], dtype=torch.float64)
    recorded_routes = batch_routing(out.records)
    rows_total = sum(r.num_rows for r in out.records)

    table = Table(
        title=f"Train ({cfg.train_dtype}) vs FP4 rollout ({dtype_name}) on {cfg.device}, {cfg.fmt}, "
        f"{cfg.layers} layers, {n_gen} sampled tokens"
    )
    for col in (
        "mode",
        "replay",
        "mean|dlogp|",
        "max|dlogp|",
        "k3 KL",
        "exp(mean|dlogp|)",
        "D_act moe_in",
        "D_act kv",
        "flip moe_in",
        "flip kv",
        "route diff",
        "guide B/tok",
    ):
        table.add_column(col, justify="left" if col in ("mode", "replay") else "right")
    results = []
    for label, qat_mode, g in track(
        mode_list(cfg.layers), description="training path", console=console
    ):
        keys = {k for k in ref_values if g is not None and k[0] in g.layers}
        for replay in (False, True):
            recs = [r.select(keys, mode=g.mode if g else None, routing=replay) for r in out.records]
            with torch.no_grad():
                res = forward_logprobs(
                    trainer,
                    seqs,
                    qat_mode=qat_mode,
                    records=recs,
                    routing_replay=replay,
                    collect=True,
                )
            train_lp = torch.cat(
                [
                    res.logprobs[i, len(p) - 1 : len(s) - 1]
                    for i, (s, p) in enumerate(zip(seqs, out.prompts, strict=True))
                ]
            )
            lpd = logprob_discrepancy(train_lp.cpu(), rollout_lp)
            vals = {k: v.to(rdtype) for k, v in res.site_values.items()}
            ad = activation_discrepancy(vals, res.site_codes, ref_values, ref_codes)
            moe = [d for k, d in ad.items() if k[1] == "moe_in"]
            kv = [d for k, d in ad.items() if k[1] in ("k", "v")]
            route = sum(
                routing_mismatch(res.own_routing[la], recorded_routes[la]) for la in recorded_routes
            ) / len(recorded_routes)
            gbytes = sum(r.guidance_nbytes for r in recs) / rows_total
            row = dict(
                label=label,
                replay=replay,
                lpd=lpd,
                ad=ad,
                route=route,
                gbytes=gbytes,
                d_moe=_mean([d.d_act for d in moe]),
                d_kv=_mean([d.d_act for d in kv]),
                f_moe=_mean([d.flip_rate for d in moe]),
                f_kv=_mean([d.flip_rate for d in kv]),
            )
            results.append(row)
            table.add_row(
                label,
                "yes" if replay else "no",
                f"{lpd.mean_abs:.2e}",
                f"{lpd.max_abs:.2e}",
                f"{lpd.k3_kl:.2e}",
                f"{lpd.exp_mean_abs:.5f}",
                f"{row['d_moe']:.2e}",
                f"{row['d_kv']:.2e}",
                f"{row['f_moe']:.2e}",
                f"{row['f_kv']:.2e}",
                f"{route:.3f}",
                f"{gbytes:.0f}",
            )
    console.print(table)
    console.print(_markdown(results))
    console.print(
        "D_act / flip: mean over all layers (moe_in = hidden state entering the routed "
        "experts; kv = K and V). route diff: fraction of (token, layer) whose own top-k "
        "set differs from the rollout's. guide B/tok: guidance bytes per token used."
    )
    return results


def _markdown(results: list[dict]) -> str:
    head = (
        "| mode | replay | mean\\|dlogp\\| | max\\|dlogp\\| | k3 KL | exp(mean\\|dlogp\\|) | "
        "D_act moe_in | D_act kv | flip moe_in | flip kv | route diff | guide B/tok |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        lpd = r["lpd"]
        lines.append(
            f"| {r['label']} | {'yes' if r['replay'] else 'no'} | {lpd.mean_abs:.2e} | "
            f"{lpd.max_abs:.2e} | {lpd.k3_kl:.2e} | {lpd.exp_mean_abs:.5f} | {r['d_moe']:.2e} | "
            f"{r['d_kv']:.2e} | {r['f_moe']:.2e} | {r['f_kv']:.2e} | {r['route']:.3f} | "
            f"{r['gbytes']:.0f} |"
        )
    return "\n".join(lines)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _plot(all_results: dict[str, list[dict]], cfg: BenchConfig, path: str) -> None:
    """One row per rollout dtype: per-layer D_act at the expert input (with routing replay),
    and mean |dlogp| per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(all_results)
    fig, axes = plt.subplots(n, 2, figsize=(14, 4.6 * n), squeeze=False)
    for (dtype_name, results), (ax1, ax2) in zip(all_results.items(), axes, strict=True):
        for row in results:
            if not row["replay"]:
                continue
            layers = sorted(k[0] for k in row["ad"] if k[1] == "moe_in")
            ys = [max(row["ad"][(la, "moe_in")].d_act, EXACT_FLOOR) for la in layers]
            ax1.plot(layers, ys, marker="o", label=row["label"])
        ax1.set_yscale("log")
        ax1.set_xlabel("layer")
        ax1.set_ylabel(f"D_act at expert input ({EXACT_FLOOR:g} = exact)")
        ax1.set_title(f"{dtype_name} rollout: D_act per layer (routing replay)")
        ax1.legend(fontsize=7)
        labels = [f"{r['label']}{' +R' if r['replay'] else ''}" for r in results]
        ax2.barh(
            labels,
            [max(r["lpd"].mean_abs, EXACT_FLOOR) for r in results],
            color=["tab:blue" if r["replay"] else "tab:gray" for r in results],
        )
        ax2.set_xscale("log")
        ax2.set_xlabel("mean |logp_train - logp_rollout|  (+R: routing replay)")
        ax2.set_title(f"{dtype_name} rollout: log-prob mismatch")
        ax2.invert_yaxis()
        ax2.tick_params(axis="y", labelsize=7)
    fig.suptitle(
        f"TRACE mismatch bench: {cfg.train_dtype} trainer vs FP4 {cfg.fmt} rollout ({cfg.device})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    d = BenchConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--samples", type=int, default=d.samples)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--format", dest="fmt", choices=("nvfp4", "mxfp4"), default=d.fmt)
    ap.add_argument(
        "--rollout-dtypes",
        default=",".join(d.rollout_dtypes),
        help="comma list of rollout engine dtypes (bf16, fp32)",
    )
    ap.add_argument("--train-dtype", choices=tuple(DTYPES), default=d.train_dtype)
    ap.add_argument("--device", default=d.device, help="cpu or cuda")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--plot", default=d.plot, help="PNG path ('' for none)")
    a = ap.parse_args()
    cfg = BenchConfig(
        steps=a.steps,
        layers=a.layers,
        samples=a.samples,
        max_new_tokens=a.max_new_tokens,
        fmt=a.fmt,
        rollout_dtypes=tuple(a.rollout_dtypes.split(",")),
        train_dtype=a.train_dtype,
        device=a.device,
        seed=a.seed,
        threads=a.threads,
        plot=a.plot or None,
    )
    run(cfg, Console(width=200))


if __name__ == "__main__":
    main()
