"""quant-cache in a subprocess, over a real gRPC socket, against a real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest
import redis

from trace_common.clients import CorruptRecordError, QuantCacheClient
from trace_common.service.testing import ServiceProcess
from trace_common.stores.redis_local import LocalRedis, redact_url

TOKEN = "integration-test-token"

QC = "services.quant_cache"


def _service(redis_url: str, **env: str) -> ServiceProcess:
    return ServiceProcess(QC, {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_REDIS_URL": redis_url, **env})


@pytest.mark.parametrize("data_path", ["grpc", "direct"])
def test_round_trip_corruption_auth_and_http(
    local_redis: LocalRedis, raw_redis: redis.Redis, data_path: str
) -> None:
    with _service(local_redis.url, TRACE_CHUNK_BYTES=str(1 << 20)) as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN, chunk_bytes=1 << 20, data_path=data_path)
        assert qc.path == data_path
        rng = os.urandom
        blobs = {"empty": b"", "one": b"\x00", "small": rng(1000), "chunked": rng((3 << 20) + 7)}
        for sid, blob in blobs.items():
            assert qc.put_records("run-a", 4, sid, blob) == len(blob)
        got = qc.get_records("run-a", 4, [*blobs, "absent"])
        assert set(got) == set(blobs), "the absent sample must be left out"
        for sid, blob in blobs.items():
            assert got[sid] == blob, f"{sid}: round trip is not byte-exact"
        with pytest.raises(KeyError, match="absent"):
            qc.get_records("run-a", 4, ["small", "absent"], missing_ok=False)
        # Another version / run is another namespace.
        assert qc.get_records("run-a", 5, ["small"]) == {}
        assert qc.get_records("run-b", 4, ["small"]) == {}

        # Corrupt records in Redis: flip one byte of the blob, then truncate another.
        key_small = b"trace:qc:run-a:4:small"
        key_chunked = b"trace:qc:run-a:4:chunked"
        value = bytearray(raw_redis.get(key_small))
        value[100] ^= 0x01
        raw_redis.set(key_small, bytes(value))
        raw_redis.set(key_chunked, raw_redis.get(key_chunked)[:-10])
        with pytest.raises(CorruptRecordError) as info:
            qc.get_records("run-a", 4, ["small", "chunked", "one"])
        assert set(info.value.corrupt) == {"small", "chunked"}
        assert "checksum mismatch" in info.value.corrupt["small"]
        assert "truncated" in info.value.corrupt["chunked"]
        assert info.value.records == {"one": b"\x00"}, "valid records still come back"
        stats = qc.stats()
        # the service counts its own gRPC traffic; direct-path clients may not write the stats
        counted = data_path == "grpc"
        assert (stats.corrupt_total, stats.records_put_total) == ((2, 4) if counted else (0, 0))

        # Delete one version, then the whole run.
        qc.put_records("run-a", 5, "x", b"v5")
        assert qc.delete("run-a", version=4) == 4
        assert qc.get_records("run-a", 5, ["x"]) == {"x": b"v5"}
        assert qc.delete("run-a") == 1

        # Auth over the socket: no token, wrong token -> UNAUTHENTICATED; health is open.
        channel = grpc.insecure_channel(svc.grpc_address)
        from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as pb
        from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc as pb_grpc

        stub = pb_grpc.QuantCacheStub(channel)
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Stats(pb.StatsRequest(), metadata=metadata, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        with pytest.raises(grpc.RpcError) as err:
            list(stub.GetRecords(pb.GetRecordsRequest(run_id="r", sample_ids=["s"]), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.PutRecords(iter([pb.PutRecordsChunk()]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()

        # HTTP side.
        assert httpx.get(f"{svc.http_url}/healthz").status_code == 200
        assert httpx.get(f"{svc.http_url}/readyz").json() == {"ready": True}
        metrics = httpx.get(f"{svc.http_url}/metrics").text
        if counted:
            assert "trace_quant_cache_records_put_total 5.0" in metrics
            assert "trace_quant_cache_corrupt_records_total 2.0" in metrics
        assert 'code="UNAUTHENTICATED"' in metrics
        status = httpx.get(f"{svc.http_url}/status").json()
        assert status["component"] == "quant_cache" and status["ttl_seconds"] == 3600
        # the Redis address only with the token (never the password)
        assert status["redis_url"].startswith("hidden") and "127.0.0.1" not in str(status)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        full = httpx.get(f"{svc.http_url}/status", headers=auth).json()
        assert (
            full["redis_url"] == redact_url(local_redis.url)
            and "***@127.0.0.1" in full["redis_url"]
        )
        assert local_redis.password not in httpx.get(f"{svc.http_url}/status", headers=auth).text
        bad = {"Authorization": "Bearer wrong"}
        assert (
            httpx.get(f"{svc.http_url}/status", headers=bad)
            .json()["redis_url"]
            .startswith("hidden")
        )
        assert svc.stop() == 0, "graceful shutdown exits 0"


def test_ttl_expires_records(local_redis: LocalRedis) -> None:
    with _service(local_redis.url, TRACE_TTL_SECONDS="1") as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN, data_path="grpc")
        qc.put_records("run", 0, "s", b"guidance")
        assert qc.get_records("run", 0, ["s"]) == {"s": b"guidance"}
        time.sleep(1.3)
        assert qc.get_records("run", 0, ["s"]) == {}, (
            "documented: a record expires ttl_seconds after its put"
        )
        assert qc.stats().misses_total == 1


RECORD = 256 << 10  # 256 KiB
BOUND = 8 << 20  # 8 MiB maxmemory above Redis's own baseline


def test_memory_bound_evicts_oldest_first(local_redis: LocalRedis, raw_redis: redis.Redis) -> None:
    """Documented default (volatile-ttl): at the bound Redis evicts the oldest records."""
    bound = int(raw_redis.info("memory")["used_memory"]) + BOUND
    env = {
        "TRACE_REDIS_MAXMEMORY_BYTES": str(bound),
        "TRACE_REDIS_MAXMEMORY_POLICY": "volatile-ttl",
    }
    with _service(local_redis.url, **env) as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN)
        n = 3 * BOUND // RECORD  # three times what fits
        blob = os.urandom(RECORD)
        for i in range(n):
            qc.put_records("run", 0, f"s{i:03d}", blob)
            time.sleep(0.002)  # distinct TTL deadlines (ms resolution): oldest = soonest
            assert int(raw_redis.info("memory")["used_memory"]) <= bound + RECORD, "over the bound"
        got = qc.get_records("run", 0, [f"s{i:03d}" for i in range(n)])
        stats = qc.stats()
        assert stats.redis_evicted_keys_total > 0 and stats.redis_maxmemory_bytes == bound
        assert f"s{n - 1:03d}" in got, "the newest record survives"
        assert "s000" not in got, "the oldest record is evicted first"
        kept = sorted(got)
        assert len(kept) < n and all(got[k] == blob for k in kept)
        assert min(int(k[1:]) for k in kept) > n // 3, f"evicted out of age order: kept {kept}"


def test_memory_bound_noeviction_rejects_puts(
    local_redis: LocalRedis, raw_redis: redis.Redis
) -> None:
    """With noeviction a put at the bound fails with RESOURCE_EXHAUSTED; nothing is lost."""
    bound = int(raw_redis.info("memory")["used_memory"]) + (2 << 20)
    env = {"TRACE_REDIS_MAXMEMORY_BYTES": str(bound), "TRACE_REDIS_MAXMEMORY_POLICY": "noeviction"}
    with _service(local_redis.url, **env) as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN)
        blob = os.urandom(RECORD)
        stored = []
        with pytest.raises(grpc.RpcError) as err:
            for i in range(64):
                qc.put_records("run", 0, f"s{i}", blob)
                stored.append(f"s{i}")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "memory bound" in err.value.details()
        assert stored and qc.get_records("run", 0, stored) == dict.fromkeys(stored, blob)


def test_missing_setting_stops_start_up_naming_it(local_redis: LocalRedis) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACE_")}
    env["TRACE_REDIS_URL"] = local_redis.url
    done = subprocess.run(
        [sys.executable, "-m", QC], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "TRACE_AUTH_TOKEN" in done.stderr and "TRACE_AUTH_TOKEN_FILE" in done.stderr


def test_reflection_lists_the_service(local_redis: LocalRedis) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with _service(local_redis.url) as svc, grpc.insecure_channel(svc.grpc_address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "trace.quantcache.v1.QuantCache" in services and "grpc.health.v1.Health" in services
