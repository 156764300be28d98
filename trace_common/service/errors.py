"""Service errors carrying a gRPC status code.

Servicers raise `ServiceError` (or the helpers below) from validation and business logic;
the server's interceptor turns it into `context.abort(code, message)`, so servicer methods
stay plain functions that unit tests call directly with hand-built messages.
"""

from __future__ import annotations

import re

import grpc

ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
LONG_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")
# An invalid id is quoted up to this many characters: an id may be as large as a whole
# message, and a status message over the client's metadata limit (8-16 KiB) reaches the
# client as RESOURCE_EXHAUSTED instead of the code the service answered.
QUOTE_CHARS = 32
# Status messages are cut to this many characters for the same reason (`cut_details`).
MAX_DETAILS_CHARS = 1024


class ServiceError(Exception):
    """An RPC failure with its status code and a message naming the problem."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def failed_precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


# weight-sync's message for a replica it does not know (never registered, expired, or lost in
# a restart); clients match it to register again (`is_not_registered`).
NOT_REGISTERED = "is not registered"


def not_registered(replica_id: str) -> ServiceError:
    return failed_precondition(f"replica {replica_id!r} {NOT_REGISTERED}: call Register first")


def is_not_registered(err: grpc.RpcError) -> bool:
    """True for weight-sync's answer to a replica it does not know (FAILED_PRECONDITION, or
    NOT_FOUND from a service that says so)."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    details = err.details() if callable(getattr(err, "details", None)) else ""
    return code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND) and (
        NOT_REGISTERED in (details or "")
    )


# Codes of an upstream call that say nothing about the caller's request: our own credentials
# were refused upstream, a deployment problem (FAILED_PRECONDITION, not the caller's token).
_CREDENTIAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def from_upstream(err: grpc.RpcError, upstream: str = "an upstream service") -> ServiceError:
    """The ServiceError to answer with when a call this service made failed (e.g. the rollout
    writing records to quant-cache): the upstream code is kept (UNAVAILABLE stays
    retryable, RESOURCE_EXHAUSTED, INVALID_ARGUMENT, DATA_LOSS... keep their meaning) and the
    upstream's message is quoted. A refusal of this service's own credentials becomes
    FAILED_PRECONDITION; an upstream without a code (UNKNOWN), INTERNAL."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if code in _CREDENTIAL_CODES:
        mapped = grpc.StatusCode.FAILED_PRECONDITION
    elif not isinstance(code, grpc.StatusCode) or code in (
        grpc.StatusCode.OK,
        grpc.StatusCode.UNKNOWN,
    ):
        mapped = grpc.StatusCode.INTERNAL
    else:
        mapped = code
    return ServiceError(mapped, f"{upstream} answered {name}: {details}")


def quote(value: str, limit: int = QUOTE_CHARS) -> str:
    """`repr(value)`, of its first `limit` characters only when longer (then `...` follows)."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}..."


def cut_details(message: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """`message` cut to `limit` characters (marked `...`), small enough for any client."""
    return message if len(message) <= limit else f"{message[: limit - 3]}..."


def check_id(field: str, value: str, pattern: re.Pattern[str] = ID_RE) -> str:
    """Validate an identifier used in keys and labels; INVALID_ARGUMENT names the field, its
    rule (with the length limit) and the value, quoted by its first QUOTE_CHARS characters."""
    if not pattern.fullmatch(value):
        raise invalid(
            f"{field}={quote(value)} ({len(value)} characters) must match {pattern.pattern}"
        )
    return value


def check_non_negative(field: str, value: int) -> int:
    if value < 0:
        raise invalid(f"{field}={value} must be >= 0")
    return value
