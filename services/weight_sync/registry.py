"""Which rollout replicas exist, what version each holds, and whether each is alive.

A replica is alive while its last register/heartbeat is at most `heartbeat_timeout_s` old;
a dead one stays listed (alive = false) until it registers again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from trace_common.service import check_id, invalid, not_registered


@dataclass(slots=True)
class Replica:
    replica_id: str
    address: str
    version_held: int = -1
    last_seen: float = 0.0  # time.monotonic()


class ReplicaRegistry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._replicas: dict[str, Replica] = {}
        self._lock = threading.Lock()

    def register(self, replica_id: str, address: str) -> Replica:
        check_id("replica_id", replica_id)
        if len(address) > 255:
            raise invalid(f"address is {len(address)} characters, over 255")
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None:
                replica = self._replicas[replica_id] = Replica(replica_id, address)
            replica.address = address
            replica.last_seen = time.monotonic()
            return replica

    def require(self, replica_id: str) -> Replica:
        check_id("replica_id", replica_id)
        with self._lock:
            replica = self._replicas.get(replica_id)
        if replica is None:
            raise not_registered(replica_id)
        return replica

    def heartbeat(self, replica_id: str, version_held: int) -> Replica:
        if version_held < -1:
            raise invalid(f"version_held={version_held} must be >= -1 (-1 = none)")
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
            replicas = sorted(self._replicas.values(), key=lambda r: r.replica_id)
            return [
                (
                    Replica(r.replica_id, r.address, r.version_held, r.last_seen),
                    self.alive(r, now),
                    now - r.last_seen,
                )
                for r in replicas
            ]
