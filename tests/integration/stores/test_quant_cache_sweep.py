"""quant-cache enforces its TTL and size limit on the server side: its sweep bounds records
that a client wrote into Redis past its library's checks (no TTL, a longer one, oversize, a
hash at a record key), and leaves good records and the stats hash alone."""

from __future__ import annotations

import time

import httpx
import redis

from trace_common.clients import QuantCacheClient
from trace_common.service.testing import ServiceProcess
from trace_common.stores.quant_cache_store import RedisRecordStore, encode, record_pattern
from trace_common.stores.redis_local import LocalRedis

TOKEN = "sweep-token"


def _rogue_writes(raw: redis.Redis) -> None:
    """What a direct-path client ignoring the limits can leave in Redis."""
    raw.set("trace:qc:run:0:forever", encode(b"no ttl"))
    raw.set("trace:qc:run:0:long", encode(b"a year"), ex=365 * 86400)
    raw.set("trace:qc:run:0:huge", encode(b"x" * 5000), ex=60)
    raw.hset("trace:qc:run:0:hash", "field", "value")


def test_sweep_bounds_what_clients_wrote_past_the_limits(
    local_redis: LocalRedis, raw_redis: redis.Redis
) -> None:
    store = RedisRecordStore(raw_redis, "trace:qc", ttl_seconds=600)
    store.put_many([("trace:qc:run:0:good", encode(b"within bounds"))])
    stats = raw_redis.hgetall("trace:qc:#stats")
    raw_redis.set("other:key", b"not ours")
    _rogue_writes(raw_redis)
    counts = store.sweep(max_record_bytes=1000, scan_count=2)  # several SCAN/script steps
    assert counts == {"ttl_set": 2, "deleted_oversize": 1, "deleted_not_a_string": 1}
    assert 0 < raw_redis.ttl("trace:qc:run:0:forever") <= 600
    assert 0 < raw_redis.ttl("trace:qc:run:0:long") <= 600
    assert not raw_redis.exists("trace:qc:run:0:huge", "trace:qc:run:0:hash")
    assert raw_redis.get("trace:qc:run:0:good") == encode(b"within bounds")
    assert raw_redis.hgetall("trace:qc:#stats") == stats != {}, "the stats hash is no record"
    assert raw_redis.ttl("other:key") == -1, "keys outside the prefix are not the service's"
    assert store.sweep(max_record_bytes=1000) == dict.fromkeys(counts, 0), "nothing left to fix"


def test_record_pattern_matches_records_only() -> None:
    assert record_pattern("trace:qc") == "trace:qc:[^#]*"
    assert record_pattern("a*b[1]") == "a\\*b\\[1\\]:[^#]*"


def test_the_service_sweeps_periodically_and_counts_it(
    local_redis: LocalRedis, raw_redis: redis.Redis
) -> None:
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_REDIS_URL": local_redis.url,
           "TRACE_SWEEP_SECONDS": "0.2", "TRACE_MAX_RECORD_BYTES": "1000",
           "TRACE_TTL_SECONDS": "600"}  # fmt: skip
    with ServiceProcess("services.quant_cache", env) as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN)
        qc.put_records("run", 0, "good", b"guidance")
        _rogue_writes(raw_redis)
        deadline = time.monotonic() + 10
        while raw_redis.exists("trace:qc:run:0:huge") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the sweep that deleted it has finished
        assert not raw_redis.exists("trace:qc:run:0:huge", "trace:qc:run:0:hash")
        assert 0 < raw_redis.ttl("trace:qc:run:0:forever") <= 600
        assert qc.get_records("run", 0, ["good"]) == {"good": b"guidance"}
        metrics = httpx.get(f"{svc.http_url}/metrics").text
        for action, n in (("ttl_set", 2), ("deleted_oversize", 1), ("deleted_not_a_string", 1)):
            assert f'trace_quant_cache_swept_records_total{{action="{action}"}} {n}.0' in metrics
        assert "trace_quant_cache_sweep_seconds_count" in metrics
        qc.close()
