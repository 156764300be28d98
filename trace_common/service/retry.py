"""Bounded retries of calls that fail transiently (a store restarting, a Redis blip).

gRPC's own retry policy (grpc_client.RetryPolicy) covers ~1.5 s of UNAVAILABLE on idempotent
methods; a store that restarts takes seconds. `retry_transient` retries a call on
UNAVAILABLE with exponential backoff until `budget_s` is spent, then raises the last error:
a long outage still fails, loudly, with the store's own status and message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)

T = TypeVar("T")
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(kw_only=True, slots=True, frozen=True)
class Backoff:
    """Waits initial_s, initial_s * multiplier, ... (each at most max_s) until budget_s."""

    budget_s: float = 30.0  # total time spent waiting before giving up
    initial_s: float = 0.1
    max_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.budget_s < 0 or self.initial_s <= 0 or self.max_s < self.initial_s:
            raise ValueError(
                f"backoff needs budget_s >= 0 and 0 < initial_s <= max_s, got budget_s="
                f"{self.budget_s} initial_s={self.initial_s} max_s={self.max_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")


def retry_transient(
    call: Callable[[], T],
    what: str,
    backoff: Backoff,
    *,
    codes: Collection[grpc.StatusCode] = TRANSIENT_CODES,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[grpc.RpcError], None] | None = None,
) -> T:
    """`call()`, retried while it raises a grpc.RpcError whose code is in `codes`, for at
    most `backoff.budget_s` seconds of waiting; other errors and the last one propagate."""
    waited = 0.0
    wait = backoff.initial_s
    attempt = 1
    while True:
        try:
            return call()
        except grpc.RpcError as err:
            code = err.code() if callable(getattr(err, "code", None)) else None
            if code not in codes or waited + wait > backoff.budget_s:
                raise
            log.warning(
                "%s failed (%s, attempt %d); retrying in %.2f s", what, code.name, attempt, wait
            )
            if on_retry is not None:
                on_retry(err)
            sleep(wait)
            waited += wait
            wait = min(wait * backoff.multiplier, backoff.max_s)
            attempt += 1
