"""quant-cache's direct data path: the client reads and writes Redis itself with the
coordinates from GetDataPlane, in the service's layout; the service (a subprocess) stays
the control plane. Real Redis, real gRPC socket."""

from __future__ import annotations

import os
import time

import grpc
import httpx
import pytest
import redis

from trace_common.clients import CorruptRecordError, DirectPathError, QuantCacheClient
from trace_common.clients.quant_cache import REPLAYED, new_generation
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as pb
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc as pb_grpc
from trace_common.service.testing import ServiceProcess
from trace_common.stores.quant_cache_store import LAYOUT_VERSION
from trace_common.stores.redis_local import LocalRedis

TOKEN = "direct-test-token"


def _service(redis_url: str, **env: str) -> ServiceProcess:
    return ServiceProcess(
        "services.quant_cache", {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_REDIS_URL": redis_url, **env}
    )


def test_direct_and_grpc_paths_share_records_counters_ttl_and_delete(
    local_redis: LocalRedis, raw_redis: redis.Redis
) -> None:
    with _service(local_redis.url, TRACE_CHUNK_BYTES=str(256 << 10)) as svc:
        direct = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
        via_grpc = QuantCacheClient(svc.grpc_address, TOKEN, data_path="grpc")
        auto = QuantCacheClient(svc.grpc_address, TOKEN)
        assert (direct.path, via_grpc.path, auto.path) == ("direct", "grpc", "direct")

        blobs = {"empty": b"", "small": os.urandom(999), "pieces": os.urandom((1 << 20) + 3)}
        # Direct round trip, byte-exact (the 1 MiB record is read as 256 KiB GETRANGEs).
        assert direct.put_many("run", 1, blobs) == sum(map(len, blobs.values()))
        assert direct.get_records("run", 1, list(blobs)) == blobs
        # Written directly -> read through the service, and the other way round.
        assert via_grpc.get_records("run", 1, list(blobs)) == blobs
        assert via_grpc.put_many("run", 2, blobs) == sum(map(len, blobs.values()))
        assert direct.get_records("run", 2, list(blobs)) == blobs

        # TTL: direct puts carry the service's TTL.
        ttl = raw_redis.ttl("trace:qc:run:1:small")
        assert 3500 < ttl <= 3600, (
            f"direct-written record has TTL {ttl}, expected the service's 3600"
        )

        # Missing and corrupt records, detected on the direct path.
        with pytest.raises(KeyError, match="absent"):
            direct.get_records("run", 1, ["small", "absent"], missing_ok=False)
        value = bytearray(raw_redis.get("trace:qc:run:1:pieces"))
        value[(1 << 20) - 5] ^= 0x10  # a byte in the fourth piece
        raw_redis.set("trace:qc:run:1:pieces", bytes(value))
        raw_redis.set("trace:qc:run:1:small", raw_redis.get("trace:qc:run:1:small")[:-1])
        with pytest.raises(CorruptRecordError) as info:
            direct.get_records("run", 1, list(blobs))
        assert "checksum mismatch" in info.value.corrupt["pieces"]
        assert "truncated" in info.value.corrupt["small"]
        assert info.value.records == {"empty": b""}, "valid records still come back"

        # The service's counters and metrics cover its gRPC path (the stats hash in Redis,
        # which direct-path clients may not write).
        stats = direct.stats()
        assert stats.records_put_total == 3 and stats.corrupt_total == 0
        assert stats.misses_total == 0 and stats.hits_total == 3
        metrics = httpx.get(f"{svc.http_url}/metrics").text
        assert "trace_quant_cache_records_put_total 3.0" in metrics
        via_grpc.get_records("run", 1, ["empty"])
        assert direct.stats().hits_total == 4

        # Delete (through the service) removes direct-written records.
        assert direct.delete("run", version=1) == 3
        assert direct.get_records("run", 1, list(blobs)) == {}
        assert direct.get_records("run", 2, ["small"]) == {"small": blobs["small"]}
        assert via_grpc.delete("run") == 3
        # The same bytes in Redis whichever path wrote them (under the same generation).
        generation = new_generation()
        direct.put_many("run", 3, blobs, generation=generation)
        by_direct = {sid: raw_redis.get(f"trace:qc:run:3:{sid}") for sid in blobs}
        via_grpc.put_many("run", 3, blobs, generation=generation)
        assert {sid: raw_redis.get(f"trace:qc:run:3:{sid}") for sid in blobs} == by_direct
        for qc in (direct, via_grpc, auto):
            qc.close()


def test_direct_ttl_expires_records(local_redis: LocalRedis) -> None:
    with _service(local_redis.url, TRACE_TTL_SECONDS="1") as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
        qc.put_records("run", 0, "s", b"guidance")
        assert qc.get_records("run", 0, ["s"]) == {"s": b"guidance"}
        time.sleep(1.3)
        assert qc.get_records("run", 0, ["s"]) == {}, "expires ttl_seconds after the put"


def test_direct_path_rejects_bad_input_like_the_service(local_redis: LocalRedis) -> None:
    with _service(local_redis.url, TRACE_MAX_RECORD_BYTES="100") as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
        cases = [
            (lambda: qc.put_records("a:b", 0, "s", b"x"), "INVALID_ARGUMENT", "run_id='a:b'"),
            (lambda: qc.put_records("r", -1, "s", b"x"), "INVALID_ARGUMENT", "policy_version=-1"),
            (lambda: qc.put_records("r", 0, "s/1", b"x"), "INVALID_ARGUMENT", "sample_id='s/1'"),
            (lambda: qc.put_records("r", 0, "s", b"x" * 101), "RESOURCE_EXHAUSTED", "max_record_bytes=100"),
            (lambda: qc.get_records("r", 0, ["a", "a"]), "INVALID_ARGUMENT", "duplicate sample_ids: ['a']"),
            (lambda: qc.get_records("r", 0, []), "INVALID_ARGUMENT", "sample_ids is empty"),
        ]  # fmt: skip
        for call, code, needle in cases:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert isinstance(err.value, DirectPathError)
            assert err.value.code().name == code and needle in err.value.details(), err.value
        # A bad record after good ones: the good ones are stored (as on the gRPC path).
        with pytest.raises(DirectPathError, match="sample_id='b d'"):
            qc.put_many("r", 0, {"ok": b"1", "b d": b"2"})
        assert qc.get_records("r", 0, ["ok"]) == {"ok": b"1"}


def test_get_data_plane_auth_and_arguments(local_redis: LocalRedis) -> None:
    with _service(local_redis.url) as svc, grpc.insecure_channel(svc.grpc_address) as channel:
        stub = pb_grpc.QuantCacheStub(channel)
        good = pb.GetDataPlaneRequest(layout_version=LAYOUT_VERSION)
        for metadata in [(), (("authorization", "Bearer wrong"),)]:
            with pytest.raises(grpc.RpcError) as err:
                stub.GetDataPlane(good, metadata=metadata, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        with pytest.raises(grpc.RpcError) as err:
            QuantCacheClient(svc.grpc_address, "wrong-token").path  # noqa: B018
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        auth = (("authorization", f"Bearer {TOKEN}"),)
        plane = stub.GetDataPlane(good, metadata=auth, timeout=5)
        # not the service's own credentials: a user limited to the record keys and to data
        # commands
        assert plane.redis_url != local_redis.url and plane.key_prefix == "trace:qc"
        assert plane.redis_url.startswith("redis://trace-data-plane:")
        limited = redis.Redis.from_url(plane.redis_url)
        limited.set("trace:qc:probe", b"123", ex=5)
        assert limited.strlen("trace:qc:probe") == 3
        assert limited.getrange("trace:qc:probe", 0, 1) == b"12" and limited.ping()
        for refused in (
            lambda: limited.set("other:key", b"1"),  # outside the prefix
            lambda: limited.hincrby("trace:qc:#stats", "records_put", 10**9),  # the counters
            lambda: limited.set("trace:qc:#stats", b"1"),
            lambda: limited.get("trace:qc:probe"),  # a command the direct path does not use
            lambda: limited.delete("trace:qc:probe"),
            lambda: limited.setrange("trace:qc:probe", 0, b"x"),
            lambda: limited.expire("trace:qc:probe", 10**6),
            lambda: limited.lpush("trace:qc:list", b"1"),
            limited.flushall,
            lambda: limited.config_get("*"),
            lambda: limited.keys("*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
        limited.close()
        assert plane.ttl_seconds == 3600 and plane.layout_version == LAYOUT_VERSION
        with pytest.raises(grpc.RpcError) as err:
            stub.GetDataPlane(pb.GetDataPlaneRequest(), metadata=auth, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layout_version=0" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            other = pb.GetDataPlaneRequest(layout_version=LAYOUT_VERSION + 7)
            stub.GetDataPlane(other, metadata=auth, timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"layout_version={LAYOUT_VERSION + 7}" in err.value.details()


def test_auto_falls_back_to_grpc(local_redis: LocalRedis) -> None:
    """Data plane off, or its Redis unreachable from the client: auto uses gRPC, direct fails."""
    with _service(local_redis.url, TRACE_DATA_PLANE_ENABLED="false") as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN)
        assert qc.path == "grpc"
        qc.put_records("run", 0, "s", b"via the service")
        assert qc.get_records("run", 0, ["s"]) == {"s": b"via the service"}
        with pytest.raises(grpc.RpcError) as err:
            QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct").path  # noqa: B018
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "DATA_PLANE_ENABLED" in err.value.details()
    unreachable = "redis://:secret@127.0.0.1:1/0"
    with _service(local_redis.url, TRACE_DATA_PLANE_REDIS_URL=unreachable) as svc:
        qc = QuantCacheClient(svc.grpc_address, TOKEN)
        assert qc.path == "grpc"
        assert qc.get_records("run", 0, ["s"]) == {"s": b"via the service"}
        with pytest.raises(DirectPathError) as err:
            QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct").path  # noqa: B018
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "127.0.0.1:1" in err.value.details() and "secret" not in err.value.details()


def test_records_written_without_the_token_are_refused(
    local_redis: LocalRedis, raw_redis: redis.Redis
) -> None:
    """A record overwritten in Redis with a valid layout and CRC, or copied from another key,
    or written by a client holding another token, fails its tag on both paths."""
    from trace_common.stores.quant_cache_store import encode

    with _service(local_redis.url) as svc:
        direct = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
        via_grpc = QuantCacheClient(svc.grpc_address, TOKEN, data_path="grpc")
        direct.put_many("run", 0, {"a": b"guidance-a", "b": b"guidance-b", "c": b"guidance-c"})
        forged = b"\0" * 32 + b"forged guidance"  # valid layout and CRC, no valid tag
        raw_redis.set("trace:qc:run:0:a", encode(forged))
        raw_redis.set("trace:qc:run:0:b", raw_redis.get("trace:qc:run:0:c"))  # c's bytes at b
        for qc in (direct, via_grpc):
            with pytest.raises(CorruptRecordError) as err:
                qc.get_records("run", 0, ["a", "b", "c"])
            assert set(err.value.corrupt) == {"a", "b"}, err.value.corrupt
            assert "tag mismatch" in err.value.corrupt["a"]
            assert err.value.records == {"c": b"guidance-c"}, "good records still come back"
        # another deployment's token: its writes do not verify here
        svc_env_token = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
        other = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
        other._tag_key = b"\1" * 32  # stands for a client keyed from a different token
        other.put_records("run", 1, "x", b"from elsewhere")
        with pytest.raises(CorruptRecordError, match="tag mismatch"):
            svc_env_token.get_records("run", 1, ["x"])
        for qc in (direct, via_grpc, svc_env_token, other):
            qc.close()


def test_a_replayed_older_write_is_refused_by_its_generation(
    local_redis: LocalRedis, raw_redis: redis.Redis
) -> None:
    """Genuine bytes of an older write, put back at the same key, verify by their tag alone,
    but a reader expecting the newer write's generation refuses them on both paths."""
    with _service(local_redis.url) as svc:
        direct = QuantCacheClient(svc.grpc_address, TOKEN, data_path="direct")
        via_grpc = QuantCacheClient(svc.grpc_address, TOKEN, data_path="grpc")
        old_gen, new_gen = new_generation(), new_generation()
        direct.put_records("run", 0, "a", b"old guidance", generation=old_gen)
        old_bytes = raw_redis.get("trace:qc:run:0:a")
        via_grpc.put_records("run", 0, "a", b"new guidance", generation=new_gen)
        direct.put_records("run", 0, "b", b"guidance-b", generation=new_gen)
        for qc in (direct, via_grpc):
            assert qc.get_records("run", 0, ["a"], generations={"a": new_gen}) == {
                "a": b"new guidance"}  # fmt: skip
        raw_redis.set("trace:qc:run:0:a", old_bytes)  # the replay
        for qc in (direct, via_grpc):
            assert qc.get_records("run", 0, ["a"]) == {"a": b"old guidance"}, "tag alone: genuine"
            with pytest.raises(CorruptRecordError) as err:
                qc.get_records("run", 0, ["a", "b"], generations={"a": new_gen, "b": new_gen})
            assert err.value.corrupt == {"a": REPLAYED}
            assert err.value.records == {"b": b"guidance-b"}
        with pytest.raises(ValueError, match="16 bytes, got 3"):
            direct.put_records("run", 0, "c", b"x", generation=b"abc")
        for qc in (direct, via_grpc):
            qc.close()
