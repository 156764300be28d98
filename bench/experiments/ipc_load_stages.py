"""Where a CUDA IPC version's time goes, stage by stage, in one process on one GPU.

The trainer's side of an offer (pack into one buffer, share, the manifest) and a replica's
side (views of the mapped buffer, the CUDA engine reading the pushed layout into its own,
the whole `load_version` into the engine's buffers), each timed with the GPU synchronized,
for a random FP4 policy of the shape (bench/rollout_service_gpu.py's `random_policy`).

    python3 bench/experiments/ipc_load_stages.py --shape qwen3-30b-a3b --layers 24
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rollout_service_gpu import random_policy  # noqa: E402

from trace_common.clients import broadcast as bcast  # noqa: E402
from trace_common.clients import cuda_ipc as ipc  # noqa: E402
from trace_common.clients.tensors import from_raw  # noqa: E402
from trace_common.device import pack_on_device  # noqa: E402
from trace_common.model import get_config  # noqa: E402


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls of fn (GPU synchronized around each), and its result."""
    out, times = None, []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from trace_common.rollout.cuda import CudaEngine

    cfg = get_config(args.shape)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    host, meta = random_policy(cfg, True, seed=0)
    tensors = {k: v.to("cuda", non_blocking=True) for k, v in host.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(
        f"{args.shape}, {cfg.num_layers} layers: {len(tensors)} tensors, {nbytes / 2**30:.2f} GiB"
    )

    rows: list[tuple[str, float]] = []
    s, packed = timed(lambda: pack_on_device(tensors), args.repeats)
    rows.append(("trainer: pack into one buffer", s))
    s, _ = timed(lambda: ipc.share(packed), args.repeats)
    rows.append(("trainer: share (IPC handles)", s))
    s, specs = timed(lambda: bcast.manifest(packed, checksummed=False), args.repeats)
    rows.append(("trainer: manifest", s))
    flat = next(iter(packed.values())).untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device="cuda").set_(flat)
    offsets = [t.data_ptr() - flat.data_ptr() for t in packed.values()]

    def views() -> dict[str, torch.Tensor]:
        pairs = zip(specs, offsets, strict=True)
        return {s.name: from_raw(base[o : o + s.nbytes], s) for s, o in pairs}

    s, opened = timed(views, args.repeats)
    rows.append(("replica: views of the buffer", s))
    engine = CudaEngine(opened, {k: str(v) for k, v in meta.items()}, 1, max_batch=8,
                        max_context=512)  # fmt: skip
    reader = engine.backend._reader
    s, _ = timed(lambda: [reader.layer(opened, li) for li in range(cfg.num_layers)], args.repeats)
    rows.append(("replica: read the layers into the engine's layout", s))
    s, _ = timed(lambda: engine.backend.load(opened), args.repeats)
    rows.append(("replica: load (read + copy into the engine's buffers)", s))
    engine.close()
    width = max(len(r[0]) for r in rows)
    for name, sec in rows:
        print(f"{name:<{width}}  {sec * 1e3:9.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
