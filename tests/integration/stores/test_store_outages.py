"""Redis going away under a reader: a real redis-server killed and started again on the same
port, quant-cache as a subprocess, the direct data path. A short outage is retried with
backoff instead of failing the caller for good; a long one still fails, with UNAVAILABLE."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from services.trainer.remote import QuantCacheRecords
from trace_common.clients import QuantCacheClient
from trace_common.service import Backoff
from trace_common.service.testing import ServiceProcess
from trace_common.stores.redis_local import LocalRedis, LocalRedisConfig

TOKEN = "outage-test-token"
BLOBS = {f"s-{i}": os.urandom(5000 + i) for i in range(4)}


def _restart_later(down_s: float, started: list[LocalRedis]) -> threading.Thread:
    """Start a fresh Redis (nothing persisted) on the first one's port and password after
    `down_s` seconds."""
    config = LocalRedisConfig(port=started[0].port, password=started[0].password)

    def run() -> None:
        time.sleep(down_s)
        server = LocalRedis(config).start()
        started.append(server)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture()
def setup():
    first = LocalRedis().start()
    started = [first]
    svc = ServiceProcess(
        "services.quant_cache", {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_REDIS_URL": first.url}
    ).start()
    try:
        yield svc, started
    finally:
        svc.stop()
        for server in started:
            server.stop()


def test_a_redis_blip_during_a_read_is_retried(setup) -> None:
    svc, started = setup
    client = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
    client.put_many("run", 1, BLOBS)
    assert client.get_records("run", 1, list(BLOBS)) == BLOBS
    started[0].stop()  # Redis gone: connection refused
    writer = _restart_later(0.5, started)

    got = client.get_records("run", 1, list(BLOBS))  # the client's own backoff covers 0.5 s
    writer.join()
    assert got == {}  # a fresh Redis: the records are gone, but the read did not fail
    client.put_many("run", 1, BLOBS)  # the write path reconnects too
    assert client.get_records("run", 1, list(BLOBS)) == BLOBS


def test_the_trainer_reads_through_a_longer_outage_and_a_too_long_one_fails(setup) -> None:
    svc, started = setup
    client = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
    client.put_many("run", 1, BLOBS)
    records = QuantCacheRecords(client, backoff=Backoff(budget_s=20.0, max_s=1.0))
    started[0].stop()
    writer = _restart_later(4.0, started)  # past the client's own 3 s budget

    t0 = time.monotonic()
    assert records.fetch("run", 1, list(BLOBS)) == {}
    writer.join()
    assert records.retries >= 1 and time.monotonic() - t0 >= 4.0

    started[-1].stop()  # down for good: the retries end and UNAVAILABLE is raised
    impatient = QuantCacheRecords(client, backoff=Backoff(budget_s=0.5))
    with pytest.raises(grpc.RpcError) as err:
        impatient.fetch("run", 1, list(BLOBS))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
