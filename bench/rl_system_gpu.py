"""The whole RL system on one GPU host, timed through its own metrics: a local Redis,
quant-cache, weight-sync, the trainer (one process, or N FSDP2 ranks under torchrun, one GPU
per rank) and rollout replicas on the CUDA engine, each its own process.

The policy starts from random weights (throughput does not need a warm start); every step is
a real RL step: generate, score, pull records, train, export FP4 and push. After `--skip`
warm-up steps the medians of the trainer's per-step metrics are reported: the step-time
split (rollout / records / train / push), trainer tokens/s and MFU, peak trainer memory
(rank 0), weight push and pull seconds, and every GPU's peak memory in use (nvidia-smi).

    python3 bench/rl_system_gpu.py --trainer-ranks 2 --replica-devices cuda:1 \\
        --out runs/rl_system_ws2.json

Prints a summary; writes every figure and the per-step rows to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from trainer_gpu import H200_BF16_DENSE_TFLOPS, git_commit, train_flops_per_token  # noqa: E402

from trace_common.launch.cluster import ClusterConfig, LocalCluster  # noqa: E402
from trace_common.launch.plots import read_metrics  # noqa: E402
from trace_common.model import get_config  # noqa: E402
from trace_common.tasks import CharTokenizer  # noqa: E402

PHASES = ("rollout", "records", "train", "push")


class GpuMemory:
    """Peak memory in use per GPU, sampled from nvidia-smi every `period_s`."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.peak_mib: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
            for line in out.splitlines():
                idx, used = (int(v) for v in line.split(","))
                self.peak_mib[idx] = max(self.peak_mib.get(idx, 0), used)
            self._stop.wait(self.period_s)

    def __enter__(self) -> GpuMemory:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def median_of(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(vals) if vals else float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, required=True, help="JSON results path")
    p.add_argument("--shape", default="mid-1b")
    p.add_argument("--mode", default="trace", help="bf16 | fp4 | rtn | trace")
    p.add_argument(
        "--trainer-ranks", type=int, default=0,
        help="0: one trainer process on --trainer-device; N: N FSDP2 ranks under torchrun "
        "(rank r on cuda:r)",
    )  # fmt: skip
    p.add_argument("--trainer-device", default="cuda")
    p.add_argument(
        "--replica-devices", default="cuda", help="comma-separated: one rollout replica per entry"
    )
    p.add_argument("--rollout-engine", default="auto")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    p.add_argument("--task", default="addition")
    p.add_argument("--difficulty", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--timeout-s", type=float, default=400.0)
    args = p.parse_args(argv)
    if args.skip >= args.steps:
        raise SystemExit(f"--skip {args.skip} must be below --steps {args.steps}")
    replica_devices = [d.strip() for d in args.replica_devices.split(",") if d.strip()]
    work = pathlib.Path(tempfile.mkdtemp(prefix="rl_system_gpu_"))
    metrics_file = work / "metrics.jsonl"
    run = {  # the trainer's recipe
        "run_id": "bench",
        "model.name": args.shape,
        "mode": args.mode,
        "steps": args.steps,
        "task": {"name": args.task, "difficulty": args.difficulty},
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "dispatch.prompts_per_unit": max(1, args.prompts_per_step // (2 * len(replica_devices))),
        "sampling.max_new_tokens": args.max_new_tokens,
        "guidance.mode": "compact",  # what the CUDA engine records
    }
    trainer_env = {"TRACE_DEVICE": args.trainer_device, "TRACE_METRICS_FILE": str(metrics_file)}
    argv_trainer = None
    if args.trainer_ranks > 0:
        argv_trainer = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.trainer_ranks}", "-m", "services.trainer",
        ]  # fmt: skip
    cfg = ClusterConfig(
        replicas=len(replica_devices),
        redis_maxmemory_bytes=4 << 30,
        run=run,
        trainer_env=trainer_env,
        rollout_env={"TRACE_ROLLOUT_ENGINE": args.rollout_engine},
        rollout_devices=replica_devices,
        trainer_argv=argv_trainer,
    )
    cluster = LocalCluster(cfg, work / "logs")
    t0 = time.perf_counter()
    with GpuMemory() as mem:
        try:
            cluster.start()
            deadline = time.monotonic() + args.timeout_s
            shown = time.monotonic()
            while (st := cluster.trainer_status())["state"] not in ("finished", "failed"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out after {args.timeout_s} s at step {st['step']}")
                if time.monotonic() - shown > 15:
                    shown = time.monotonic()
                    print(f"  {time.perf_counter() - t0:.0f} s: {st['state']}, step {st['step']}")
                time.sleep(0.5)
            engines = [replica_engine(cluster, i) for i in range(len(replica_devices))]
        except BaseException:
            for log in sorted((work / "logs").glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            cluster.stop()
    wall_s = time.perf_counter() - t0
    if st["state"] != "finished":
        raise SystemExit(f"trainer {st['state']}: {st.get('detail')}")
    rows = read_metrics(metrics_file)
    timed = rows[args.skip :]
    model_cfg = get_config(args.shape).replace(vocab_size=CharTokenizer().vocab_size)
    tps = median_of(timed, "train_tokens_per_s")
    tokens_per_seq = median_of(timed, "train_tokens") / max(
        1, args.prompts_per_step * args.group_size
    )
    gpus = max(1, args.trainer_ranks)
    mfu = (
        tps
        * train_flops_per_token(model_cfg, max(1, round(tokens_per_seq)))
        / (H200_BF16_DENSE_TFLOPS * 1e12 * gpus)
    )
    report = {
        "bench": "rl_system_gpu",
        "commit": git_commit(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "engines": engines,
        "steps": len(rows),
        "wall_s": wall_s,
        "step_time_split_s": {ph: median_of(timed, f"time_{ph}_s") for ph in PHASES},
        "train_tokens_per_s": tps,
        "mfu": mfu,
        "train_peak_memory_gib_rank0": median_of(timed, "train_peak_memory_bytes") / 2**30,
        "weight_push_seconds": median_of(timed, "weight_push_seconds"),
        "weight_pull_seconds": median_of(timed, "weight_pull_seconds"),
        "rollout_tokens_per_s": median_of(timed, "rollout_tokens_per_s"),
        "gpu_peak_memory_gib": {str(k): v / 1024 for k, v in sorted(mem.peak_mib.items())},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    split = ", ".join(f"{k} {v:.3f}" for k, v in report["step_time_split_s"].items())
    print(
        f"{args.shape} {args.mode}, trainer ranks {args.trainer_ranks}, replicas "
        f"{replica_devices} ({engines}): {len(rows)} steps in {wall_s:.0f} s\n"
        f"  step split (s, median of steps {args.skip + 1}..): {split}\n"
        f"  train {tps:.0f} tokens/s (MFU {100 * mfu:.2f}%), peak rank 0 "
        f"{report['train_peak_memory_gib_rank0']:.1f} GiB, push "
        f"{report['weight_push_seconds']:.2f} s, pull {report['weight_pull_seconds']:.2f} s\n"
        f"  GPU peak in use (GiB): {report['gpu_peak_memory_gib']}"
    )
    print(f"JSON: {args.out}")
    return report


def replica_engine(cluster: LocalCluster, i: int) -> str:
    import grpc

    from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2, rollout_pb2_grpc
    from trace_common.service.grpc_server import AUTH_HEADER

    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(cluster.rollouts[i].grpc_address))
    md = ((AUTH_HEADER, f"Bearer {cluster.config.token}"),)
    return stub.Status(rollout_pb2.RolloutStatusRequest(), metadata=md, timeout=5).engine


if __name__ == "__main__":
    main()
