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


def check_id(field: str, value: str, pattern: re.Pattern[str] = ID_RE) -> str:
    """Validate an identifier used in keys and labels; INVALID_ARGUMENT names the value."""
    if not pattern.fullmatch(value):
        raise invalid(f"{field}={value!r} must match {pattern.pattern}")
    return value


def check_non_negative(field: str, value: int) -> int:
    if value < 0:
        raise invalid(f"{field}={value} must be >= 0")
    return value
