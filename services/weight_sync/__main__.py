"""`python -m services.weight_sync`: the weight-sync service (versioned policy weights)."""

from __future__ import annotations

from services.weight_sync.config import WeightSyncSettings
from services.weight_sync.data_plane import DataPlane
from services.weight_sync.registry import ReplicaRegistry
from services.weight_sync.servicer import CODECS, WeightSyncServicer
from services.weight_sync.versions import VersionStore
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc
from trace_common.service import ServiceRuntime, load_settings
from trace_common.stores.ws_data_plane import server_ssl_context

STATUS_REPLICAS = 64  # replicas listed on /status at most (ListReplicas has them all)


def main() -> None:
    settings = load_settings(WeightSyncSettings)
    rt = ServiceRuntime("weight_sync", settings)
    versions = VersionStore(keep=settings.keep_versions)
    registry = ReplicaRegistry(
        settings.heartbeat_timeout_seconds,
        expire_after_s=settings.replica_expire_seconds,
        max_replicas=settings.max_replicas,
    )
    servicer = WeightSyncServicer(
        versions,
        registry,
        rt.metrics,
        max_version_bytes=settings.max_version_bytes,
        chunk_bytes=settings.chunk_bytes,
    )
    rt.grpc.add(
        weightsync_pb2_grpc.add_WeightSyncServicer_to_server,
        servicer,
        "trace.weightsync.v1.WeightSync",
        codecs=CODECS,
    )
    rt.before_drain.append(servicer.shutdown)
    if settings.data_plane_enabled:
        servicer.data_plane = DataPlane(
            settings.grpc_host,
            settings.data_plane_port,
            rt.metrics,
            servicer.count_pull,
            ticket_seconds=settings.data_plane_ticket_seconds,
            max_tickets=settings.data_plane_max_tickets,
            max_tickets_per_replica=settings.data_plane_max_tickets_per_replica,
            advertise=settings.data_plane_advertise,
            ssl_context=server_ssl_context(settings),
        )
        rt.before_drain.append(servicer.data_plane.close)

    def status() -> dict[str, object]:
        plane = servicer.data_plane
        replicas = registry.snapshot()
        return {
            "data_plane_port": None if plane is None else plane.port,
            "latest_version": versions.latest_version(),
            "versions": [
                {"version": v.version, "bytes": v.header.total_bytes} for v in versions.all()
            ],
            "replicas_total": len(replicas),
            "replicas_alive": sum(1 for _, alive, _ in replicas if alive),
            # the first STATUS_REPLICAS by id: /status stays small however many register
            "replicas": [
                {
                    "replica_id": r.replica_id,
                    "address": r.address,
                    "version_held": r.version_held,
                    "alive": alive,
                }
                for r, alive, _ in replicas[:STATUS_REPLICAS]
            ],
        }

    rt.run(status=status, private_status=("replicas",))  # their addresses: with the token only


if __name__ == "__main__":
    main()
