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
from trace_common.clients import cuda_ipc as ipc
from trace_common.clients.quant_cache import REPLAYED, TAG_MISMATCH
from trace_common.device import pack_on_device, to_host
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


class WeightSyncPublisher:
    """Pushes a version to weight-sync (published atomically once complete). A weight-sync
    that is unavailable (restarting) is retried within `backoff`'s budget.

    With `cuda_ipc`, a version exported on a CUDA device is first offered over CUDA IPC
    (trace_common/clients/cuda_ipc.py): replicas on this node copy it GPU to GPU at once,
    while the push that follows serves the others, late joiners and CPU replicas. The last
    OFFERS_HELD offered buffers stay allocated here (GPU memory: that many policy copies)."""

    OFFERS_HELD = 2

    def __init__(
        self, client: WeightSyncClient, backoff: Backoff | None = None, *, cuda_ipc: bool = False
    ) -> None:
        self.client = client
        self.backoff = backoff or Backoff()
        self.cuda_ipc = cuda_ipc and bool(ipc.node_id())
        self._offered: deque[ipc.Shared] = deque(maxlen=self.OFFERS_HELD)
        self.last_offer_seconds = 0.0
        self.last_push_seconds = 0.0
        self.last_push: dict[
            str, Any
        ] = {}  # bytes sent, changed fractions (weight_deltas.push_stats)

    def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any]
    ) -> None:
        t0 = time.perf_counter()
        on_gpu = all(t.device.type == "cuda" for t in tensors.values())
        if on_gpu and self.cuda_ipc:
            tensors = self._offer(version, tensors, metadata)
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

    def _offer(
        self, version: int, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any]
    ) -> Mapping[str, torch.Tensor]:
        """Offer `version` over CUDA IPC; returns the tensors as shared (packed into one
        buffer unless they already were). A failed offer is logged and the push goes on;
        a weight-sync without offers (UNIMPLEMENTED), or CUDA memory this process cannot
        share, turns them off."""
        try:
            try:
                shared = ipc.share(tensors)
            except ValueError:  # not one packed buffer yet
                tensors = pack_on_device(tensors)
                shared = ipc.share(tensors)
            self.client.offer_version(version, shared, ipc.manifest(tensors), metadata)
        except grpc.RpcError as err:
            log.warning("CUDA IPC offer of version %d failed (%s: %s); pushing only",
                        version, err.code().name, err.details())  # fmt: skip
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.cuda_ipc = False
            return tensors
        except (RuntimeError, ValueError) as exc:  # this process cannot share CUDA memory
            log.warning("CUDA IPC offers off: sharing version %d failed (%s: %s); pushing only",
                        version, type(exc).__name__, exc)  # fmt: skip
            self.cuda_ipc = False
            return tensors
        self._offered.append(shared)
        return tensors

    def _latest(self) -> int:
        return max((v.version for v in self.client.versions()), default=-1)

    def latest_version(self) -> int:
        """The latest version weight-sync holds (-1 = none: fresh, or it restarted)."""
        return retry_transient(self._latest, "weight-sync ListVersions", self.backoff)
