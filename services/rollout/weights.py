"""Keeps a replica on the latest policy: register with weight-sync, follow its version
notices, pull each new version, hand it to the engine factory (codes as pushed, no
re-quantization: a new PyTorch engine, or the CUDA engine loading it in place) and swap it in
between requests; heartbeat the version held.

A CUDA replica on the trainer's node (`cuda_ipc`) loads a version the trainer offers over
CUDA IPC as soon as the offer's notice comes, GPU to GPU (trace_common/clients/cuda_ipc.py),
without waiting for its push. An offer that cannot be opened (the trainer released it or
restarted, another IPC namespace) is logged and counted; the replica then pulls that version
once its push completes.

A replica that joins broadcasts (`member`, trace_common/clients/broadcast.py) receives a
version in the trainer's broadcast when weight-sync put it in the version's group (a notice
with `broadcast_group_id` while the push runs). A broadcast that fails is logged and counted
and the version is pulled; after BROADCAST_FAILURES_OFF failures in a row the replica
registers again without a backend and takes no more broadcasts (an unreachable store or a
firewalled NCCL port would otherwise cost every version a timeout). Either way the engine
swaps to a whole version or keeps its old one."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import grpc

from trace_common.clients import WeightSyncClient
from trace_common.clients.broadcast import BroadcastError, Member
from trace_common.clients.cuda_ipc import node_id
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.rollout.engine import EngineFactory, EngineHolder
from trace_common.service import Metrics

log = logging.getLogger(__name__)

RECONNECT_S = 0.5  # wait before re-subscribing after weight-sync went away
IPC_FAILED_KEPT = 16  # versions remembered as failed over CUDA IPC
BROADCAST_FAILURES_OFF = 3  # broadcasts failed in a row before the replica leaves them


class WeightFollower:
    """A daemon thread: subscribe -> pull -> build -> swap, for as long as the replica lives."""

    def __init__(
        self,
        client: WeightSyncClient,
        holder: EngineHolder,
        factory: EngineFactory,
        *,
        replica_id: str,
        address: Callable[[], str],
        heartbeat_interval_s: float,
        metrics: Metrics,
        cuda_ipc: bool = False,
        member: Member | None = None,
    ) -> None:
        self.client = client
        self.member = member
        self.broadcast_failures = 0
        self._broadcast_failed_in_row = 0
        self.cuda_ipc = cuda_ipc and bool(node_id())
        self.ipc_failures = 0
        self._ipc_failed: set[int] = set()  # versions whose offer failed here: pull them
        self.holder = holder
        self.factory = factory
        self.replica_id = replica_id
        self.address = address
        self.heartbeat_interval_s = heartbeat_interval_s
        self.last_pull_seconds = 0.0
        self.last_transfer_seconds = 0.0
        self.last_pull: dict[str, object] = {}  # WeightSyncClient.last_pull of the last load
        self.pulls = 0
        self._stop = threading.Event()
        self._stream = None
        self._hb_stop: threading.Event | None = None
        self._pull_s = metrics.histogram("weight_pull_seconds", "pull + build + swap of a version")
        self._version = metrics.gauge("policy_version", "policy version this replica serves")
        self._version.set(-1)

    def start(self) -> None:
        threading.Thread(target=self._run, name="weight-follower", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._stream is not None:
            self._stream.cancel()
        if self._hb_stop is not None:
            self._hb_stop.set()

    def _run(self) -> None:
        registered = False
        while not self._stop.is_set():
            try:
                if not registered:
                    member = self.member
                    self.client.register(
                        self.replica_id, self.address(), node_id=node_id(),
                        broadcast_backend="" if member is None else member.backend,
                        device_uuid="" if member is None else member.device_uuid,
                    )  # fmt: skip
                    registered = True
                    if self._hb_stop is None:
                        self._hb_stop = self.client.start_heartbeats(
                            self.replica_id, lambda: self.holder.version, self.heartbeat_interval_s
                        )
                self._stream = self.client.subscribe(self.replica_id)
                for notice in self._stream:
                    if notice.version <= self.holder.version:
                        continue
                    if self._takes_broadcast(notice) and self._load_broadcast(notice.version):
                        continue
                    if self._takes_offer(notice) and self._load_offer(notice.version):
                        continue
                    if not notice.offer_only:
                        self._load(notice.version)
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                log.warning("weight-sync stream ended: %s; reconnecting", exc.code())
                registered = exc.code() != grpc.StatusCode.NOT_FOUND and registered
            except Exception:
                log.exception("loading a policy version failed; retrying")
            self._stop.wait(RECONNECT_S)

    def _takes_offer(self, notice: common_pb2.PolicyVersionInfo) -> bool:
        return (
            self.cuda_ipc
            and notice.cuda_ipc_node == node_id()
            and notice.version not in self._ipc_failed
        )

    def _takes_broadcast(self, notice: common_pb2.PolicyVersionInfo) -> bool:
        return self.member is not None and notice.offer_only and bool(notice.broadcast_group_id)

    def _load_broadcast(self, version: int) -> bool:
        """Receive `version` in its broadcast if this replica is a member of its group; False
        when it is not, or (logged, counted) when the broadcast failed."""
        assert self.member is not None
        t0 = time.perf_counter()
        try:
            offer = self.client.get_offer(version, replica_id=self.replica_id)
            if self.replica_id not in offer.broadcast.members:
                return False  # registered after the group was formed: the push serves it
            got, tensors, meta = self.client.receive_broadcast(
                version, self.member, replica_id=self.replica_id
            )
            self._serve(got, tensors, meta, t0)
        except (BroadcastError, grpc.RpcError) as exc:
            self.broadcast_failures += 1
            self._broadcast_failed_in_row += 1
            log.warning(
                "receiving version %d in the broadcast failed (%s): pulling it over the network",
                version, exc,
            )  # fmt: skip
            if self._broadcast_failed_in_row >= BROADCAST_FAILURES_OFF:
                self._leave_broadcasts()
            return False
        self._broadcast_failed_in_row = 0
        return True

    def _leave_broadcasts(self) -> None:
        """Stop joining broadcasts: register again without a backend."""
        log.warning(
            "%d broadcasts failed in a row: this replica leaves them and pulls every version",
            self._broadcast_failed_in_row,
        )
        assert self.member is not None
        self.member.close()
        self.member = None
        with contextlib.suppress(grpc.RpcError):  # the next register (on reconnect) has none
            self.client.register(self.replica_id, self.address(), node_id=node_id())

    def _load_offer(self, version: int) -> bool:
        """Load `version` from its CUDA IPC offer; False (logged, counted) when that fails."""
        t0 = time.perf_counter()
        try:
            got, tensors, meta = self.client.open_offer(version, replica_id=self.replica_id)
            self._serve(got, tensors, meta, t0)
        except Exception as exc:
            self.ipc_failures += 1
            self._ipc_failed.add(version)
            if len(self._ipc_failed) > IPC_FAILED_KEPT:
                self._ipc_failed.discard(min(self._ipc_failed))
            log.warning(
                "loading version %d over CUDA IPC failed (%s: %s): pulling it over the network",
                version, type(exc).__name__, exc,
            )  # fmt: skip
            return False
        return True

    def _load(self, version: int) -> None:
        t0 = time.perf_counter()
        got, tensors, meta = self.client.pull_version(version, replica_id=self.replica_id)
        self._serve(got, tensors, meta, t0)

    def _serve(self, got: int, tensors: dict, meta: dict, t0: float) -> None:
        """Build and swap in version `got` (pulled or opened since `t0`)."""
        self.last_transfer_seconds = time.perf_counter() - t0
        self.last_pull = dict(self.client.last_pull)
        str_meta = {k: v for k, v in meta.items() if isinstance(v, str)}
        engine = self.factory(tensors, str_meta, got)
        self.holder.swap(engine, got)
        seconds = time.perf_counter() - t0
        self.last_pull_seconds = seconds
        self.pulls += 1
        self._pull_s.observe(seconds)
        self._version.set(got)
        log.info(
            "serving policy version",
            extra={"version": got, "pull_seconds": seconds, **self.last_pull},
        )
        with contextlib.suppress(grpc.RpcError):  # the periodic beat will retry
            self.client.heartbeat(self.replica_id, got)  # tell weight-sync at once
