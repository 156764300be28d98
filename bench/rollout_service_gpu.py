"""The rollout service on the GPU, driven over gRPC with RL-shaped work (CUDA machine).

For each engine (FP4, BF16) and each batch: start Redis, quant-cache and weight-sync, push a
random policy of the shape, start the rollout service as its own process with
TRACE_ROLLOUT_ENGINE=cuda and TRACE_ROLLOUT_MAX_BATCH=batch, and keep `batch` sequences in
flight: Generate calls of one prompt x `--group` completions, prompts of `--prompt-min` ..
`--prompt-max` tokens, each call's max_new_tokens drawn up to `--completion-max`. Generated
tokens per second are read from the service's engine counters over a window after a warm-up.
Then, in the same run: the seconds from pushing a new version to the replica serving it, and
the raw decode engine's tok/s at the same batch (one CUDA-graph step), with the service
stopped, at two context mixes:

- "service mix" (the reference the service is measured against): each sequence's context drawn
  as the service's sequences have it at a random moment: a prompt length drawn as the driver
  draws it, plus a point in a completion whose length is drawn as the driver draws it,
  weighted by that length (a long completion holds its slot longer);
- "fixed": every sequence at `--raw-context` tokens.

    python3 bench/rollout_service_gpu.py --engines fp4 bf16 --batches 32 128 256 \\
        --layers 24 --out rollout_service.json

Prints a table; writes every figure to --out (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import random
import secrets
import sys
import tempfile
import threading
import time

import httpx
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from trace_common.clients import WeightSyncClient
from trace_common.model import GuidanceConfig, QuantConfig, get_config
from trace_common.model.config import ModelConfig
from trace_common.model.quant import policy_metadata
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from trace_common.rollout.meta import PolicyMeta
from trace_common.service.process import LocalService, local_stores

EOS, PAD = 2, 0
E4M3_ONE = 0x38  # bit pattern of 1.0 in float8_e4m3fn


def random_policy(
    cfg: ModelConfig, fp4: bool, seed: int, device: str = "cuda"
) -> tuple[dict, dict]:
    """A pushed version (export_quantized_state_dict's layout) with random weights: experts
    as random NVFP4 codes with block scales near 1 and a per-expert scale_2 of 0.004 (weights
    of magnitude ~0.02), or BF16 normal(0, 0.02); everything else BF16 normal(0, 0.02)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()

    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(cfg.vocab_size, h),
        "lm_head.weight": rnd(cfg.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for li in range(cfg.num_layers):
        p = f"model.layers.{li}."
        for name, shape in (("self_attn.q_proj", (cfg.num_heads * cfg.head_dim, h)),
                            ("self_attn.k_proj", (cfg.num_kv_heads * cfg.head_dim, h)),
                            ("self_attn.v_proj", (cfg.num_kv_heads * cfg.head_dim, h)),
                            ("self_attn.o_proj", (h, cfg.num_heads * cfg.head_dim)),
                            ("mlp.gate", (e, h))):  # fmt: skip
            t[p + name + ".weight"] = rnd(*shape)
        for name in ("input_layernorm", "post_attention_layernorm"):
            t[p + name + ".weight"] = torch.ones(h, dtype=torch.bfloat16)
        for name in ("self_attn.q_norm", "self_attn.k_norm"):
            t[p + name + ".weight"] = torch.ones(cfg.head_dim, dtype=torch.bfloat16)
        for proj, (n, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            if fp4:
                codes = torch.randint(0, 256, (e, n, k // 2), generator=g, device=device,
                                      dtype=torch.uint8).cpu()  # fmt: skip
                scales = (E4M3_ONE + torch.randint(-8, 8, (e, n, k // 16), generator=g,
                                                   device=device)).to(torch.uint8).cpu()  # fmt: skip
                for x in range(e):
                    base = f"{p}mlp.experts.{x}.{proj}"
                    t[base + ".weight"] = codes[x]
                    t[base + ".weight_scale"] = scales[x].view(torch.float8_e4m3fn)
                    t[base + ".weight_scale_2"] = torch.tensor(0.004)
            else:
                w = rnd(e, n, k)
                for x in range(e):
                    t[f"{p}mlp.experts.{x}.{proj}.weight"] = w[x]
    quant = QuantConfig() if fp4 else QuantConfig.none()
    meta = {
        **policy_metadata(cfg, quant),
        **PolicyMeta(guidance=GuidanceConfig() if fp4 else None, eos_id=EOS,
                     pad_id=PAD).to_metadata(),
    }  # fmt: skip
    return t, meta


class Driver:
    """Keeps `concurrency` sequences in flight with Generate calls of `group` completions."""

    def __init__(self, address: str, token: str, args: argparse.Namespace, vocab: int) -> None:
        import grpc

        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 64 << 20)])  # fmt: skip
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.md = (("authorization", f"Bearer {token}"),)
        self.args, self.vocab = args, vocab
        self.stop = threading.Event()
        self.completed_tokens = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def _loop(self, worker: int) -> None:
        rng = random.Random(worker)
        a = self.args
        n = 0
        while not self.stop.is_set():
            plen = rng.randint(a.prompt_min, a.prompt_max)
            req = rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=[rng.randrange(3, self.vocab)
                                                       for _ in range(plen)])],
                group_size=a.group,
                sampling=rollout_pb2.SamplingParams(
                    temperature=1.0, max_new_tokens=rng.randint(a.completion_min,
                                                                a.completion_max),
                    seed=rng.randrange(1 << 62)),
                run_id="bench", sample_id_prefix=f"w{worker}-{n}",
            )  # fmt: skip
            n += 1
            try:
                got = sum(len(c.token_ids) for c in self.stub.Generate(req, metadata=self.md))
                with self._lock:
                    self.completed_tokens += got
            except Exception as exc:
                if not self.stop.is_set():
                    self.errors.append(repr(exc))
                return

    def start(self, concurrency: int) -> None:
        for w in range(concurrency // self.args.group):
            threading.Thread(target=self._loop, args=(w,), daemon=True).start()


def engine_stats(svc: LocalService) -> dict:
    return httpx.get(f"{svc.http_url}/status", timeout=10).json()


def measure_service(args, cfg, fp4: bool, batch: int, common: dict, ws: WeightSyncClient,
                    version: int, log_dir: pathlib.Path, token: str) -> dict:  # fmt: skip
    env = {**common, "TRACE_REPLICA_ID": f"bench-{batch}", "TRACE_ROLLOUT_ENGINE": "cuda",
           "TRACE_DEVICE": "cuda", "TRACE_ROLLOUT_MAX_BATCH": str(batch),
           "TRACE_ROLLOUT_MAX_CONTEXT": str(args.prompt_max + args.completion_max)}  # fmt: skip
    t0 = time.perf_counter()
    svc = LocalService(f"rollout-{batch}", "services.rollout", env, log_dir).launch()
    try:
        svc.wait_ports(timeout=600).wait_serving(timeout=600)
        ready_s = time.perf_counter() - t0
        st = engine_stats(svc)
        assert st["engine"] == "cuda", f"the service runs engine {st['engine']!r}"
        drv = Driver(svc.grpc_address, token, args, cfg.vocab_size)
        drv.start(batch)
        time.sleep(args.warmup)
        a = engine_stats(svc)["engine_stats"]
        ta = time.perf_counter()
        time.sleep(args.window)
        b = engine_stats(svc)["engine_stats"]
        tb = time.perf_counter()
        drv.stop.set()
        if drv.errors:
            raise RuntimeError(f"Generate failed: {drv.errors[:3]}")
        d = {k: b[k] - a[k] for k in a if k.endswith("_total")}
        out = {
            "batch": batch, "ready_seconds": ready_s,
            "first_pull_seconds": st["last_weight_pull_seconds"],
            "service_tok_s": d["sampled_tokens_total"] / (tb - ta),
            "window_seconds": tb - ta, "decode_steps": d["decode_steps_total"],
            "decode_step_ms": 1e3 * d["decode_seconds_total"] / max(d["decode_steps_total"], 1),
            "prefill_tokens": d["prefill_tokens_total"],
            "shared_prompt_tokens": d.get("shared_prompt_tokens_total", 0),
            "prefill_share": d["prefill_seconds_total"] / (tb - ta),
            "decode_share": d["decode_seconds_total"] / (tb - ta),
            "mean_active_slots": b["active_slots"],
        }  # fmt: skip
        if fp4 and args.swap and batch == args.batches[0]:
            tensors, meta = random_policy(cfg, fp4, seed=100 + version)
            tp = time.perf_counter()
            ws.push_version(version + 1, tensors, meta)
            pushed = time.perf_counter()
            del tensors
            while engine_stats(svc)["policy_version"] < version + 1:
                if time.perf_counter() - pushed > 600:
                    raise RuntimeError("the replica never served the new version")
                time.sleep(0.05)
            out.update(push_seconds=pushed - tp, push_to_serving_seconds=time.perf_counter() - pushed,
                       replica_pull_load_seconds=engine_stats(svc)["last_weight_pull_seconds"])  # fmt: skip
        return out
    finally:
        svc.stop()


def service_contexts(args: argparse.Namespace, batch: int, seed: int = 0) -> list[int]:
    """Each of `batch` slots' context at a random moment of the service's steady state: a
    prompt length uniform in [prompt_min, prompt_max] plus a point uniform in a completion
    whose length L is drawn with density proportional to L on [completion_min,
    completion_max] (the driver draws L uniformly; a slot spends time in proportion to L)."""
    rng = random.Random(seed)
    a2, b2 = args.completion_min**2, args.completion_max**2
    out = []
    for _ in range(batch):
        length = (a2 + rng.random() * (b2 - a2)) ** 0.5  # inverse CDF of density ~ L
        out.append(rng.randint(args.prompt_min, args.prompt_max) + int(rng.random() * length))
    return out


def raw_decode(cfg: ModelConfig, fp4: bool, batch: int, mixes: dict[str, list[int]],
               iters: int) -> dict[str, float]:  # fmt: skip
    """Raw engine tok/s per context mix (name -> each slot's context): one graph step of
    `batch` sequences, timed over `iters` replays (each replay advances every slot by one)."""
    from trace_common.kernels.engine import DecodeEngine, EngineShape, EngineWeights

    shape = EngineShape.from_model_config(cfg)
    w = EngineWeights.random(shape, "cuda", seed=0)
    if fp4:
        w.quantize_experts_()
    guided = tuple(range(cfg.num_layers // 2, cfg.num_layers)) if fp4 else ()
    longest = max(max(c) for c in mixes.values())
    mean = sum(sum(c) for c in mixes.values()) // sum(len(c) for c in mixes.values())
    eng = DecodeEngine(shape, w, batch=batch, capacity=longest + iters + 8, context=mean,
                       guided_layers=guided)  # fmt: skip
    eng.fill_context_()
    eng.capture()
    out = {}
    for name, contexts in mixes.items():
        ctx = torch.tensor(contexts, dtype=torch.int32, device=eng.pos.device)
        eng.pos.copy_(ctx)
        eng.lens.copy_(ctx + 1)
        for _ in range(3):
            eng.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            eng.replay()
        end.record()
        torch.cuda.synchronize()
        out[name] = batch / (start.elapsed_time(end) / iters / 1e3)
    del eng, w
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="use this many of the shape's layers")
    ap.add_argument("--engines", nargs="+", default=["fp4", "bf16"], choices=["fp4", "bf16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 128, 256])
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=256)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--completion-min", type=int, default=128)
    ap.add_argument("--completion-max", type=int, default=2048)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--raw-context", type=int, default=1536,
                    help="every sequence's context in the fixed-context raw reference")  # fmt: skip
    ap.add_argument("--raw-iters", type=int, default=50)
    ap.add_argument(
        "--no-swap",
        dest="swap",
        action="store_false",
        help="skip timing a new version's push -> served (FP4, first batch)",
    )
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("rollout_service_gpu.json"))
    args = ap.parse_args()
    cfg = get_config(args.shape)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    token = secrets.token_hex(16)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    results: list[dict] = []
    try:
        with local_stores(token, log_dir, keep_versions=1) as common:
            ws = WeightSyncClient(common["TRACE_WEIGHT_SYNC_ADDRESS"], token)
            version = 0
            for engine in args.engines:
                fp4 = engine == "fp4"
                tensors, meta = random_policy(cfg, fp4, seed=version)
                nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                t0 = time.perf_counter()
                ws.push_version(version, tensors, meta)
                push_s = time.perf_counter() - t0
                del tensors
                gc.collect()
                print(f"{engine}: pushed {nbytes / 2**30:.1f} GiB in {push_s:.1f} s", flush=True)
                for batch in args.batches:
                    r = measure_service(args, cfg, fp4, batch, common, ws, version, log_dir, token)
                    if fp4 and args.swap and batch == args.batches[0]:
                        version += 1
                    r.update(engine=engine, policy_gib=nbytes / 2**30, first_push_seconds=push_s)
                    mixes = {"service": service_contexts(args, batch),
                             "fixed": [args.raw_context] * batch}  # fmt: skip
                    raw = raw_decode(cfg, fp4, batch, mixes, args.raw_iters)
                    r["raw_tok_s"], r["raw_fixed_tok_s"] = raw["service"], raw["fixed"]
                    r["raw_mean_context"] = sum(mixes["service"]) / batch
                    r["service_over_raw"] = r["service_tok_s"] / r["raw_tok_s"]
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    args.out.write_text(json.dumps({"config": cfg.to_dict(), "results": results},
                                                   indent=1))  # fmt: skip
                version += 1
    finally:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "config": cfg.to_dict(), "results": results},
                                       indent=1))  # fmt: skip
    print(
        f"\n{args.shape} ({cfg.num_layers} layers), prompts {args.prompt_min}-{args.prompt_max},"
        f" completions {args.completion_min}-{args.completion_max}, group {args.group}"
    )
    print(
        "| engine | batch | service tok/s | raw tok/s, service mix | service/raw |"
        f" raw tok/s, {args.raw_context} fixed | decode step ms | prefill share |"
        " prompt tokens prefilled / copied | pull+load s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['batch']} | {r['service_tok_s']:.0f} | {r['raw_tok_s']:.0f} "
              f"| {r['service_over_raw']:.2f} | {r['raw_fixed_tok_s']:.0f} | "
              f"{r['decode_step_ms']:.2f} | {r['prefill_share']:.2f} | "
              f"{r['prefill_tokens']} / {r['shared_prompt_tokens']} | "
              f"{r.get('replica_pull_load_seconds', r['first_pull_seconds']):.1f} |")  # fmt: skip
    by = {(r["engine"], r["batch"]): r for r in results}
    for b in args.batches:
        if ("fp4", b) in by and ("bf16", b) in by:
            f, h = by[("fp4", b)], by[("bf16", b)]
            print(
                f"batch {b}: FP4/BF16 service {f['service_tok_s'] / h['service_tok_s']:.2f}x, "
                f"raw {f['raw_tok_s'] / h['raw_tok_s']:.2f}x"
            )


if __name__ == "__main__":
    main()
