"""What the store clients share about choosing a data path: gRPC through the service, or a
"direct" data plane the service hands out (quant-cache: Redis itself; weight-sync: a bulk
TCP listener), with the service as the control plane.

`data_path="auto"` takes the direct path when the service offers it and it connects, else
gRPC; "direct" requires it (DirectPathError otherwise); "grpc" never asks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, TypeVar

import grpc

log = logging.getLogger(__name__)

DataPath = Literal["auto", "direct", "grpc"]
DATA_PATHS: tuple[str, ...] = ("auto", "direct", "grpc")
T = TypeVar("T")


def check_data_path(data_path: str) -> DataPath:
    if data_path not in DATA_PATHS:
        raise ValueError(f"data_path must be one of {DATA_PATHS}, got {data_path!r}")
    return data_path  # type: ignore[return-value]


class DirectPathError(grpc.RpcError):
    """A direct-path failure with the status code the gRPC path would give (`code()`,
    `details()`), so callers handle both paths with one `except grpc.RpcError`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def offered(ask: Callable[[], T], strict: bool, service: str) -> T | None:
    """The service's answer to its data-plane RPC `ask`, or None when it says the plane is
    off (FAILED_PRECONDITION, or UNIMPLEMENTED from an older service) and not `strict`.
    Anything else (bad token, bad request, service down) is raised, as on any call."""
    try:
        return ask()
    except grpc.RpcError as err:
        off = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)
        if strict or err.code() not in off:
            raise
        log.info("%s: gRPC data path (%s)", service, err.details())
        return None
