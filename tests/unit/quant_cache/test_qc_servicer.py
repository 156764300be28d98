"""QuantCacheServicer in-process with hand-built messages: the validation matrix."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import grpc
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.quant_cache.servicer import QuantCacheServicer
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as pb
from trace_common.service import Metrics, ServiceError
from trace_common.stores.quant_cache_store import (
    HEADER_BYTES,
    LAYOUT_VERSION,
    Lookup,
    RedisRecordStore,
    decode,
    encode_header,
)
from trace_common.stores.redis_local import LocalRedis

MAX_RECORD = 1000
MAX_BATCH = 4


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


@pytest.fixture()
def servicer(redis_url: str) -> Iterator[QuantCacheServicer]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield QuantCacheServicer(
        RedisRecordStore(client, "t:qc", ttl_seconds=60, piece_bytes=7),
        Metrics("quant_cache"),
        max_record_bytes=MAX_RECORD,
        max_batch=MAX_BATCH,
        data_plane_url=redis_url,
    )
    client.close()


def key(run: str = "run", version: int = 1, sample: str = "s") -> pb.RecordKey:
    return pb.RecordKey(run_id=run, policy_version=version, sample_id=sample)


def put(servicer: QuantCacheServicer, chunks: list[pb.PutRecordsChunk]) -> pb.PutRecordsResponse:
    return servicer.PutRecords(iter(chunks), None)


def first(
    data: bytes, k: pb.RecordKey | None = None, total: int | None = None, crc: int | None = None
) -> pb.PutRecordsChunk:
    return pb.PutRecordsChunk(
        key=k or key(),
        total_bytes=len(data) if total is None else total,
        crc32=zlib.crc32(data) if crc is None else crc,
        data=data,
    )


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServiceError) as err:
        fn()
    return err.value.code, err.value.message


def get(servicer: QuantCacheServicer, request: pb.GetRecordsRequest) -> list[pb.GetRecordsChunk]:
    """GetRecords' messages, parsed (data chunks come serialized: chunk_wire)."""
    return [
        pb.GetRecordsChunk.FromString(m) if isinstance(m, bytes) else m
        for m in servicer.GetRecords(request, None)
    ]


def test_put_get_chunks_and_stats(servicer: QuantCacheServicer) -> None:
    data = bytes(range(20))
    response = put(
        servicer,
        [first(data[:5], total=20, crc=zlib.crc32(data)), pb.PutRecordsChunk(data=data[5:])],
    )
    assert (response.records, response.stored_bytes, response.ttl_seconds) == (1, 20, 60)
    chunks = get(
        servicer, pb.GetRecordsRequest(run_id="run", policy_version=1, sample_ids=["s", "nope"])
    )
    # 20 bytes in chunks of 7: 3 chunks for "s", then one MISSING for "nope".
    assert [c.sample_id for c in chunks] == ["s", "s", "s", "nope"]
    assert [c.offset for c in chunks[:3]] == [0, 7, 14]
    assert b"".join(c.data for c in chunks[:3]) == data and chunks[0].crc32 == zlib.crc32(data)
    assert (
        chunks[0].status == pb.RECORD_STATUS_OK and chunks[1].status == pb.RECORD_STATUS_UNSPECIFIED
    )
    assert chunks[3].status == pb.RECORD_STATUS_MISSING
    stats = servicer.Stats(pb.StatsRequest(), None)
    assert (
        stats.records_put_total,
        stats.bytes_put_total,
        stats.hits_total,
        stats.misses_total,
    ) == (1, 20, 1, 1)


def test_many_records_in_one_stream_and_partial_failure(servicer: QuantCacheServicer) -> None:
    blobs = {f"s{i}": bytes([i]) * (i * 300) for i in range(4)}
    chunks = [first(b, key(sample=s)) for s, b in blobs.items()]
    response = put(servicer, chunks)
    assert response.records == 4 and response.stored_bytes == sum(map(len, blobs.values()))
    got = get(
        servicer, pb.GetRecordsRequest(run_id="run", policy_version=1, sample_ids=list(blobs))
    )
    joined: dict[str, bytes] = {}
    for c in got:
        joined[c.sample_id] = joined.get(c.sample_id, b"") + c.data
    assert joined == blobs
    # A bad record in the middle: the ones before it are stored, the error names it.
    bad = [
        first(b"ok", key(sample="before")),
        first(b"x", key(sample="bad"), crc=1),
        first(b"z", key(sample="after")),
    ]
    code, message = code_of(lambda: put(servicer, bad))
    assert code == grpc.StatusCode.DATA_LOSS and "'bad'" in message
    got = get(
        servicer,
        pb.GetRecordsRequest(run_id="run", policy_version=1, sample_ids=["before", "bad", "after"]),
    )
    assert [c.status for c in got] == [
        pb.RECORD_STATUS_OK,
        pb.RECORD_STATUS_MISSING,
        pb.RECORD_STATUS_MISSING,
    ]


@pytest.mark.parametrize(
    ("chunks", "code", "needle"),
    [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "empty PutRecords stream"),
        ([pb.PutRecordsChunk(data=b"x")], grpc.StatusCode.INVALID_ARGUMENT, "no key"),
        ([first(b"x", key(run=""))], grpc.StatusCode.INVALID_ARGUMENT, "run_id=''"),
        ([first(b"x", key(run="a:b"))], grpc.StatusCode.INVALID_ARGUMENT, "run_id='a:b'"),
        ([first(b"x", key(run="r*"))], grpc.StatusCode.INVALID_ARGUMENT, "run_id='r*'"),
        ([first(b"x", key(version=-1))], grpc.StatusCode.INVALID_ARGUMENT, "policy_version=-1"),
        ([first(b"x", key(sample="s/1"))], grpc.StatusCode.INVALID_ARGUMENT, "sample_id='s/1'"),
        (
            [first(b"x", total=MAX_RECORD + 1)],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"max_record_bytes={MAX_RECORD}",
        ),
        ([first(b"xy", total=1)], grpc.StatusCode.INVALID_ARGUMENT, "more data than total_bytes=1"),
        (
            [first(b"x", total=3)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "stream ended after 1 of total_bytes=3",
        ),
        ([first(b"x", crc=123)], grpc.StatusCode.DATA_LOSS, "crc32"),
        (
            [first(b"x", total=2), first(b"y", key(sample="other"))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "record 's': stream ended after 1 of total_bytes=2",
        ),
    ],
)
def test_put_rejects_bad_input(
    servicer: QuantCacheServicer, chunks: list, code: grpc.StatusCode, needle: str
) -> None:
    got_code, message = code_of(lambda: put(servicer, chunks))
    assert got_code == code and needle in message, message
    assert servicer.Stats(pb.StatsRequest(), None).redis_keys == 0, "nothing stored"


@pytest.mark.parametrize(
    ("request_", "code", "needle"),
    [
        (
            pb.GetRecordsRequest(run_id="run", sample_ids=[]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sample_ids is empty",
        ),
        (
            pb.GetRecordsRequest(run_id="", sample_ids=["s"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "run_id=''",
        ),
        (
            pb.GetRecordsRequest(run_id="r", policy_version=-3, sample_ids=["s"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "policy_version=-3",
        ),
        (
            pb.GetRecordsRequest(run_id="r", sample_ids=["ok", "b a d"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sample_id='b a d'",
        ),
        (
            pb.GetRecordsRequest(run_id="r", sample_ids=["a", "a"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "duplicate sample_ids: ['a']",
        ),
        (
            pb.GetRecordsRequest(run_id="r", sample_ids=[f"s{i}" for i in range(MAX_BATCH + 1)]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"max_batch={MAX_BATCH}",
        ),
    ],
)
def test_get_rejects_bad_input(
    servicer: QuantCacheServicer, request_: pb.GetRecordsRequest, code: grpc.StatusCode, needle: str
) -> None:
    got_code, message = code_of(lambda: get(servicer, request_))
    assert got_code == code and needle in message, message


def test_delete_validation_and_scope(servicer: QuantCacheServicer) -> None:
    assert (
        code_of(lambda: servicer.Delete(pb.DeleteRequest(run_id="a b"), None))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        code_of(lambda: servicer.Delete(pb.DeleteRequest(run_id="r", policy_version=-1), None))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    for run, version in [("r", 1), ("r", 2), ("r2", 1), ("r.1", 1)]:
        put(servicer, [first(b"abc", key(run=run, version=version))])
    assert (
        servicer.Delete(pb.DeleteRequest(run_id="r", policy_version=1), None).deleted_records == 1
    )
    assert servicer.Delete(pb.DeleteRequest(run_id="r"), None).deleted_records == 1
    # "r" never matches "r2" or "r.1": keys end each id with ':'. The stats hash stays.
    assert servicer.Stats(pb.StatsRequest(), None).redis_keys == 2 + 1
    assert servicer.Stats(pb.StatsRequest(), None).records_put_total == 4


def test_redis_down_is_unavailable(redis_url: str) -> None:
    dead = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    s = QuantCacheServicer(
        RedisRecordStore(dead, "t", 60, piece_bytes=4),
        Metrics("quant_cache"),
        max_record_bytes=10,
        max_batch=2,
    )
    code, message = code_of(lambda: put(s, [first(b"x")]))
    assert code == grpc.StatusCode.UNAVAILABLE and "Redis error" in message


def test_decode_detects_corruption() -> None:
    blob = b"records!"
    good = encode_header(zlib.crc32(blob), len(blob)) + blob
    assert decode(good).status is Lookup.OK and decode(good).blob() == blob
    flipped = bytearray(good)
    flipped[HEADER_BYTES] ^= 0x80
    assert decode(bytes(flipped)).status is Lookup.CORRUPT
    assert "truncated" in decode(good[:-1]).detail
    assert "shorter than the header" in decode(good[:5]).detail
    assert "bad magic" in decode(b"XXXX" + good[4:]).detail


def test_get_data_plane(servicer: QuantCacheServicer, redis_url: str) -> None:
    plane = servicer.GetDataPlane(pb.GetDataPlaneRequest(layout_version=LAYOUT_VERSION), None)
    assert (plane.redis_url, plane.key_prefix, plane.ttl_seconds) == (redis_url, "t:qc", 60)
    assert (plane.max_record_bytes, plane.piece_bytes) == (MAX_RECORD, 7)
    assert plane.layout_version == LAYOUT_VERSION
    code, message = code_of(lambda: servicer.GetDataPlane(pb.GetDataPlaneRequest(), None))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "layout_version=0" in message
    other = pb.GetDataPlaneRequest(layout_version=LAYOUT_VERSION + 1)
    code, message = code_of(lambda: servicer.GetDataPlane(other, None))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"layout_version={LAYOUT_VERSION + 1}" in message
    servicer.data_plane_url = None  # TRACE_DATA_PLANE_ENABLED=false
    request = pb.GetDataPlaneRequest(layout_version=LAYOUT_VERSION)
    code, message = code_of(lambda: servicer.GetDataPlane(request, None))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "DATA_PLANE_ENABLED" in message


class _RewriteAfterFirstRound:
    """A redis client whose first pipeline execute is followed by a rewrite of `key`."""

    def __init__(self, client: redis.Redis, key: str, value: bytes) -> None:
        self._client, self._key, self._value, self._done = client, key, value, False

    def pipeline(self, transaction: bool = False):
        pipe = self._client.pipeline(transaction=transaction)
        execute = pipe.execute

        def execute_then_rewrite(**kwargs):
            replies = execute(**kwargs)
            if not self._done:
                self._done = True
                self._client.set(self._key, self._value)
            return replies

        pipe.execute = execute_then_rewrite
        return pipe

    def __getattr__(self, name: str):
        return getattr(self._client, name)


@pytest.mark.parametrize("new_size", [50, 30], ids=["same-length", "other-length"])
def test_get_many_rereads_a_record_rewritten_between_round_trips(
    redis_url: str, new_size: int
) -> None:
    """A multi-piece record rewritten between get_many's two round trips is read again
    (never reported corrupt, never returned as a mix of the two writes)."""
    from trace_common.stores.quant_cache_store import encode

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    old, new = bytes(range(50)), bytes(range(100, 100 + new_size))
    store = RedisRecordStore(client, "t:qc", ttl_seconds=60, piece_bytes=8)
    store.put_many([(store.key("r", 0, "s"), encode(old))])
    racing = RedisRecordStore(
        _RewriteAfterFirstRound(client, store.key("r", 0, "s"), encode(new)),  # type: ignore[arg-type]
        "t:qc",
        ttl_seconds=60,
        piece_bytes=8,
    )
    [found] = racing.get_many([store.key("r", 0, "s")])
    assert found.status is Lookup.OK, found.detail
    assert found.blob() == new, "the record as written last, read again whole"
    assert store.stats()["hits"] == 1, "one lookup counted once"
    client.close()


def test_a_key_redis_refuses_fails_only_that_key(servicer: QuantCacheServicer) -> None:
    """WRONGTYPE (something wrote a hash where a record belongs) is that sample's problem:
    reported CORRUPT with Redis's words, the other samples of the batch are served."""
    good = bytes(range(30))  # several pieces of 7: the second round trip too
    put(servicer, [first(good, k=key(sample="good"))])
    put(servicer, [first(b"abc", k=key(sample="small"))])
    servicer.store.client.hset("t:qc:run:1:bad", "field", "value")
    chunks = get(
        servicer,
        pb.GetRecordsRequest(run_id="run", policy_version=1, sample_ids=["good", "bad", "small"]),
    )
    status = {c.sample_id: c.status for c in chunks if c.status != pb.RECORD_STATUS_UNSPECIFIED}
    assert status == {
        "good": pb.RECORD_STATUS_OK,
        "bad": pb.RECORD_STATUS_CORRUPT,
        "small": pb.RECORD_STATUS_OK,
    }
    (bad,) = [c for c in chunks if c.sample_id == "bad"]
    assert "WRONGTYPE" in bad.detail and "Redis refused the key" in bad.detail
    assert b"".join(c.data for c in chunks if c.sample_id == "good") == good
