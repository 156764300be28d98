"""retry_transient: retries UNAVAILABLE with growing waits inside a budget, nothing else."""

from __future__ import annotations

import grpc
import pytest

from trace_common.clients.data_path import DirectPathError
from trace_common.service import Backoff, is_not_registered, not_registered, retry_transient


def _failing(codes: list[grpc.StatusCode]):
    calls = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= len(codes):
            raise DirectPathError(codes[len(calls) - 1], f"failure {len(calls)}")
        return "ok"

    return call, calls


def test_transient_errors_are_retried_with_exponential_backoff() -> None:
    call, calls = _failing([grpc.StatusCode.UNAVAILABLE] * 4)
    waits: list[float] = []
    backoff = Backoff(budget_s=10, initial_s=0.1, max_s=0.5, multiplier=2)
    assert retry_transient(call, "read", backoff, sleep=waits.append) == "ok"
    assert len(calls) == 5 and waits == [0.1, 0.2, 0.4, 0.5]


def test_the_budget_bounds_the_retries_and_the_last_error_is_raised() -> None:
    call, calls = _failing([grpc.StatusCode.UNAVAILABLE] * 100)
    waits: list[float] = []
    backoff = Backoff(budget_s=1.0, initial_s=0.25, max_s=0.25)
    with pytest.raises(grpc.RpcError) as err:
        retry_transient(call, "read", backoff, sleep=waits.append)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sum(waits) <= 1.0 and len(calls) == 5, (waits, len(calls))


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DATA_LOSS,
    ],
)
def test_other_codes_are_not_retried(code: grpc.StatusCode) -> None:
    call, calls = _failing([code])
    with pytest.raises(grpc.RpcError):
        retry_transient(call, "read", Backoff(), sleep=lambda _s: None)
    assert len(calls) == 1


def test_backoff_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(initial_s=0)
    with pytest.raises(ValueError, match="multiplier"):
        Backoff(multiplier=0.5)


def test_not_registered_is_recognized_only_for_its_codes() -> None:
    err = not_registered("rollout-3")
    assert "'rollout-3'" in err.message
    assert is_not_registered(DirectPathError(err.code, err.message))
    assert is_not_registered(DirectPathError(grpc.StatusCode.NOT_FOUND, err.message))
    assert not is_not_registered(DirectPathError(grpc.StatusCode.UNAVAILABLE, err.message))
    assert not is_not_registered(DirectPathError(err.code, "version 3 is not newer"))
