"""The trainer's view of the other services, behind the loop's interfaces
(``trace_common.rl``): rollout replicas over gRPC found through weight-sync's registry,
records from quant-cache, new versions pushed to weight-sync."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import torch

from trace_common.clients import CorruptRecordError, QuantCacheClient, WeightSyncClient
from trace_common.clients import broadcast as bcast
from trace_common.clients import cuda_ipc as ipc
from trace_common.clients.quant_cache import REPLAYED, TAG_MISMATCH
from trace_common.device import pack_on_device, resolve_device, to_host
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from trace_common.rl.audit import RecordAudit
from trace_common.rl.dispatch import GenerateCall, ReplicaBehind, ReplicaUnavailable
from trace_common.rl.types import RolloutSample
from trace_common.rollout.convert import finish_from_proto, sampling_to_proto
from trace_common.service.grpc_client import GrpcClient
from trace_common.service.retry import Backoff, retry_transient

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 2.0


class GrpcReplica(GrpcClient):
    """A rollout replica reached over gRPC (the dispatcher's ``Replica``)."""

    SERVICE = "trace.rollout.v1.Rollout"
    IDEMPOTENT = ("Status",)  # Generate is re-dispatched by the trainer, never retried blindly

    def __init__(
        self, replica_id: str, address: str, token: str, *, generate_timeout: float
    ) -> None:
        super().__init__(address, token)
        self._replica_id = replica_id
        self.generate_timeout = generate_timeout
        self._stub = rollout_pb2_grpc.RolloutStub(self.channel)

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def generate(self, call: GenerateCall) -> list[RolloutSample]:
        unit = call.unit
        sp = call.sampling
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=list(t)) for t in unit.prompt_tokens],
            group_size=call.group_size,
            sampling=sampling_to_proto(sp),
            min_policy_version=call.min_policy_version,
            run_id=call.run_id,
            sample_id_prefix=call.prefix(),
            write_records=call.write_records,
        )
        out = []
        try:
            for c in self._stub.Generate(
                request, metadata=self.metadata, timeout=self.generate_timeout
            ):
                if not 0 <= c.prompt_index < len(unit.prompt_ids):
                    raise ReplicaUnavailable(f"prompt_index {c.prompt_index} out of range")
                out.append(
                    RolloutSample(
                        sample_id=c.sample_id,
                        prompt_id=unit.prompt_ids[c.prompt_index],
                        group_index=c.group_index,
                        prompt_tokens=tuple(unit.prompt_tokens[c.prompt_index]),
                        completion_tokens=list(c.token_ids),
                        logprobs=list(c.logprobs),
                        policy_version=c.policy_version,
                        finish_reason=finish_from_proto(c.finish_reason),
                        record_bytes=c.record_bytes,
                        record_generation=c.record_generation,
                        replica_id=self._replica_id,
                    )
                )
        except grpc.RpcError as exc:
            code = exc.code()
            # the rollout answers FAILED_PRECONDITION only when it holds no or too old weights
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise ReplicaBehind(f"{self._replica_id}: {exc.details()}") from exc
            raise ReplicaUnavailable(f"{self._replica_id}: {code.name}: {exc.details()}") from exc
        except ValueError as exc:  # a completion the proto does not allow
            raise ReplicaUnavailable(f"{self._replica_id}: bad completion: {exc}") from exc
        return out

    def status(self) -> rollout_pb2.RolloutStatusResponse:
        return self._stub.Status(
            rollout_pb2.RolloutStatusRequest(), metadata=self.metadata, timeout=STATUS_TIMEOUT_S
        )


class WeightSyncDirectory:
    """Live replicas as weight-sync's registry reports them (heartbeats within the timeout)."""

    def __init__(self, client: WeightSyncClient, token: str, *, generate_timeout: float) -> None:
        self.client = client
        self.token = token
        self.generate_timeout = generate_timeout
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str], GrpcReplica] = {}

    def replicas(self) -> Sequence[GrpcReplica]:
        try:
            infos = [r for r in self.client.replicas() if r.alive and r.address]
        except grpc.RpcError as exc:
            log.warning("weight-sync ListReplicas failed: %s", exc.code())
            return []
        out = []
        with self._lock:
            for r in infos:
                key = (r.replica_id, r.address)
                if key not in self._clients:
                    self._clients[key] = GrpcReplica(
                        r.replica_id, r.address, self.token, generate_timeout=self.generate_timeout
                    )
                out.append(self._clients[key])
        return out

    def pull_seconds(self) -> dict[str, float]:
        """Each live replica's last weight pull time (pull + build + swap), seconds."""
        out = {}
        for r in self.replicas():
            try:
                st = r.status()
            except grpc.RpcError:
                continue
            if st.weight_pulls_total:
                out[r.replica_id] = st.last_weight_pull_seconds
        return out


def refusal_reason(detail: str) -> str:
    """The metric label of a record refusal's detail (CorruptRecordError.corrupt)."""
    if detail == TAG_MISMATCH:
        return "tag"
    return "replay" if detail == REPLAYED else "checksum"


class QuantCacheRecords:
    """``fetch`` of record blobs from quant-cache; a missing or corrupt record is an error.
    An unavailable store (a Redis blip, quant-cache restarting) is retried within
    `backoff`'s budget before the step fails."""

    def __init__(
        self,
        client: QuantCacheClient,
        audit: RecordAudit | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.client = client
        self.audit = audit
        self.backoff = backoff or Backoff()
        self.bytes_fetched = 0
        self.retries = 0
        # Records refused since the last `take_refused`, by reason: "tag" (HMAC: written
        # without the token, altered, copied from another key), "replay" (a genuine older
        # write of the key) or "checksum" (CRC-32, truncated: damaged in the store or in
        # transit).
        self._refused: dict[str, int] = {}

    def fetch(
        self,
        run_id: str,
        policy_version: int,
        sample_ids: Sequence[str],
        *,
        generations: Mapping[str, bytes] | None = None,
    ) -> dict[str, bytes]:
        def count(_err: grpc.RpcError) -> None:
            self.retries += 1

        try:
            got = retry_transient(
                lambda: self.client.get_records(
                    run_id, policy_version, sample_ids, missing_ok=True, generations=generations
                ),
                f"record read (run {run_id}, version {policy_version})",
                self.backoff,
                on_retry=count,
            )
        except CorruptRecordError as exc:  # never trained on: the caller drops their groups
            log.warning("corrupt records from quant-cache: %s", exc.corrupt)
            for detail in exc.corrupt.values():
                reason = refusal_reason(detail)
                self._refused[reason] = self._refused.get(reason, 0) + 1
            got = exc.records
        self.bytes_fetched += sum(len(b) for b in got.values())
        if self.audit is not None:
            for sid, blob in got.items():
                self.audit.log(run_id, policy_version, sid, blob)
        return got

    def take_refused(self) -> dict[str, int]:
        """Records refused since the last call, by reason (and reset)."""
        out, self._refused = self._refused, {}
        return out


def broadcast_source(settings: Any) -> bcast.Source | None:
    """The trainer's broadcast store (TrainerSettings.broadcast*), or None when it is off:
    auto means NCCL on a CUDA trainer and off on the CPU."""
    backend = settings.broadcast
    if backend == "auto":
        backend = "nccl" if resolve_device(settings.device).type == "cuda" else "off"
    if backend == "off":
        return None
    source = bcast.Source(
        settings.broadcast_host, settings.broadcast_port, backend,
        settings.broadcast_timeout_seconds,
    )  # fmt: skip
    log.info(
        "broadcast store listening",
        extra={"backend": backend, "host": source.host, "port": source.port},
    )
    return source


class WeightSyncPublisher:
    """Pushes a version to weight-sync (published atomically once complete). A weight-sync
    that is unavailable (restarting) is retried within `backoff`'s budget.

    Before the push, a version may be offered to replicas that can take it faster; the push
    that follows serves the others, late joiners and CPU replicas:
    - `cuda_ipc`: a version exported on a CUDA device is offered over CUDA IPC
      (trace_common/clients/cuda_ipc.py): replicas on this node copy it GPU to GPU. The last
      OFFERS_HELD offered buffers stay allocated here (that many policy copies on the GPU).
    - `source` (trace_common/clients/broadcast.py): the version is broadcast to the group of
      replicas weight-sync forms for it, GPU to GPU over NCCL (or from host memory over
      gloo). A failed broadcast is logged and counted; its members pull the version, and
      the next offer asks for a new group."""

    OFFERS_HELD = 2

    def __init__(
        self,
        client: WeightSyncClient,
        backoff: Backoff | None = None,
        *,
        cuda_ipc: bool = False,
        source: bcast.Source | None = None,
    ) -> None:
        self.client = client
        self.backoff = backoff or Backoff()
        self.cuda_ipc = cuda_ipc and bool(ipc.node_id())
        self.source = source
        self._offered: deque[ipc.Shared] = deque(maxlen=self.OFFERS_HELD)
        self.last_offer_seconds = 0.0
        self.last_broadcast_seconds = 0.0
        self.last_broadcast_members = 0
        self.broadcast_failures = 0
        self.last_push_seconds = 0.0
        self.last_push: dict[
            str, Any
        ] = {}  # bytes sent, changed fractions (weight_deltas.push_stats)

    def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any]
    ) -> None:
        t0 = time.perf_counter()
        on_gpu = all(t.device.type == "cuda" for t in tensors.values())
        shared = None
        if on_gpu and self.cuda_ipc:
            tensors, shared = self._share(version, tensors)
        source = self.source
        if source is not None and source.backend == "nccl" and not on_gpu:
            source = None  # NCCL moves GPU memory; a CPU export goes by the push only
        if source is not None and source.backend == "gloo":
            tensors = to_host(tensors)  # gloo sends host memory: the push's copy, made now
        flat, offsets = bcast.flat_view(tensors) if source is not None else (None, [])
        if shared is not None or source is not None:
            checksummed = source is not None and not flat.is_cuda
            specs = bcast.manifest(tensors, checksummed=checksummed)
            endpoint = None
            if source is not None:
                gpu = ipc.device_uuid(flat.device) if flat.is_cuda else ""
                endpoint = source.endpoint(
                    offsets, flat.numel(), checksummed=checksummed, node=ipc.node_id(),
                    device_uuid=gpu,
                )  # fmt: skip
            group = self._offer(version, shared, specs, metadata, endpoint)
            self.last_broadcast_members, self.last_broadcast_seconds = 0, 0.0  # no group yet
            if group is not None and source is not None:
                self._broadcast(source, group, flat)
        self.last_offer_seconds = time.perf_counter() - t0
        tensors = to_host(tensors)

        def push() -> None:
            try:
                self.client.push_version(version, tensors, metadata)
            except grpc.RpcError as err:
                # A retried push whose first attempt was published before its answer was
                # lost: weight-sync already holds this version (this trainer is its only pusher).
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION or (self._latest() != version):
                    raise

        retry_transient(push, f"push of version {version} to weight-sync", self.backoff)
        self.last_push_seconds = time.perf_counter() - t0
        self.last_push = dict(self.client.last_push)
        if self.source is not None:
            self.last_push.update(
                weight_broadcast_seconds=self.last_broadcast_seconds,
                weight_broadcast_members=self.last_broadcast_members,
                weight_broadcast_failures=self.broadcast_failures,
            )

    def _share(
        self, version: int, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[Mapping[str, torch.Tensor], ipc.Shared | None]:
        """The tensors packed into one GPU buffer and its CUDA IPC description; CUDA memory
        this process cannot share turns IPC offers off (None)."""
        try:
            try:
                return tensors, ipc.share(tensors)
            except ValueError:  # not one packed buffer yet
                tensors = pack_on_device(tensors)
                return tensors, ipc.share(tensors)
        except (RuntimeError, ValueError) as exc:  # this process cannot share CUDA memory
            log.warning("CUDA IPC offers off: sharing version %d failed (%s: %s); pushing only",
                        version, type(exc).__name__, exc)  # fmt: skip
            self.cuda_ipc = False
            return tensors, None

    def _offer(
        self,
        version: int,
        shared: ipc.Shared | None,
        specs: list,
        metadata: dict[str, Any],
        endpoint: Any,
    ) -> Any:
        """Offer `version` (IPC buffer and/or broadcast endpoint); the broadcast group
        weight-sync formed, or None. A failed offer is logged and the push goes on; a
        weight-sync without offers (UNIMPLEMENTED) turns them off."""
        new_group = self.source is not None and self.source.renew_group
        try:
            group = self.client.offer_version(
                version, shared, specs, metadata, broadcast=endpoint, new_group=new_group
            )
        except grpc.RpcError as err:
            log.warning("offer of version %d failed (%s: %s); pushing only",
                        version, err.code().name, err.details())  # fmt: skip
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.cuda_ipc, self.source = False, None
            return None
        if shared is not None:
            self._offered.append(shared)
        return group

    def _broadcast(self, source: bcast.Source, group: Any, flat: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.last_broadcast_members = len(group.members)
        try:
            source.send(group, flat)
        except bcast.BroadcastError as exc:
            self.broadcast_failures += 1
            log.warning("%s; its members pull the version", exc)
        self.last_broadcast_seconds = time.perf_counter() - t0

    def _latest(self) -> int:
        return max((v.version for v in self.client.versions()), default=-1)

    def latest_version(self) -> int:
        """The latest version weight-sync holds (-1 = none: fresh, or it restarted)."""
        return retry_transient(self._latest, "weight-sync ListVersions", self.backoff)
