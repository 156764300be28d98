"""weight-sync gRPC servicer: push (assemble, verify, publish), pull, replica registry, subscribe."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable, Iterator

import grpc
from prometheus_client.core import GaugeMetricFamily

from services.weight_sync.data_plane import DataPlane
from services.weight_sync.registry import BROADCAST_BACKENDS, ReplicaRegistry
from services.weight_sync.versions import (
    Offer,
    PendingVersion,
    StoredDelta,
    StoredVersion,
    VersionStore,
    check_manifest,
    notice_rank,
)
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from trace_common.service import (
    Metrics,
    check_id,
    check_non_negative,
    failed_precondition,
    invalid,
    not_found,
)
from trace_common.wire.chunk_wire import ChunkView, chunk_codec
from trace_common.wire.tensor_wire import DTYPE_ITEMSIZE

log = logging.getLogger(__name__)

SUBSCRIBE_POLL_S = 0.5  # how often a waiting subscriber checks for cancellation/shutdown
IPC_HANDLE_MAX_BYTES = 256  # a CUDA IPC handle is 64 bytes, PyTorch's ref-counter name ~30
MAX_HOST_CHARS = 255
MAX_BROADCAST_TIMEOUT_S = 3600.0
# A tensor's padding in a broadcast buffer (trace_common.clients.broadcast.ALIGN).
BROADCAST_ALIGN = 256


def check_ipc_buffer(buffer: pb.CudaIpcBuffer, header: pb.VersionHeader) -> None:
    """An offer's buffer description (INVALID_ARGUMENT naming the field): ids, bounded
    handles, and one offset per tensor that keeps the tensor inside the buffer."""
    check_id("buffer.node_id", buffer.node_id)
    check_id("buffer.device_uuid", buffer.device_uuid)
    for name in ("memory_handle", "ref_counter_handle", "event_handle"):
        n = len(getattr(buffer, name))
        if n > IPC_HANDLE_MAX_BYTES or (n == 0 and name != "event_handle"):
            raise invalid(f"buffer.{name} is {n} bytes: expected 1 to {IPC_HANDLE_MAX_BYTES}")
    if len(buffer.tensor_offsets) != len(header.tensors):
        raise invalid(
            f"buffer.tensor_offsets has {len(buffer.tensor_offsets)} entries for "
            f"{len(header.tensors)} tensors"
        )
    for spec, off in zip(header.tensors, buffer.tensor_offsets, strict=True):
        if off + spec.nbytes > buffer.buffer_bytes:
            raise invalid(
                f"tensor {spec.name!r} at buffer offset {off} ({spec.nbytes} bytes) ends past "
                f"buffer.buffer_bytes={buffer.buffer_bytes}"
            )


def check_broadcast(group: pb.BroadcastGroup, header: pb.VersionHeader) -> None:
    """An offer's broadcast request (INVALID_ARGUMENT naming the field): a known backend, a
    reachable store, a bounded timeout, and one aligned offset per tensor that keeps the
    tensor inside the buffer. weight-sync names the group and its members, not the trainer."""
    if group.backend not in BROADCAST_BACKENDS:
        raise invalid(
            f"broadcast.backend={group.backend[:32]!r}: expected one of {BROADCAST_BACKENDS}"
        )
    if not 0 < len(group.store_host) <= MAX_HOST_CHARS:
        raise invalid(
            f"broadcast.store_host is {len(group.store_host)} characters: expected 1 to "
            f"{MAX_HOST_CHARS}"
        )
    if not 0 < group.store_port <= 65535:
        raise invalid(f"broadcast.store_port={group.store_port}: expected 1 to 65535")
    if not 0 < group.timeout_seconds <= MAX_BROADCAST_TIMEOUT_S:
        raise invalid(
            f"broadcast.timeout_seconds={group.timeout_seconds}: expected > 0 and <= "
            f"{MAX_BROADCAST_TIMEOUT_S}"
        )
    if group.group_id or group.members:
        raise invalid("broadcast.group_id and broadcast.members are weight-sync's to set")
    if group.source_node_id:
        check_id("broadcast.source_node_id", group.source_node_id)
    if group.source_device_uuid:
        check_id("broadcast.source_device_uuid", group.source_device_uuid)
    if len(group.tensor_offsets) != len(header.tensors):
        raise invalid(
            f"broadcast.tensor_offsets has {len(group.tensor_offsets)} entries for "
            f"{len(header.tensors)} tensors"
        )
    most = header.total_bytes + BROADCAST_ALIGN * (len(header.tensors) + 1)
    if group.buffer_bytes > most:
        raise invalid(
            f"broadcast.buffer_bytes={group.buffer_bytes} is over {most}: the manifest's "
            f"{header.total_bytes} bytes, each tensor padded to {BROADCAST_ALIGN}"
        )
    for spec, off in zip(header.tensors, group.tensor_offsets, strict=True):
        if off % DTYPE_ITEMSIZE[spec.dtype] or off + spec.nbytes > group.buffer_bytes:
            raise invalid(
                f"tensor {spec.name!r} at broadcast offset {off} ({spec.nbytes} bytes of "
                f"{spec.dtype}) is unaligned or ends past broadcast.buffer_bytes="
                f"{group.buffer_bytes}"
            )


class _ReplicaCollector:
    """Per-replica version lag and the number of live replicas, computed at scrape time."""

    def __init__(self, metrics: Metrics, registry: ReplicaRegistry, versions: VersionStore) -> None:
        self._name = metrics.name
        self._registry = registry
        self._versions = versions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        latest = self._versions.latest_version()
        snapshot = self._registry.snapshot()
        alive = GaugeMetricFamily(
            self._name("replicas_alive"), "replicas whose last heartbeat is within the timeout"
        )
        alive.add_metric([], sum(1 for _, ok, _ in snapshot if ok))
        lag = GaugeMetricFamily(
            self._name("replica_version_lag"),
            "latest version minus the version a replica holds",
            labels=["replica_id"],
        )
        for replica, _, _ in snapshot:
            lag.add_metric([replica.replica_id], max(0, latest - replica.version_held))
        latest_g = GaugeMetricFamily(
            self._name("latest_version"), "latest complete version (-1 = none)"
        )
        latest_g.add_metric([], latest)
        yield from (alive, lag, latest_g)


PUSH_DESERIALIZE, _ = chunk_codec(pb.PushChunk)
_, PULL_SERIALIZE = chunk_codec(pb.PullChunk)
# PushVersion chunks arrive as ChunkViews (no protobuf copies) and PullVersion sends the
# stored wire bytes as they are (no serialization per pull): GrpcServer.add(codecs=CODECS).
CODECS = {
    "PushVersion": {"request_deserializer": PUSH_DESERIALIZE},
    "PullVersion": {"response_serializer": PULL_SERIALIZE},
}


class WeightSyncServicer(pb_grpc.WeightSyncServicer):
    """Implements trace.weightsync.v1.WeightSync. `data_plane` (set by main when enabled)
    serves the pulls GetPullTicket hands out; without it GetPullTicket is FAILED_PRECONDITION."""

    data_plane: DataPlane | None = None

    def __init__(
        self,
        versions: VersionStore,
        registry: ReplicaRegistry,
        metrics: Metrics,
        *,
        max_version_bytes: int,
        chunk_bytes: int,
    ) -> None:
        self.versions = versions
        self.registry = registry
        self.max_version_bytes = max_version_bytes
        self.chunk_bytes = chunk_bytes
        self._stopping = threading.Event()
        m = metrics
        self.published = m.counter("versions_published", "versions published")
        self.push_failed = m.counter("pushes_failed", "pushes rejected or abandoned before publish")
        self.push_bytes = m.counter("push_bytes", "bytes received in published pushes")
        self.pull_bytes = m.counter("pull_bytes", "bytes sent to pullers", ("replica_id",))
        self.offers = m.counter(
            "offers", "versions offered before their push, by transport", ("transport",)
        )
        self.broadcast_groups = m.counter("broadcast_groups", "broadcast groups formed")
        self._group_lock = threading.Lock()
        self._group_key: tuple = ()
        self._group_id = ""
        self.pushes = m.counter("pushes", "versions published, by what the push sent", ("kind",))
        self.pulls = m.counter("pulls", "complete pulls, by what they sent", ("kind",))
        self.push_seconds = m.histogram("push_seconds", "time from push start to publish")
        self.pull_seconds = m.histogram("pull_seconds", "time to stream one version")
        m.registry.register(_ReplicaCollector(metrics, registry, versions))

    def shutdown(self) -> None:
        """End subscriber streams (called before the server drains)."""
        self._stopping.set()
        self.versions.close()

    # -- push / pull ------------------------------------------------------------------------
    def PushVersion(
        self, request_iterator: Iterable[pb.PushChunk], context: grpc.ServicerContext
    ) -> pb.PushVersionResponse:
        start = time.perf_counter()
        messages = iter(request_iterator)
        first = next(messages, None)
        if first is None or isinstance(first, ChunkView) or first.WhichOneof("kind") != "header":
            self.push_failed.inc()
            raise invalid("the first PushVersion message must be a header (manifest)")
        header = first.header
        base = self._push_base(header)
        # Validates the manifest (and a delta's entries against its base).
        pending = PendingVersion(header, self.max_version_bytes, base, self.chunk_bytes)
        self.versions.begin_push(header.version)
        try:
            for msg in messages:
                if isinstance(msg, ChunkView):
                    pending.add(msg, self.chunk_bytes)
                elif msg.WhichOneof("kind") != "chunk":
                    raise invalid("a second header in one PushVersion stream")
                else:
                    pending.add(msg.chunk, self.chunk_bytes)
            stored = pending.finish()
            dropped = self.versions.publish(stored)
        except BaseException:
            self.versions.abort_push(header.version)
            self.push_failed.inc()
            raise
        self.published.inc()
        self.push_bytes.inc(pending.wire_bytes)
        self.pushes.labels("delta" if pending.is_delta else "full").inc()
        self.push_seconds.observe(time.perf_counter() - start)
        log.info(
            "published version",
            extra={
                "version": header.version,
                "bytes": header.total_bytes,
                "wire_bytes": pending.wire_bytes,
                "base_version": header.base_version if pending.is_delta else None,
                "tensors": len(header.tensors),
                "dropped": dropped,
            },
        )
        return pb.PushVersionResponse(published=stored.info(), dropped_versions=dropped)

    def OfferVersion(
        self, request: pb.OfferVersionRequest, context: grpc.ServicerContext
    ) -> pb.OfferVersionResponse:
        header = request.header
        check_manifest(header, self.max_version_bytes)
        if header.HasField("base_version") or header.deltas:
            raise invalid("an offer describes a whole version: base_version/deltas must be unset")
        has_ipc, has_broadcast = request.HasField("buffer"), request.HasField("broadcast")
        if not (has_ipc or has_broadcast):
            raise invalid("an offer needs a CUDA IPC buffer, a broadcast, or both")
        if has_ipc:
            check_ipc_buffer(request.buffer, header)
        if has_broadcast:
            check_broadcast(request.broadcast, header)  # before anything is held
        offer = Offer(header, request.buffer if has_ipc else None)
        if has_broadcast:
            offer.broadcast = self._broadcast_group(request)
        if offer.buffer is None and offer.broadcast is None:
            return pb.OfferVersionResponse()  # nobody to receive it: the push serves all
        self.versions.offer(offer)
        for transport, used in (("cuda_ipc", offer.buffer), ("broadcast", offer.broadcast)):
            if used is not None:
                self.offers.labels(transport).inc()
        log.info(
            "version offered",
            extra={"version": header.version, "bytes": header.total_bytes,
                   "ipc_node_id": offer.ipc_node,
                   "broadcast_group": offer.broadcast and offer.broadcast.group_id,
                   "broadcast_members": offer.broadcast and list(offer.broadcast.members)},
        )  # fmt: skip
        return pb.OfferVersionResponse(broadcast=offer.broadcast)

    def _broadcast_group(self, request: pb.OfferVersionRequest) -> pb.BroadcastGroup | None:
        """The group for this offer's broadcast: the live replicas of its backend (for NCCL,
        less those on the trainer's own GPU: they load over CUDA IPC). The same group_id as
        the last offer while store and members are unchanged and the trainer does not ask
        for a new one; None when no replica can join."""
        want = request.broadcast
        exclude = ("", "")
        if want.backend == "nccl":
            exclude = (want.source_node_id, want.source_device_uuid)
        members = self.registry.broadcast_members(want.backend, exclude)
        if not members:
            return None
        key = (want.store_host, want.store_port, want.backend, tuple(members))
        with self._group_lock:
            if request.new_group or key != self._group_key:
                self._group_key, self._group_id = key, secrets.token_hex(8)
                self.broadcast_groups.inc()
            group = pb.BroadcastGroup()
            group.CopyFrom(want)
            group.group_id = self._group_id
            group.members[:] = members
        return group

    def GetOffer(
        self, request: pb.GetOfferRequest, context: grpc.ServicerContext
    ) -> pb.GetOfferResponse:
        check_id("replica_id", request.replica_id)
        check_non_negative("version", request.version)
        offer = self.versions.offer_for(request.version)
        if offer is None:
            raise not_found(f"version {request.version} has no offer (CUDA IPC or broadcast)")
        return pb.GetOfferResponse(
            header=offer.header, buffer=offer.buffer, broadcast=offer.broadcast
        )

    def _push_base(self, header: pb.VersionHeader) -> StoredVersion | None:
        """The stored base of a delta push (None for a full push); FAILED_PRECONDITION when
        it is not kept (the pusher then sends the full version)."""
        if not header.HasField("base_version"):
            return None
        base_version = header.base_version
        if not 0 <= base_version < header.version:
            raise invalid(
                f"base_version={base_version} must be >= 0 and older than version={header.version}"
            )
        base = self.versions.find(base_version)
        if base is None:
            kept = [v.version for v in self.versions.all()]
            raise failed_precondition(
                f"base_version={base_version} is not held (kept: {kept}): push the full version"
            )
        return base

    def _pulled(
        self, request: pb.PullVersionRequest | pb.PullTicketRequest
    ) -> StoredVersion | StoredDelta:
        """What a pull asks for (INVALID_ARGUMENT, NOT_FOUND): the version, or its delta
        against `base_version` when that is kept and the delta is worth sending. Every pull
        names its replica (pull_bytes and the data plane's tickets are counted per replica)."""
        check_id("replica_id", request.replica_id)
        version = request.version if request.HasField("version") else None
        if version is not None and version < 0:
            raise invalid(f"version={version} must be >= 0 (leave it unset for the latest)")
        base_version = request.base_version if request.HasField("base_version") else None
        if base_version is not None and base_version < 0:
            raise invalid(f"base_version={base_version} must be >= 0 (leave it unset: a full pull)")
        stored = self.versions.get(version)  # NOT_FOUND if unknown or none yet
        if base_version is None or base_version >= stored.version:
            return stored
        base = self.versions.find(base_version)
        sent = None if base is None else stored.delta_against(base, self.chunk_bytes)
        return stored if sent is None else sent

    def count_pull(
        self, replica_id: str, sent: StoredVersion | StoredDelta, seconds: float
    ) -> None:
        """One complete pull, on either path."""
        self.pull_bytes.labels(replica_id).inc(sent.wire_bytes)
        self.pulls.labels("delta" if isinstance(sent, StoredDelta) else "full").inc()
        self.pull_seconds.observe(seconds)

    def PullVersion(
        self, request: pb.PullVersionRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PullChunk | bytes]:
        sent = self._pulled(request)
        start = time.perf_counter()
        yield pb.PullChunk(header=sent.header)
        yield from sent.chunks
        self.count_pull(request.replica_id, sent, time.perf_counter() - start)

    def GetPullTicket(
        self, request: pb.PullTicketRequest, context: grpc.ServicerContext
    ) -> pb.PullTicketResponse:
        stored = self._pulled(request)
        plane = self.data_plane
        if plane is None:
            raise failed_precondition(
                "the data plane is off (TRACE_DATA_PLANE_ENABLED=false): pull with PullVersion"
            )
        return pb.PullTicketResponse(
            data_host=plane.advertise_host,
            data_port=plane.advertise_port,
            ticket=plane.issue(stored, request.replica_id),
            expires_in_seconds=plane.ticket_seconds,
            header=stored.header,
        )

    # -- replicas ---------------------------------------------------------------------------
    def Register(
        self, request: pb.RegisterRequest, context: grpc.ServicerContext
    ) -> pb.RegisterResponse:
        self.registry.register(
            request.replica_id, request.address,
            broadcast_backend=request.broadcast_backend, node_id=request.node_id,
            device_uuid=request.device_uuid,
        )  # fmt: skip
        log.info(
            "replica registered",
            extra={"replica_id": request.replica_id, "address": request.address,
                   "broadcast_backend": request.broadcast_backend},
        )  # fmt: skip
        return pb.RegisterResponse(
            latest_version=self.versions.latest_version(),
            heartbeat_timeout_seconds=self.registry.heartbeat_timeout_s,
        )

    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        self.registry.heartbeat(request.replica_id, request.version_held)
        return pb.HeartbeatResponse(latest_version=self.versions.latest_version())

    def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.PolicyVersionInfo]:
        self.registry.require(request.replica_id)  # FAILED_PRECONDITION if not registered
        sent = -1
        while not self._stopping.is_set() and context.is_active():
            notice = self.versions.wait_notice(sent, SUBSCRIBE_POLL_S)
            if notice is not None:
                sent = notice_rank(notice)
                yield notice

    def ListReplicas(
        self, request: pb.ListReplicasRequest, context: grpc.ServicerContext
    ) -> pb.ListReplicasResponse:
        latest = self.versions.latest_version()
        replicas = [
            pb.ReplicaInfo(
                replica_id=r.replica_id,
                address=r.address,
                version_held=r.version_held,
                alive=alive,
                seconds_since_heartbeat=age,
                version_lag=max(0, latest - r.version_held),
            )
            for r, alive, age in self.registry.snapshot()
        ]
        return pb.ListReplicasResponse(replicas=replicas, latest_version=latest)

    def ListVersions(
        self, request: pb.ListVersionsRequest, context: grpc.ServicerContext
    ) -> pb.ListVersionsResponse:
        return pb.ListVersionsResponse(versions=[v.info() for v in self.versions.all()])
