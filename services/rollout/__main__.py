"""`python -m services.rollout`: one rollout replica (FP4 generation, records to quant-cache)."""

from __future__ import annotations

import functools
import threading
import time

import torch

from services.rollout.config import RolloutSettings
from services.rollout.servicer import RolloutServicer
from services.rollout.weights import WeightFollower
from trace_common.clients import QuantCacheClient, WeightSyncClient
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2_grpc
from trace_common.rl.audit import RecordAudit
from trace_common.rl.engine import EngineHolder
from trace_common.service import ServiceRuntime, load_settings

ENGINES = ("native",)


def main() -> None:
    settings = load_settings(RolloutSettings)
    if settings.engine not in ENGINES:
        raise SystemExit(f"TRACE_ENGINE={settings.engine!r} is not supported; choose {ENGINES}")
    torch.set_num_threads(settings.torch_threads)
    from trace_common.rl.policy import NativeEngine

    rt = ServiceRuntime("rollout", settings)
    token = settings.token()
    quant_cache = QuantCacheClient(
        settings.quant_cache_address, token, data_path=settings.quant_cache_data_path
    )
    weight_sync = WeightSyncClient(
        settings.weight_sync_address, token, data_path=settings.weight_sync_data_path
    )
    holder = EngineHolder()
    audit = RecordAudit(settings.record_audit_file) if settings.record_audit_file else None

    def put_record(run: str, version: int, sid: str, blob: bytes) -> None:
        quant_cache.put_records(run, version, sid, blob)
        if audit is not None:
            audit.log(run, version, sid, blob)

    servicer = RolloutServicer(
        settings.replica_id,
        holder,
        put_record,
        metrics=rt.metrics,
        engine_name=settings.engine,
    )
    rt.grpc.add(
        rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, "trace.rollout.v1.Rollout"
    )
    follower = WeightFollower(
        weight_sync,
        holder,
        functools.partial(NativeEngine.from_weights, dtype=getattr(torch, settings.engine_dtype)),
        replica_id=settings.replica_id,
        address=lambda: f"{settings.advertise_host}:{rt.grpc.port}",
        heartbeat_interval_s=settings.heartbeat_interval_seconds,
        metrics=rt.metrics,
    )
    servicer.follower = follower
    rt.before_drain.append(follower.stop)
    _start_when_bound(rt, follower)
    rt.run(ready=lambda: holder.version >= 0, status=servicer.status)


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
