"""WeightSyncClient: push and pull policy versions, replica registration and notifications.

Trainer:
    ws = WeightSyncClient("localhost:50052", token)
    ws.push_version(7, {"w": packed_uint8, "w_scale": scale_e4m3, ...}, {"format": "nvfp4"})
Replica:
    ws.register("rollout-0", "10.0.0.5:50053")
    for notice in ws.subscribe("rollout-0"):          # latest at once, then each new one
        version, tensors, meta = ws.pull_version(notice.version, replica_id="rollout-0")
        ws.heartbeat("rollout-0", version)

Pulls take one of two data paths (trace_common.clients.data_path), the same tensors and
the same CRC-32 checks either way:
- direct (the bulk data plane, trace_common/stores/ws_data_plane.py): GetPullTicket gives the
  manifest, a single-use ticket and the data-plane address; the tensor bytes then arrive
  over a plain TCP (or TLS) connection straight into each tensor's buffer (recv_into).
- grpc: the PullVersion stream (header, then chunks).
`data_path="auto"` (the default) takes the direct path when the service offers it and it
connects, else gRPC from then on (logged); "direct" raises DirectPathError instead. When
weight-sync has no ticket to give (RESOURCE_EXHAUSTED), "auto" makes that one pull over gRPC.

A weight-sync that restarted has forgotten its replicas: the client remembers the address
each replica registered with, and a heartbeat or subscribe that weight-sync answers with
"not registered" registers again and retries once, so a replica rejoins by itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import torch

from trace_common.clients import broadcast, cuda_ipc
from trace_common.clients.data_path import DataPath, DirectPathError, check_data_path, offered
from trace_common.clients.tensors import BytesAssembler
from trace_common.clients.weight_deltas import (
    DeltaBase,
    assemblers,
    encode_version,
    push_stats,
    rebuild,
)
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from trace_common.service.errors import is_not_registered
from trace_common.service.grpc_client import ClientTLS, GrpcClient
from trace_common.stores import ws_data_plane as wire
from trace_common.wire.chunk_wire import ChunkView, chunk_codec, encode_chunk
from trace_common.wire.weight_delta import DeltaError

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB per PushVersion message
TRANSFER_TIMEOUT_S = 600.0  # push/pull deadline: a whole model may be tens of GB
DATA_CONNECT_TIMEOUT_S = 5.0  # "auto" falls back to gRPC after this long without a connection


class WeightSyncClient(GrpcClient):
    SERVICE = "trace.weightsync.v1.WeightSync"
    # A push is not retried automatically (a retried stream could race its own publish).
    IDEMPOTENT = (
        "PullVersion",
        "Register",
        "Heartbeat",
        "Subscribe",
        "ListReplicas",
        "ListVersions",
        "GetPullTicket",
        "OfferVersion",
        "GetOffer",
    )

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        transfer_timeout: float = TRANSFER_TIMEOUT_S,
        data_path: DataPath = "auto",
        tls: ClientTLS | None = None,
        deltas: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(address, token, tls=tls, **kwargs)
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.transfer_timeout = transfer_timeout
        self.data_path = check_data_path(data_path)
        # The data plane speaks TLS exactly when gRPC does, with the same trust.
        self._ssl = None if tls is None else tls.ssl_context()
        self._direct_off = data_path == "grpc"  # auto: set when the plane is not usable
        # With `deltas`, the last version pulled (or pushed) whole: pulls ask for a delta
        # against it and pushes send one (module docstring).
        self.deltas = deltas
        self.base: DeltaBase | None = None
        self.last_push: dict[str, Any] = {}  # weight_deltas.push_stats of the last push
        self.last_pull: dict[str, Any] = {}  # the last pull: "kind" (full/delta), "bytes" sent
        self._stub = pb_grpc.WeightSyncStub(self.channel)
        self._registered: dict[str, pb.RegisterRequest] = {}  # to register again
        self._register_lock = threading.Lock()
        # The two bulk RPCs with chunk_wire's codecs: chunks are written and read without
        # protobuf's copies of their data (same bytes on the wire as the generated stub).
        _, push_serialize = chunk_codec(pb.PushChunk)
        pull_deserialize, _ = chunk_codec(pb.PullChunk)
        self._push = self.channel.stream_unary(
            f"/{self.SERVICE}/PushVersion",
            request_serializer=push_serialize,
            response_deserializer=pb.PushVersionResponse.FromString,
        )
        self._pull = self.channel.unary_stream(
            f"/{self.SERVICE}/PullVersion",
            request_serializer=pb.PullVersionRequest.SerializeToString,
            response_deserializer=pull_deserialize,
        )

    # -- trainer side -----------------------------------------------------------------------
    def push_version(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Any] | None = None,
    ) -> common_pb2.PolicyVersionInfo:
        """Push every tensor (any dtype, raw bytes + CRC-32); returns once published.

        With `deltas`, a push after an earlier one of this client sends only what changed
        against it; where weight-sync no longer holds that version (FAILED_PRECONDITION), or
        refuses the delta, the full version follows at once."""
        if not tensors:
            raise ValueError("tensors is empty")
        meta = json.dumps(dict(metadata or {}), sort_keys=True)
        base = (
            self.base
            if self.deltas and self.base is not None and self.base.version < version
            else None
        )
        header, payloads, pushed = encode_version(version, tensors, meta, base, keep=self.deltas)
        try:
            published = self._push_stream(header, payloads)
        except grpc.RpcError as err:
            if base is None or err.code() not in (
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS
            ):  # fmt: skip
                raise
            log.warning(
                "weight-sync refused version %d as a delta against %d (%s): pushing it whole",
                version, base.version, err.details(),
            )  # fmt: skip
            self.base = None
            header, payloads, pushed = encode_version(
                version, tensors, meta, None, keep=self.deltas
            )
            published = self._push_stream(header, payloads)
        if self.deltas:
            self.base = pushed
        self.last_push = push_stats(header)
        return published

    def _push_stream(
        self, header: pb.VersionHeader, payloads: list[Any]
    ) -> common_pb2.PolicyVersionInfo:
        step = self.chunk_bytes

        def messages() -> Iterator[pb.PushChunk | bytes]:
            yield pb.PushChunk(header=header)
            for index, data in enumerate(payloads):
                view = memoryview(data).cast("B")
                for offset in range(0, len(view), step):
                    yield encode_chunk(index, offset, view[offset : offset + step])

        response = self._push(messages(), metadata=self.metadata, timeout=self.transfer_timeout)
        return response.published

    def offer_version(
        self,
        version: int,
        shared: cuda_ipc.Shared | None,
        specs: list[common_pb2.TensorSpec],
        metadata: Mapping[str, Any] | None = None,
        *,
        broadcast: pb.BroadcastGroup | None = None,
        new_group: bool = False,
    ) -> pb.BroadcastGroup | None:
        """Offer `version` before its push: over CUDA IPC (`shared`: cuda_ipc.share of its
        packed tensors) and/or in a broadcast (`broadcast`: broadcast.Source.endpoint);
        `specs` is the manifest. Replicas on this node may load it over IPC at once; the
        caller keeps `shared` alive while the offer should be usable. Returns the broadcast
        group weight-sync formed (send the version to it), or None when nobody joins one."""
        header = pb.VersionHeader(
            version=version,
            metadata_json=json.dumps(dict(metadata or {}), sort_keys=True),
            tensors=specs,
            total_bytes=sum(s.nbytes for s in specs),
        )
        request = pb.OfferVersionRequest(header=header, new_group=new_group)
        if shared is not None:
            request.buffer.CopyFrom(shared.buffer)
        if broadcast is not None:
            request.broadcast.CopyFrom(broadcast)
        reply = self._stub.OfferVersion(request, metadata=self.metadata, timeout=self.timeout)
        return reply.broadcast if reply.HasField("broadcast") else None

    # -- replica side -----------------------------------------------------------------------
    def open_offer(
        self, version: int, *, replica_id: str
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """(version, tensors, metadata) of `version`'s CUDA IPC offer: the tensors are views
        of the trainer's GPU buffer, mapped into this process (cuda_ipc.open_shared); copy
        them before dropping them. NOT_FOUND (grpc.RpcError) when there is no offer,
        cuda_ipc.IpcError when this process cannot open it."""
        reply = self.get_offer(version, replica_id=replica_id)
        if not reply.HasField("buffer"):
            raise cuda_ipc.IpcError(f"version {version}'s offer has no CUDA IPC buffer")
        tensors = cuda_ipc.open_shared(reply.buffer, list(reply.header.tensors))
        self.last_pull = {"kind": "cuda_ipc", "bytes": 0, "full_bytes": reply.header.total_bytes}
        return reply.header.version, tensors, json.loads(reply.header.metadata_json or "{}")

    def get_offer(self, version: int, *, replica_id: str) -> pb.GetOfferResponse:
        """`version`'s offer (NOT_FOUND, as grpc.RpcError, when there is none)."""
        return self._stub.GetOffer(
            pb.GetOfferRequest(version=version, replica_id=replica_id),
            metadata=self.metadata,
            timeout=self.timeout,
        )

    def receive_broadcast(
        self, version: int, member: broadcast.Member, *, replica_id: str
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """(version, tensors, metadata) of `version`, received in the broadcast group its
        offer names (broadcast.Member.receive): whole, in new buffers on the member's device.
        broadcast.BroadcastError when there is no such group or the transfer fails."""
        reply = self.get_offer(version, replica_id=replica_id)
        if not reply.HasField("broadcast"):
            raise broadcast.BroadcastError(f"version {version}'s offer has no broadcast group")
        tensors = member.receive(reply.broadcast, list(reply.header.tensors))
        nbytes = reply.broadcast.buffer_bytes
        self.last_pull = {
            "kind": "broadcast",
            "bytes": nbytes,
            "full_bytes": reply.header.total_bytes,
        }
        return reply.header.version, tensors, json.loads(reply.header.metadata_json or "{}")

    def pull_version(
        self, version: int | None = None, *, replica_id: str
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """(version, tensors, metadata) of `version`, or of the latest complete one if None,
        over the data path in use (module docstring). `replica_id` names the puller (a
        replica, or e.g. "trainer" checking what it pushed): weight-sync counts pulls by it.

        Every tensor is checked against its CRC-32 (ValueError on a mismatch); a transfer
        that ends early raises (DATA_LOSS on the direct path). With `deltas` the pull asks for
        a delta against the version last pulled; one that does not rebuild (a base that is
        not weight-sync's, a corrupted payload) is refused by its CRC-32s and the version is
        pulled whole."""
        base = self.base if self.deltas else None
        if base is not None and version is not None and version <= base.version:
            base = None
        try:
            got = self._pull_once(version, replica_id, base)
        except DeltaError as exc:
            log.warning("weight-sync: a delta did not rebuild (%s): pulling the version whole", exc)
            self.base = None
            got = self._pull_once(version, replica_id, None)
        return got

    def _pull_once(
        self, version: int | None, replica_id: str, base: DeltaBase | None
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        pulled = None
        if not self._direct_off:
            pulled = self._pull_direct(version, replica_id, base)
        if pulled is None:
            pulled = self._pull_grpc(version, replica_id, base)
        header, tensors = pulled
        is_delta = header.HasField("base_version")
        self.last_pull = {
            "kind": "delta" if is_delta else "full",
            "bytes": header.delta_bytes if is_delta else header.total_bytes,
            "full_bytes": header.total_bytes,
        }
        if self.deltas:
            self.base = DeltaBase.shared(header.version, tensors, list(header.tensors))
        return header.version, tensors, json.loads(header.metadata_json or "{}")

    @property
    def path(self) -> str:
        """The path the next pull tries first: "direct" or "grpc"."""
        return "grpc" if self._direct_off else "direct"

    def _pull_direct(
        self, version: int | None, replica_id: str, base: DeltaBase | None
    ) -> tuple[pb.VersionHeader, dict[str, torch.Tensor]] | None:
        """A pull over the data plane; None when "auto" should use gRPC instead."""
        strict = self.data_path == "direct"
        request = pb.PullTicketRequest(replica_id=replica_id)
        if version is not None:
            request.version = version
        if base is not None:
            request.base_version = base.version
        try:
            ticket = offered(
                lambda: self._stub.GetPullTicket(
                    request, metadata=self.metadata, timeout=self.timeout
                ),
                strict,
                "weight-sync",
            )
        except grpc.RpcError as err:
            # The data plane's tickets are used up (by others, or a flood): this pull only
            # goes over gRPC; the next one asks for a ticket again.
            if strict or err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            log.warning(
                "weight-sync: this pull over gRPC (no data-plane ticket: %s)", err.details()
            )
            return None
        if ticket is None:
            self._direct_off = True
            return None
        host = ticket.data_host or self.address.rsplit(":", 1)[0].strip("[]")
        where = f"{host}:{ticket.data_port}"
        try:
            sock = socket.create_connection((host, ticket.data_port), DATA_CONNECT_TIMEOUT_S)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=host)
        except OSError as exc:  # ssl.SSLError included
            if strict:
                raise DirectPathError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"data_path='direct' but the weight-sync data plane at {where} is unreachable: {exc}",
                ) from exc
            log.warning(
                "weight-sync: gRPC data path (data plane at %s unreachable: %s)", where, exc
            )
            self._direct_off = True
            return None
        with sock:
            sock.settimeout(self.timeout)  # per send/recv: a stalled transfer ends
            tensors = receive_version(sock, ticket.ticket, ticket.header, where, base)
        return ticket.header, tensors

    def _pull_grpc(
        self, version: int | None, replica_id: str, base: DeltaBase | None
    ) -> tuple[pb.VersionHeader, dict[str, torch.Tensor]]:
        request = pb.PullVersionRequest(replica_id=replica_id)
        if version is not None:
            request.version = version
        if base is not None:
            request.base_version = base.version
        stream = self._pull(request, metadata=self.metadata, timeout=self.transfer_timeout)
        header: pb.VersionHeader | None = None
        parts: list[BytesAssembler] = []
        for msg in stream:
            if isinstance(msg, ChunkView):
                if header is None:
                    raise ValueError("PullVersion stream sent data before its header")
                if msg.tensor_index >= len(parts):
                    raise ValueError(
                        f"PullVersion chunk for tensor {msg.tensor_index} of {len(parts)}"
                    )
                parts[msg.tensor_index].add(msg.offset, msg.data)
            elif msg.WhichOneof("kind") == "header":
                header = msg.header
                parts = assemblers(header)
            else:
                raise ValueError(
                    "PullVersion stream sent a message that is neither header nor chunk"
                )
        if header is None:
            raise ValueError("PullVersion stream ended without a header")
        return header, rebuild(header, parts, base)

    def register(
        self,
        replica_id: str,
        address: str,
        *,
        broadcast_backend: str = "",
        node_id: str = "",
        device_uuid: str = "",
    ) -> pb.RegisterResponse:
        """Register (or re-register) a replica, with the broadcasts it joins, its node and its
        GPU; what it said is remembered so that a heartbeat or subscribe weight-sync does not
        recognize registers it again."""
        request = pb.RegisterRequest(
            replica_id=replica_id, address=address, broadcast_backend=broadcast_backend,
            node_id=node_id, device_uuid=device_uuid,
        )  # fmt: skip
        response = self._stub.Register(request, metadata=self.metadata, timeout=self.timeout)
        with self._register_lock:
            self._registered[replica_id] = request
        return response

    def _register_again(self, replica_id: str, err: grpc.RpcError) -> bool:
        """Register `replica_id` again if weight-sync forgot it (`err` says "not registered")
        and this client registered it before; True if it did."""
        with self._register_lock:
            request = self._registered.get(replica_id)
        if request is None or not is_not_registered(err):
            return False
        log.warning(
            "weight-sync does not know replica %s (restarted or expired): registering again",
            replica_id,
        )
        self.register(
            replica_id, request.address, broadcast_backend=request.broadcast_backend,
            node_id=request.node_id, device_uuid=request.device_uuid,
        )  # fmt: skip
        return True

    def heartbeat(self, replica_id: str, version_held: int) -> int:
        """Report the version held; returns the latest published version (-1 = none)."""
        request = pb.HeartbeatRequest(replica_id=replica_id, version_held=version_held)
        try:
            reply = self._stub.Heartbeat(request, metadata=self.metadata, timeout=self.timeout)
        except grpc.RpcError as err:
            if not self._register_again(replica_id, err):
                raise
            reply = self._stub.Heartbeat(request, metadata=self.metadata, timeout=self.timeout)
        return reply.latest_version

    def subscribe(self, replica_id: str) -> Subscription:
        """Iterator of version notices (the latest at once, then each new one); call
        `.cancel()` on it to stop. No deadline: it lives as long as the replica."""
        return Subscription(self, replica_id)

    def _subscribe_once(self, replica_id: str) -> Any:
        return self._stub.Subscribe(
            pb.SubscribeRequest(replica_id=replica_id), metadata=self.metadata
        )

    def replicas(self) -> list[pb.ReplicaInfo]:
        return list(
            self._stub.ListReplicas(
                pb.ListReplicasRequest(), metadata=self.metadata, timeout=self.timeout
            ).replicas
        )

    def versions(self) -> list[common_pb2.PolicyVersionInfo]:
        return list(
            self._stub.ListVersions(
                pb.ListVersionsRequest(), metadata=self.metadata, timeout=self.timeout
            ).versions
        )

    def start_heartbeats(
        self, replica_id: str, version_held: Callable[[], int], interval_s: float
    ) -> threading.Event:
        """Heartbeat every `interval_s` on a daemon thread until the returned event is set."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                # The service may be restarting: the next beat retries.
                with contextlib.suppress(grpc.RpcError):
                    self.heartbeat(replica_id, version_held())
                stop.wait(interval_s)

        threading.Thread(target=loop, name=f"heartbeat-{replica_id}", daemon=True).start()
        return stop


class Subscription:
    """A Subscribe stream that registers again and resubscribes once when weight-sync
    answers "not registered" (it restarted); any other end of the stream is raised."""

    def __init__(self, client: WeightSyncClient, replica_id: str) -> None:
        self._client = client
        self._replica_id = replica_id
        self._lock = threading.Lock()
        self._cancelled = False
        self._call = client._subscribe_once(replica_id)

    def __iter__(self) -> Iterator[common_pb2.PolicyVersionInfo]:
        retried = False
        while True:
            try:
                yield from self._call
                return
            except grpc.RpcError as err:
                if retried or self._cancelled:
                    raise
                if not self._client._register_again(self._replica_id, err):
                    raise
                retried = True
            with self._lock:
                if self._cancelled:
                    return
                self._call = self._client._subscribe_once(self._replica_id)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            self._call.cancel()


def receive_version(
    sock: socket.socket,
    ticket: bytes,
    header: pb.VersionHeader,
    where: str,
    base: DeltaBase | None = None,
) -> dict[str, torch.Tensor]:
    """Present `ticket` on a connected data-plane socket and receive the version `header`
    describes, each tensor (or its delta payload, rebuilt from `base`) straight into its
    buffer, CRC-32 checked (ValueError, as on the gRPC path; DeltaError for a delta). A refusal raises DirectPathError with the reply's code and reason; a
    connection that breaks or ends early, DirectPathError(DATA_LOSS / UNAVAILABLE)."""
    parts = assemblers(header)
    expected = header.delta_bytes if header.HasField("base_version") else header.total_bytes
    try:
        sock.sendall(wire.encode_request(ticket))
        head = wire.recv_exact(sock, wire.REPLY_BYTES)
        if len(head) < wire.REPLY_BYTES:
            raise DirectPathError(
                grpc.StatusCode.UNAVAILABLE,
                f"weight-sync data plane at {where} closed the connection before replying",
            )
        try:
            status, length = wire.decode_reply(head)
        except ValueError as exc:
            raise DirectPathError(
                grpc.StatusCode.DATA_LOSS, f"weight-sync data plane at {where}: {exc}"
            ) from exc
        if status != wire.Status.OK:
            reason = wire.recv_exact(sock, min(length, wire.MAX_REASON_BYTES))
            raise DirectPathError(
                status.grpc_code,
                f"weight-sync data plane at {where} refused the pull: {reason.decode(errors='replace')}",
            )
        if length != expected:
            raise DirectPathError(
                grpc.StatusCode.DATA_LOSS,
                f"weight-sync data plane at {where} sends {length} bytes for version "
                f"{header.version}, whose manifest says {expected}",
            )
        for part in parts:
            part.fill(sock.recv_into)
    except EOFError as exc:
        raise DirectPathError(
            grpc.StatusCode.DATA_LOSS,
            f"truncated transfer of version {header.version} from {where}: {exc}",
        ) from exc
    except OSError as exc:
        raise DirectPathError(
            grpc.StatusCode.UNAVAILABLE,
            f"weight-sync data plane at {where} failed mid-transfer: {exc}",
        ) from exc
    return rebuild(header, parts, base)
