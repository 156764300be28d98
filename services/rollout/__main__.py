"""`python -m services.rollout`: one rollout replica (FP4 generation, records to quant-cache)."""

from __future__ import annotations

import threading
import time

import torch

from services.rollout.config import RolloutSettings
from services.rollout.servicer import RolloutServicer, record_writer
from services.rollout.weights import WeightFollower
from trace_common.clients import QuantCacheClient, WeightSyncClient
from trace_common.clients.broadcast import Member
from trace_common.device import resolve_device
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2_grpc
from trace_common.rl.audit import RecordAudit
from trace_common.rollout.engine import EngineHolder
from trace_common.rollout.select import EngineSettings, make_engine_factory
from trace_common.service import ServiceRuntime, load_settings


def main() -> None:
    settings = load_settings(RolloutSettings)
    torch.set_num_threads(settings.torch_threads)
    try:
        engine_settings = EngineSettings(
            engine=settings.rollout_engine, device=resolve_device(settings.device),
            max_batch=settings.rollout_max_batch, max_context=settings.rollout_max_context,
            native_dtype=settings.engine_dtype, kernels=settings.kernels(),
        )  # fmt: skip
        member = broadcast_member(settings, engine_settings.device)
    except ValueError as exc:
        raise SystemExit(f"rollout settings: {exc}") from None
    factory = make_engine_factory(engine_settings)
    rt = ServiceRuntime("rollout", settings)
    token = settings.token()
    quant_cache = QuantCacheClient(
        settings.quant_cache_address, token, data_path=settings.quant_cache_data_path
    )
    weight_sync = WeightSyncClient(
        settings.weight_sync_address,
        token,
        data_path=settings.weight_sync_data_path,
        deltas=settings.weight_deltas,
    )
    holder = EngineHolder()
    audit = RecordAudit(settings.record_audit_file) if settings.record_audit_file else None

    put_record = record_writer(quant_cache.put_records, audit.log if audit else None)
    servicer = RolloutServicer(
        settings.replica_id,
        holder,
        put_record,
        metrics=rt.metrics,
        engine_name=lambda: factory.name,
    )
    rt.grpc.add(
        rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, "trace.rollout.v1.Rollout"
    )
    follower = WeightFollower(
        weight_sync,
        holder,
        factory,
        replica_id=settings.replica_id,
        address=lambda: f"{settings.advertise_host}:{rt.grpc.port}",
        heartbeat_interval_s=settings.heartbeat_interval_seconds,
        metrics=rt.metrics,
        cuda_ipc=settings.cuda_ipc and engine_settings.device.type == "cuda",
        member=member,
    )
    servicer.follower = follower
    servicer.engine_stats = lambda: getattr(factory.engine, "stats", dict)()
    rt.before_drain.append(follower.stop)
    _start_when_bound(rt, follower)
    rt.run(ready=lambda: holder.version >= 0, status=servicer.status)


def broadcast_member(settings: RolloutSettings, device: torch.device) -> Member | None:
    """This replica's side of the trainer's broadcasts (RolloutSettings.broadcast), or None:
    auto joins NCCL broadcasts on a CUDA replica and none on the CPU. NCCL receives into
    the replica's GPU, gloo into host memory."""
    backend = settings.broadcast
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "off"
    if backend == "off":
        return None
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"TRACE_BROADCAST=nccl needs a CUDA replica; this one runs on {device}")
    return Member(settings.replica_id, device if backend == "nccl" else torch.device("cpu"))


def _start_when_bound(rt: ServiceRuntime, follower: WeightFollower) -> None:
    """Register only once the gRPC port is known (the runtime binds it inside run())."""

    def wait_then_start() -> None:
        while rt.grpc.port == 0 and not rt.stopping.is_set():
            time.sleep(0.02)
        if not rt.stopping.is_set():
            follower.start()

    threading.Thread(target=wait_then_start, name="follower-start", daemon=True).start()


if __name__ == "__main__":
    main()
