"""weight-sync's bulk data plane: a plain TCP (or TLS) listener that sends a version's
stored bytes (or its stored delta against the replica's base) to a replica holding a ticket from `GetPullTicket` (framing and protocol:
trace_common/stores/ws_data_plane.py).

The bytes go from the version's stored chunks to the socket with `sendall` of memoryviews:
no protobuf, no HTTP/2 framing, no copies. Tickets are random, single-use and short-lived;
a forged, reused or expired one is refused with a reason and counted
(`trace_weight_sync_data_plane_refused_total{reason}`).
"""

from __future__ import annotations

import logging
import secrets
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.weight_sync.versions import StoredDelta, StoredVersion
from trace_common.service import Metrics, exhausted
from trace_common.stores import ws_data_plane as wire

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # a connection must complete TLS and send its ticket this fast
SEND_TIMEOUT_S = 120.0  # one blocked send this long ends the transfer (a stuck replica)


def parse_advertise(advertise: str, port: int) -> tuple[str, int]:
    """(host, port) from "", "host" or "host:port"; ValueError naming a bad value."""
    host, sep, port_text = advertise.rpartition(":") if ":" in advertise else (advertise, "", "")
    if not sep:
        return advertise, port
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"data-plane advertise address {advertise!r} is not host[:port]")
    return host, int(port_text)


@dataclass(slots=True)
class _Ticket:
    stored: StoredVersion | StoredDelta
    replica_id: str
    expires_at: float  # time.monotonic()


class DataPlane:
    """Listens on `host:port` (0 = any free port); `issue` hands out tickets, each good for
    one connection within `ticket_seconds`. `on_pull(replica_id, sent, seconds)` is
    called after each complete send (the servicer counts it like a gRPC pull).

    `advertise` is the address handed to replicas: "" (the host they reach gRPC by, this
    port), "host", or "host:port" (behind a port mapping or proxy)."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Metrics,
        on_pull: Callable[[str, StoredVersion | StoredDelta, float], None],
        *,
        ticket_seconds: float,
        max_tickets: int,
        max_tickets_per_replica: int | None = None,
        advertise: str = "",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if ticket_seconds <= 0:
            raise ValueError(f"ticket_seconds must be > 0, got {ticket_seconds}")
        if max_tickets < 1:
            raise ValueError(f"max_tickets must be >= 1, got {max_tickets}")
        per_replica = max_tickets if max_tickets_per_replica is None else max_tickets_per_replica
        if per_replica < 1:
            raise ValueError(f"max_tickets_per_replica must be >= 1, got {per_replica}")
        self.ticket_seconds = ticket_seconds
        self.max_tickets = max_tickets
        self.max_tickets_per_replica = per_replica
        self.tls = ssl_context is not None
        self._ssl = ssl_context
        self._on_pull = on_pull
        self._tickets: dict[bytes, _Ticket] = {}
        # Redeemed tickets, kept until they would have expired: to tell "already used" apart.
        self._used: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.refused = metrics.counter(
            "data_plane_refused", "data-plane connections refused", ("reason",)
        )
        try:
            self._sock = socket.create_server((host, port))
        except OSError as exc:
            raise OSError(
                f"weight-sync data plane cannot listen on {host}:{port} (TRACE_DATA_PLANE_PORT): {exc}"
            ) from exc
        self.port: int = self._sock.getsockname()[1]
        self.advertise_host, self.advertise_port = parse_advertise(advertise, self.port)
        threading.Thread(target=self._accept, name="ws-data-plane", daemon=True).start()

    def issue(self, stored: StoredVersion | StoredDelta, replica_id: str) -> bytes:
        """A new ticket for one pull of `stored` (RESOURCE_EXHAUSTED when too many are
        outstanding, in all or for this replica_id: clients then pull with PullVersion).
        The ticket holds the version: a pull started before the version is dropped still
        gets it."""
        now = time.monotonic()
        ticket = secrets.token_bytes(wire.TICKET_BYTES)
        with self._lock:
            self._expire(now)
            if len(self._tickets) >= self.max_tickets:
                raise exhausted(
                    f"{len(self._tickets)} data-plane tickets outstanding (max_tickets="
                    f"{self.max_tickets}); retry after {self.ticket_seconds:g} s or use PullVersion"
                )
            mine = sum(1 for t in self._tickets.values() if t.replica_id == replica_id)
            if mine >= self.max_tickets_per_replica:
                raise exhausted(
                    f"replica_id={replica_id!r} holds {mine} unused data-plane tickets "
                    f"(max_tickets_per_replica={self.max_tickets_per_replica}); use PullVersion"
                )
            self._tickets[ticket] = _Ticket(stored, replica_id, now + self.ticket_seconds)
        return ticket

    def _expire(self, now: float) -> None:
        for key in [k for k, t in self._tickets.items() if t.expires_at < now]:
            del self._tickets[key]
        while self._used and next(iter(self._used.values())) < now:
            self._used.popitem(last=False)

    def _redeem(self, ticket: bytes) -> tuple[_Ticket | None, str]:
        """(ticket, "") or (None, why refused): one use only."""
        now = time.monotonic()
        with self._lock:
            found = self._tickets.pop(ticket, None)
            if found is not None and found.expires_at >= now:
                self._used[ticket] = found.expires_at
                return found, ""
            if found is not None:
                return None, "expired"
            return None, "used" if ticket in self._used else "unknown"

    def close(self) -> None:
        """Stop accepting; transfers in flight finish on their own threads."""
        self._closed.set()
        self._sock.close()

    # -- connections ------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(conn, peer), name="ws-data-send", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        try:
            conn.settimeout(REQUEST_TIMEOUT_S)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)  # handshake here
            with conn:
                self._answer(conn, peer)
        except (OSError, ssl.SSLError) as exc:
            log.warning(
                "data-plane connection failed", extra={"peer": str(peer), "error": str(exc)}
            )
            conn.close()

    def _answer(self, conn: socket.socket, peer: tuple) -> None:
        try:
            ticket = wire.decode_request(wire.recv_exact(conn, wire.REQUEST_BYTES))
        except ValueError as exc:
            self._refuse(conn, wire.Status.BAD_REQUEST, "bad_request", f"bad request: {exc}", peer)
            return
        if self._closed.is_set():
            self._refuse(
                conn, wire.Status.UNAVAILABLE, "closed", "weight-sync is shutting down", peer
            )
            return
        found, why = self._redeem(ticket)
        if found is None:
            text = {
                "unknown": "unknown ticket (not issued by this service)",
                "used": "ticket already used (each ticket is good for one pull)",
                "expired": f"ticket expired (tickets last {self.ticket_seconds:g} s)",
            }[why]
            self._refuse(conn, wire.Status.BAD_TICKET, why, text, peer)
            return
        stored = found.stored
        nbytes = stored.wire_bytes
        conn.settimeout(SEND_TIMEOUT_S)
        start = time.perf_counter()
        conn.sendall(wire.encode_reply(wire.Status.OK, nbytes))
        for view in stored.data_views():
            conn.sendall(view)
        self._on_pull(found.replica_id, stored, time.perf_counter() - start)

    def _refuse(
        self, conn: socket.socket, status: wire.Status, reason: str, text: str, peer: tuple
    ) -> None:
        self.refused.labels(reason).inc()
        log.warning("data-plane request refused", extra={"peer": str(peer), "reason": text})
        conn.sendall(wire.refusal(status, text))
