"""Which rollout replicas exist, what version each holds, and whether each is alive.

A replica is alive while its last register/heartbeat is at most `heartbeat_timeout_s` old;
a dead one stays listed (alive = false) until `expire_after_s` have passed without a beat,
then it is forgotten (its metric series go with it; it registers again if it comes back).
At most `max_replicas` are registered at once (more: RESOURCE_EXHAUSTED), so fake
registrations cannot grow the registry, /status or the metrics without bound.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from services.weight_sync.versions import MAX_POLICY_VERSION
from trace_common.service import check_id, exhausted, invalid, not_registered

MAX_ADDRESS_CHARS = 255


BROADCAST_BACKENDS = ("nccl", "gloo")  # trace_common.clients.broadcast.BACKENDS


@dataclass(slots=True)
class Replica:
    replica_id: str
    address: str
    version_held: int = -1
    last_seen: float = 0.0  # time.monotonic()
    broadcast_backend: str = ""  # the broadcasts it joins ("" = none)
    node_id: str = ""  # its node's kernel boot id ("" = unknown)
    device_uuid: str = ""  # the GPU it receives broadcasts on ("" = unknown, or the CPU)


class ReplicaRegistry:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        *,
        expire_after_s: float | None = None,
        max_replicas: int = 1024,
    ) -> None:
        """`expire_after_s` defaults to 10 heartbeat timeouts."""
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        expire_after_s = 10 * heartbeat_timeout_s if expire_after_s is None else expire_after_s
        if expire_after_s < heartbeat_timeout_s:
            raise ValueError(
                f"expire_after_s={expire_after_s} must be >= heartbeat_timeout_s="
                f"{heartbeat_timeout_s} (a replica is reported dead before it is forgotten)"
            )
        if max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {max_replicas}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.expire_after_s = expire_after_s
        self.max_replicas = max_replicas
        self._replicas: dict[str, Replica] = {}
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        """Forget replicas silent for expire_after_s (lock held)."""
        gone = [k for k, r in self._replicas.items() if now - r.last_seen > self.expire_after_s]
        for key in gone:
            del self._replicas[key]

    def register(
        self,
        replica_id: str,
        address: str,
        *,
        broadcast_backend: str = "",
        node_id: str = "",
        device_uuid: str = "",
    ) -> Replica:
        check_id("replica_id", replica_id)
        if len(address) > MAX_ADDRESS_CHARS:
            raise invalid(f"address is {len(address)} characters, over {MAX_ADDRESS_CHARS}")
        if broadcast_backend not in ("", *BROADCAST_BACKENDS):
            raise invalid(
                f"broadcast_backend={broadcast_backend[:32]!r}: expected empty or one of "
                f"{BROADCAST_BACKENDS}"
            )
        if node_id:
            check_id("node_id", node_id)
        if device_uuid:
            check_id("device_uuid", device_uuid)
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None:
                self._expire(time.monotonic())
                if len(self._replicas) >= self.max_replicas:
                    raise exhausted(
                        f"{len(self._replicas)} replicas registered (max_replicas="
                        f"{self.max_replicas}); {replica_id!r} refused"
                    )
                replica = self._replicas[replica_id] = Replica(replica_id, address)
            replica.address = address
            replica.broadcast_backend = broadcast_backend
            replica.node_id = node_id
            replica.device_uuid = device_uuid
            replica.last_seen = time.monotonic()
            return replica

    def broadcast_members(self, backend: str, exclude_gpu: tuple[str, str] = ("", "")) -> list[str]:
        """The ids, sorted, of live replicas that join `backend` broadcasts, less those on the
        GPU `exclude_gpu` = (node_id, device_uuid) when both are known."""
        now = time.monotonic()
        with self._lock:
            return sorted(
                r.replica_id
                for r in self._replicas.values()
                if r.broadcast_backend == backend
                and self.alive(r, now)
                and not (all(exclude_gpu) and (r.node_id, r.device_uuid) == exclude_gpu)
            )

    def require(self, replica_id: str) -> Replica:
        check_id("replica_id", replica_id)
        with self._lock:
            self._expire(time.monotonic())
            replica = self._replicas.get(replica_id)
        if replica is None:
            raise not_registered(replica_id)
        return replica

    def heartbeat(self, replica_id: str, version_held: int) -> Replica:
        """Record a beat. `version_held` may be newer than any version this process knows:
        versions live in memory, so after a restart replicas still hold earlier ones; only
        numbers no push can publish are refused."""
        if not -1 <= version_held <= MAX_POLICY_VERSION:
            raise invalid(
                f"version_held={version_held} must be in [-1, {MAX_POLICY_VERSION}] "
                "(-1 = none; the largest version a push can publish)"
            )
        replica = self.require(replica_id)
        with self._lock:
            replica.version_held = version_held
            replica.last_seen = time.monotonic()
        return replica

    def alive(self, replica: Replica, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - replica.last_seen <= self.heartbeat_timeout_s

    def snapshot(self) -> list[tuple[Replica, bool, float]]:
        """(replica, alive, seconds since heartbeat) for every replica, sorted by id."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            replicas = sorted(self._replicas.values(), key=lambda r: r.replica_id)
            return [
                (
                    Replica(
                        r.replica_id,
                        r.address,
                        r.version_held,
                        r.last_seen,
                        r.broadcast_backend,
                        r.node_id,
                        r.device_uuid,
                    ),
                    self.alive(r, now),
                    now - r.last_seen,
                )
                for r in replicas
            ]
