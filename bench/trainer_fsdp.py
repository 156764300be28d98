"""The sharded learner (FSDP2, trace_common.rl.distributed) under torchrun: the train step of
bench/trainer_gpu.py (forward_logprobs with guided QAT + routing replay, backward, clip,
AdamW) with each rank on its slice of the batch, and the streamed FP4 export. Reports per
rank count: median step time, tokens/s (whole batch), MFU, peak memory, export seconds.

On the H200 (world size 1: the CUDA code path of FSDP2, bf16 params / fp32 reduce, next to
the single-process `bf16 trace` row of bench/trainer_gpu.py with the same shape and batch):

    torchrun --standalone --nproc-per-node 1 bench/trainer_fsdp.py --out runs/trainer_fsdp_ws1.json
    python bench/trainer_gpu.py --configs "bf16 trace" --out runs/trainer_gpu_bf16_trace.json

CPU smoke test (gloo, debug shape): add `--device cpu --shape debug --batch 4 --seq 12`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from trainer_gpu import (  # noqa: E402
    H200_BF16_DENSE_TFLOPS,
    build_model,
    git_commit,
    rollout_records,
    train_flops_per_token,
)

from trace_common.model import GuidanceConfig, QuantConfig, get_config  # noqa: E402
from trace_common.model.quant import quantize_policy  # noqa: E402
from trace_common.model.train_forward import forward_logprobs  # noqa: E402
from trace_common.rl.distributed import ShardedLearner, init_distributed  # noqa: E402
from trace_common.rl.policy import LearnerConfig  # noqa: E402
from trace_common.tasks import CharTokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, required=True, help="JSON results path (rank 0)")
    p.add_argument("--shape", default="mid-1b")
    p.add_argument(
        "--layers", type=int, default=None, help="override the shape's decoder layer count"
    )
    p.add_argument("--batch", type=int, default=64, help="sequences per step (whole batch)")
    p.add_argument("--seq", type=int, default=160, help="tokens per sequence")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--device", default="cuda", help="cuda (NCCL, cuda:LOCAL_RANK) | cpu (gloo)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    env, device = init_distributed(args.device)
    if args.batch % env.world_size:
        raise SystemExit(f"--batch {args.batch} must divide by the world size {env.world_size}")
    tok = CharTokenizer()
    cfg = get_config(args.shape).replace(vocab_size=tok.vocab_size)
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    quant, guidance = QuantConfig(), GuidanceConfig()
    t0 = time.perf_counter()
    model = build_model(cfg, device, args.seed)  # same weights on every rank (same seed)
    n_params = sum(p.numel() for p in model.parameters())
    quantize_policy(model, quant)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    tokens = torch.randint(0, tok.vocab_size, (args.batch, args.seq), generator=g)
    mine = slice(
        env.rank * args.batch // env.world_size, (env.rank + 1) * args.batch // env.world_size
    )
    tokens = tokens[mine].to(device)  # this rank's sequences
    records = rollout_records(model, tokens, guidance, quant)
    learner = ShardedLearner(
        model,
        LearnerConfig(
            mode="trace", lr=1e-5, activation_checkpointing=args.activation_checkpointing
        ),
        quant=quant, guidance=None, eos_id=0, pad_id=0, device=device,
    )  # fmt: skip
    setup_s = time.perf_counter() - t0
    b, t = tokens.shape
    lengths = torch.full((b,), t, device=device)
    # [B_rank, 1] stand-in advantages: this rank's slice of the whole batch's, so any world
    # size trains on the same loss
    adv = torch.linspace(-1.0, 1.0, args.batch)[mine, None].to(device)
    n_tokens = args.batch * (t - 1)  # whole batch: the loss is a mean over all ranks' tokens

    losses: list[torch.Tensor] = []  # whole-batch loss per step (warm-up steps included)

    def step() -> None:
        with learner.compute():
            out = forward_logprobs(
                learner.model, tokens, lengths=lengths, qat_mode="trace", records=records,
                routing_replay=True,
            )  # fmt: skip
        # FSDP2 averages gradients over ranks: scale so the sum is the whole batch's mean.
        loss = -(out.logprobs * adv).sum() / n_tokens * env.world_size
        learner.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach() / env.world_size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(learner.model.parameters(), 1.0)
        learner.optimizer.step()

    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    for _ in range(args.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.iters):
        t1 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t1)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    t1 = time.perf_counter()
    tensors, _ = learner.export_weights()
    sync()
    export_s = time.perf_counter() - t1
    loss_sum = torch.stack(losses)
    dist.all_reduce(loss_sum)  # each rank holds its share of the whole-batch mean
    med = statistics.median(times)
    tps = n_tokens / med
    fpt = train_flops_per_token(cfg, args.seq)
    peaks: list[Any] = [None] * env.world_size
    dist.all_gather_object(peaks, peak)
    report = {
        "bench": "trainer_fsdp",
        "commit": git_commit(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "world_size": env.world_size,
        "shape": args.shape,
        "layers": cfg.num_layers,
        "params": n_params,
        "loss_per_step": loss_sum.cpu().tolist(),
        "batch": args.batch,
        "seq": args.seq,
        "activation_checkpointing": args.activation_checkpointing,
        "setup_s": setup_s,
        "step_s_median": med,
        "step_s_all": times,
        "tokens_per_s": tps,
        "mfu": tps * fpt / (args.peak_tflops * 1e12 * env.world_size),
        "peak_memory_gib_per_rank": peaks,
        "export_s": export_s,
        "export_tensors": len(tensors),
        "export_bytes": sum(v.numel() * v.element_size() for v in tensors.values()),
    }
    dist.destroy_process_group()
    if env.rank != 0:
        return None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"world {env.world_size}: {med:.3f} s/step, {tps:.0f} tokens/s, "
        f"MFU {100 * report['mfu']:.2f}%, peak {max(peaks):.1f} GiB/rank, export {export_s:.2f} s"
    )
    print(f"JSON: {args.out}")
    return report


if __name__ == "__main__":
    main()
