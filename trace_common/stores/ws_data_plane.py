"""weight-sync's bulk data plane: the framing both ends speak, and their TLS contexts.

gRPC stays the control plane: a replica asks `GetPullTicket` (authenticated like every
RPC) and gets the data-plane address, a random single-use ticket and the version's
manifest. It then opens a plain TCP connection (TLS when the gRPC server uses TLS, with
the same certificates) and the bytes flow without gRPC or protobuf in between:

    replica -> service   REQUEST_MAGIC (4) + ticket (TICKET_BYTES)
    service -> replica   REPLY_MAGIC (4) + status (u8) + 3 zero bytes + length (u64, LE)
    OK:                  `length` bytes: every tensor's raw bytes, in manifest order
    otherwise:           `length` bytes of UTF-8 text saying why; then the service closes

The replica receives each tensor straight into its preallocated buffer (recv_into) and
checks it against the manifest's CRC-32; a connection that ends early is a truncated
transfer, never a version.
"""

from __future__ import annotations

import enum
import socket
import ssl
import struct

import grpc

from trace_common.service.config import ServiceSettings

REQUEST_MAGIC = b"TWS1"
REPLY_MAGIC = b"TWSR"
TICKET_BYTES = 32  # secrets.token_bytes: 256 random bits
REQUEST_BYTES = len(REQUEST_MAGIC) + TICKET_BYTES
_REPLY = struct.Struct("<4sB3xQ")
REPLY_BYTES = _REPLY.size  # 16
MAX_REASON_BYTES = 4096  # a refusal's text is at most this long


class Status(enum.IntEnum):
    """The reply's status byte, and the gRPC code a client raises for it."""

    OK = 0
    BAD_TICKET = 1  # unknown (forged), already used, or expired
    BAD_REQUEST = 2  # not the request framing
    UNAVAILABLE = 3  # the service is shutting down

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _CODES[self]


_CODES = {
    Status.OK: grpc.StatusCode.OK,
    Status.BAD_TICKET: grpc.StatusCode.UNAUTHENTICATED,
    Status.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def encode_request(ticket: bytes) -> bytes:
    if len(ticket) != TICKET_BYTES:
        raise ValueError(f"a ticket is {TICKET_BYTES} bytes, got {len(ticket)}")
    return REQUEST_MAGIC + ticket


def decode_request(data: bytes) -> bytes:
    """The ticket of a request; ValueError naming what is wrong with it."""
    if len(data) != REQUEST_BYTES:
        raise ValueError(f"request is {len(data)} bytes, expected {REQUEST_BYTES}")
    if data[:4] != REQUEST_MAGIC:
        raise ValueError(f"request magic {data[:4]!r} != {REQUEST_MAGIC!r}")
    return data[4:]


def encode_reply(status: Status, length: int) -> bytes:
    return _REPLY.pack(REPLY_MAGIC, status, length)


def decode_reply(data: bytes) -> tuple[Status, int]:
    """(status, length) of a reply header; ValueError if it is not one."""
    if len(data) != REPLY_BYTES:
        raise ValueError(f"reply header is {len(data)} bytes, expected {REPLY_BYTES}")
    magic, status, length = _REPLY.unpack(data)
    if magic != REPLY_MAGIC:
        raise ValueError(f"reply magic {magic!r} != {REPLY_MAGIC!r}")
    try:
        return Status(status), length
    except ValueError:
        raise ValueError(f"unknown reply status {status}") from None


def refusal(status: Status, reason: str) -> bytes:
    """The whole reply refusing a request: header + reason text."""
    text = reason.encode()[:MAX_REASON_BYTES]
    return encode_reply(status, len(text)) + text


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes, or fewer if the peer closes first (the caller checks)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            break
        got += k
    return bytes(buf[:got])


def server_ssl_context(settings: ServiceSettings) -> ssl.SSLContext | None:
    """The data plane's TLS: on exactly when the gRPC server's is, with its certificate
    and key (and its client CA: mTLS). None without TLS."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(settings.tls_client_ca_file)
    return ctx
