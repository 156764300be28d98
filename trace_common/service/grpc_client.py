"""gRPC client plumbing shared by every client class: channel with message limits, TLS,
the bearer token, default deadlines, and retries with exponential backoff (gRPC's own
retry policy, applied only to the methods a client declares idempotent)."""

from __future__ import annotations

import json
import os
import pathlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from trace_common.service.config import DEFAULT_MAX_MESSAGE_BYTES
from trace_common.service.grpc_server import AUTH_HEADER, channel_options

TOKEN_ENV = "TRACE_AUTH_TOKEN"
TOKEN_FILE_ENV = "TRACE_AUTH_TOKEN_FILE"
DEFAULT_TIMEOUT_S = 30.0


@dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """Exponential backoff for idempotent calls: attempt n waits ~initial * multiplier**n."""

    max_attempts: int = 5  # gRPC caps this at 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    codes: tuple[str, ...] = ("UNAVAILABLE",)  # transient only (not limits, not bad input)

    def service_config(self, service: str, methods: Sequence[str]) -> str:
        return json.dumps(
            {
                "methodConfig": [
                    {
                        "name": [{"service": service, "method": m} for m in methods],
                        "retryPolicy": {
                            "maxAttempts": self.max_attempts,
                            "initialBackoff": f"{self.initial_backoff_s}s",
                            "maxBackoff": f"{self.max_backoff_s}s",
                            "backoffMultiplier": self.multiplier,
                            "retryableStatusCodes": list(self.codes),
                        },
                    }
                ]
            }
        )


def resolve_token(token: str | None = None) -> str:
    """The bearer token: the argument, else $TRACE_AUTH_TOKEN, else the $TRACE_AUTH_TOKEN_FILE file."""
    if token:
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        return pathlib.Path(path).read_text().strip()
    raise ValueError(f"no auth token: pass token= or set {TOKEN_ENV} / {TOKEN_FILE_ENV}")


@dataclass(kw_only=True, slots=True)
class ClientTLS:
    """Server CA (and, for mTLS, this client's certificate and key), all PEM paths."""

    ca_file: pathlib.Path | None = None
    cert_file: pathlib.Path | None = None
    key_file: pathlib.Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        read = lambda p: p.read_bytes() if p is not None else None  # noqa: E731
        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust for a plain TLS socket (weight-sync's data plane): the CA (else
        the system's), this client's certificate for mTLS, host names verified."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


class GrpcClient:
    """Base of every service client: owns the channel, the auth metadata and the deadline.

    Subclasses set `SERVICE` (full proto name) and `IDEMPOTENT` (methods safe to retry) and
    build their stub from `self.channel`; each call passes `metadata=self.metadata` and
    `timeout=self.timeout`.
    """

    SERVICE: str = ""
    IDEMPOTENT: tuple[str, ...] = ()

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: ClientTLS | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retry: RetryPolicy | None = None,
    ) -> None:
        if not address or ":" not in address:
            raise ValueError(f"address must be host:port, got {address!r}")
        self.address = address
        self.timeout = timeout
        self.metadata = ((AUTH_HEADER, f"Bearer {resolve_token(token)}"),)
        options = channel_options(max_message_bytes)
        if self.IDEMPOTENT:
            policy = retry or RetryPolicy()
            options += [
                ("grpc.enable_retries", 1),
                ("grpc.service_config", policy.service_config(self.SERVICE, self.IDEMPOTENT)),
            ]
        if tls is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.channel = grpc.secure_channel(address, tls.credentials(), options=options)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects (raises grpc.FutureTimeoutError)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
