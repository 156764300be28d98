"""A new policy version from "exported" to "every replica serves it": CUDA IPC, broadcast, full, delta.

Starts Redis, quant-cache and weight-sync, pushes a random FP4 policy of the shape, then for
each mode and each replica count:
- ipc: the trainer's publisher (services/trainer/remote.py) offers each version over CUDA
  IPC, then pushes it; replicas on this node copy it GPU to GPU (TRACE_CUDA_IPC);
- broadcast: the publisher broadcasts each version to the replicas (TRACE_BROADCAST) in one
  torch.distributed group, then pushes it: NCCL when the policy is on a GPU (the replicas
  must be on other GPUs, `--replica-device cuda:1`), gloo from host memory on the CPU;
- full: every version travels whole over the network path (no offers);
- delta: the trainer pushes and each replica pulls only what changed (TRACE_WEIGHT_DELTAS);
starts that many
rollout services on the GPU (the CUDA engine), waits until they serve, and times `--versions`
new versions. Each new version changes, per dtype, the fraction of elements a real run's
consecutive versions changed (`--fractions`, or read from a trainer's metrics.jsonl with
`--fractions-from`): uniformly drawn elements get their lowest bit flipped, so every picked
FP4 code byte, scale and BF16 value differs from the version before.

Each version is first exported as a trainer exports it from the GPU: packed into one GPU
buffer where it is offered from there (ipc, NCCL broadcast), else copied to the host; that
copy is timed apart (`export_seconds`). Per version it reports: the push (the publisher's
call: offer and push), the time from its start (the version exported) until every replica
serves the version, each replica's pull transfer (bytes in, rebuilt and
CRC-checked) and pull + engine load, and the bytes pushed and pulled.

    python3 bench/weight_sync_gpu.py --shape qwen3-30b-a3b --layers 24 --replicas 1 2 \\
        --fractions-from metrics.jsonl --out ws_gpu.json

Prints a table; writes every figure to --out (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import secrets
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from rollout_service_gpu import random_policy

from services.trainer.remote import WeightSyncPublisher
from trace_common.clients import WeightSyncClient
from trace_common.clients.broadcast import Source
from trace_common.device import pack_on_device, to_host
from trace_common.model import get_config
from trace_common.service.process import LocalService, local_stores

# Changed fraction per dtype when no run's figures are given: placeholders the caller should
# replace with a real run's (`--fractions-from`).
DEFAULT_FRACTIONS = {"uint8": 0.01, "float8_e4m3fn": 0.005, "bfloat16": 1.0, "float32": 1.0}


def run_fractions(path: pathlib.Path) -> dict[str, float]:
    """The median over a trainer's metrics.jsonl steps of each dtype's changed fraction."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    per: dict[str, list[float]] = {}
    for r in rows:
        for dtype, f in (r.get("weight_changed_fraction") or {}).items():
            per.setdefault(dtype, []).append(f)
    if not per:
        raise SystemExit(f"{path} has no weight_changed_fraction (no delta push was recorded)")
    return {k: statistics.median(v) for k, v in per.items()}


def next_version(tensors: dict[str, torch.Tensor], fractions: dict[str, float],
                 gen: torch.Generator) -> dict[str, torch.Tensor]:  # fmt: skip
    """A copy of `tensors` with `fractions[dtype]` of each tensor's elements' lowest bit flipped."""
    out = {}
    for name, t in tensors.items():
        f = fractions.get(str(t.dtype).removeprefix("torch."), 0.0)
        new = t.clone()
        n = new.numel()
        k = min(n, round(n * f))
        if k:
            width = new.element_size()
            rows = new.reshape(-1).view(torch.uint8).view(n, width)
            idx = torch.randint(0, n, (k,), generator=gen) if k < n else torch.arange(n)
            rows[idx, 0] ^= 1
        out[name] = new
    return out


def export(policy: dict[str, torch.Tensor], *, offers_from_gpu: bool) -> tuple[dict, float]:
    """What a trainer's export hands its publisher (ModelLearner.export_weights) for a policy
    on the GPU: packed into one new GPU buffer where the version is offered from the GPU
    (CUDA IPC, NCCL), else copied to the host; and the seconds that copy took. It belongs to
    the export: the time to serve is counted from its end."""
    if not all(t.is_cuda for t in policy.values()):
        return policy, 0.0
    t0 = time.perf_counter()
    out = pack_on_device(policy) if offers_from_gpu else to_host(policy)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def status(svc: LocalService) -> dict:
    return httpx.get(f"{svc.http_url}/status", timeout=10).json()


def wait_serving(replicas: list[LocalService], version: int, t0: float, limit: float,
                 push: Future | None = None) -> dict:  # fmt: skip
    """Seconds from t0 until each replica serves `version` (raising what `push` raised)."""
    served: dict[str, float] = {}
    while len(served) < len(replicas):
        if push is not None and push.done():
            push.result()
        for r in replicas:
            if r.name not in served and status(r)["policy_version"] >= version:
                served[r.name] = time.perf_counter() - t0
        if time.perf_counter() - t0 > limit:
            raise RuntimeError(f"replicas never served version {version}: {served}")
        time.sleep(0.02)
    return served


def measure(args, mode: str, n_replicas: int, ws_addr: str, common: dict, token: str,
            policy: dict, meta: dict, version: int, fractions: dict,
            log_dir: pathlib.Path) -> tuple[list, dict, int]:  # fmt: skip
    """Start the replicas, push `args.versions` new versions, time each; returns the rows,
    the last version's tensors and its number."""
    deltas, ipc = mode == "delta", mode == "ipc"
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    env = {**common, "TRACE_ROLLOUT_ENGINE": args.engine,
           "TRACE_DEVICE": args.replica_device or args.device,
           "TRACE_ROLLOUT_MAX_BATCH": "8", "TRACE_ROLLOUT_MAX_CONTEXT": "512",
           "TRACE_WEIGHT_DELTAS": str(deltas).lower(),
           "TRACE_CUDA_IPC": str(ipc).lower(),
           "TRACE_BROADCAST": backend if mode == "broadcast" else "off"}  # fmt: skip
    replicas = [
        LocalService(
            f"rollout-{mode}-{i}",
            "services.rollout",
            {**env, "TRACE_REPLICA_ID": f"bench-{mode}-{i}"},
            log_dir,
        ).launch()
        for i in range(n_replicas)
    ]
    trainer = WeightSyncClient(ws_addr, token, deltas=deltas)
    source = Source("127.0.0.1", 0, backend, 120.0) if mode == "broadcast" else None
    publisher = WeightSyncPublisher(trainer, cuda_ipc=ipc, source=source)
    pusher = ThreadPoolExecutor(1)
    if ipc and not publisher.cuda_ipc:
        raise SystemExit("mode ipc: this host has no boot id to offer CUDA IPC under")
    rows = []
    gen = torch.Generator().manual_seed(1000 + version)
    try:
        for r in replicas:
            r.wait_ports(timeout=600).wait_serving(timeout=600)
        wait_serving(replicas, version, time.perf_counter(), 600)
        if deltas:  # the trainer's base: the version the replicas hold, as the trainer pushed it
            publisher.publish(version + 1, policy, meta)
            version += 1
            wait_serving(replicas, version, time.perf_counter(), 600)
        for _ in range(args.versions):
            policy = next_version(policy, fractions, gen)
            version += 1
            gc.collect()
            exported, export_s = export(
                policy, offers_from_gpu=ipc or (mode == "broadcast" and backend == "nccl")
            )
            t0 = time.perf_counter()
            # replicas may serve it before the push completes (ipc)
            push = pusher.submit(publisher.publish, version, exported, meta)
            served = wait_serving(replicas, version, t0, 600, push)
            push.result()
            push_s = publisher.last_push_seconds
            st = [status(r) for r in replicas]
            row = {
                "mode": mode, "replicas": n_replicas, "version": version,
                "export_seconds": export_s, "push_seconds": push_s,
                "offer_seconds": publisher.last_offer_seconds,
                "served_seconds": max(served.values()),
                "push_bytes": trainer.last_push["weight_push_bytes"],
                "full_bytes": trainer.last_push["weight_push_full_bytes"],
                "changed_fraction": trainer.last_push.get("weight_changed_fraction"),
                "pull_transfer_seconds": [s["last_weight_transfer_seconds"] for s in st],
                "pull_load_seconds": [s["last_weight_pull_seconds"] for s in st],
                "pulls": [s["last_weight_pull"] for s in st],
                "ipc_failures": [s.get("weight_ipc_failures_total", 0) for s in st],
                "broadcast_seconds": publisher.last_broadcast_seconds,
                "broadcast_members": publisher.last_broadcast_members,
                "broadcast_failures": publisher.broadcast_failures,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pusher.shutdown()
        for r in replicas:
            r.stop()
        if source is not None:
            source.close()
    return rows, policy, version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="use this many of the shape's layers")
    ap.add_argument("--replicas", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--modes", nargs="+", default=["ipc", "full", "delta"],
                    choices=["ipc", "broadcast", "full", "delta"])  # fmt: skip
    ap.add_argument("--versions", type=int, default=3, help="new versions timed per case")
    ap.add_argument("--fractions", type=json.loads, default=None,
                    help='changed fraction per dtype, JSON: {"uint8": 0.01, ...}')  # fmt: skip
    ap.add_argument("--fractions-from", type=pathlib.Path, default=None,
                    help="a trainer's metrics.jsonl: its delta pushes' median fractions")  # fmt: skip
    ap.add_argument("--engine", default="cuda", help="the replicas' TRACE_ROLLOUT_ENGINE")
    ap.add_argument(
        "--device", default="cuda", help="the replicas' TRACE_DEVICE (cpu: a smoke run)"
    )
    ap.add_argument("--replica-device", default="",
                    help="the replicas' TRACE_DEVICE when not --device (broadcast over NCCL: "
                    "another GPU than the policy's)")  # fmt: skip
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("weight_sync_gpu.json"))
    args = ap.parse_args()
    fractions = dict(DEFAULT_FRACTIONS)
    if args.fractions_from is not None:
        fractions.update(run_fractions(args.fractions_from))
    if args.fractions:
        fractions.update(args.fractions)
    cfg = get_config(args.shape)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    print(f"{args.shape} ({cfg.num_layers} layers); changed fractions {fractions}", flush=True)
    token = secrets.token_hex(16)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="ws-bench-"))
    rows: list[dict] = []
    try:
        with local_stores(token, log_dir, keep_versions=2) as common:
            ws_addr = common["TRACE_WEIGHT_SYNC_ADDRESS"]
            policy, meta = random_policy(cfg, True, seed=0, device=args.device)
            nbytes = sum(t.numel() * t.element_size() for t in policy.values())
            version = 0
            t0 = time.perf_counter()
            WeightSyncClient(ws_addr, token).push_version(version, policy, meta)
            # On the device from here, as a trainer's model is; each version is exported
            # from it as the trainer's export does (`export`).
            policy = {k: v.to(args.device) for k, v in policy.items()}
            print(f"first push: {nbytes / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s",
                  flush=True)  # fmt: skip
            for n in args.replicas:
                for mode in args.modes:
                    got, policy, version = measure(args, mode, n, ws_addr, common, token, policy,
                                                   meta, version, fractions, log_dir)  # fmt: skip
                    rows.extend(got)
                    args.out.write_text(json.dumps({"fractions": fractions, "rows": rows},
                                                   indent=1))  # fmt: skip
    finally:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "config": cfg.to_dict(), "fractions": fractions,
                                        "rows": rows}, indent=1))  # fmt: skip
    print(f"\n{args.shape} ({cfg.num_layers} layers), {nbytes / 2**30:.2f} GiB FP4 policy")
    print(
        "| mode | replicas | export copy s | push s | exported -> all served s | pull transfer s | pull + load s | MiB pushed | MiB pulled (each) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for n in args.replicas:
            rs = [r for r in rows if r["mode"] == mode and r["replicas"] == n]
            if not rs:
                continue
            med = lambda xs: statistics.median(xs)  # noqa: E731
            print(f"| {mode} | {n} | {med([r['export_seconds'] for r in rs]):.2f} "
                  f"| {med([r['push_seconds'] for r in rs]):.2f} "
                  f"| {med([r['served_seconds'] for r in rs]):.2f} "
                  f"| {med([max(r['pull_transfer_seconds']) for r in rs]):.2f} "
                  f"| {med([max(r['pull_load_seconds']) for r in rs]):.2f} "
                  f"| {med([r['push_bytes'] for r in rs]) / 2**20:,.1f} "
                  f"| {med([max(p.get('bytes', 0) for p in r['pulls']) for r in rs]) / 2**20:,.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
