"""quant-cache gRPC servicer: validation, chunk assembly, checksum checks, metrics."""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterable, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.quant_cache.store import HEADER_BYTES, Lookup, RecordStore, encode_header
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as pb
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc as pb_grpc
from trace_common.service import (
    Metrics,
    ServiceError,
    check_id,
    check_non_negative,
    exhausted,
    invalid,
)
from trace_common.service.errors import LONG_ID_RE

log = logging.getLogger(__name__)

_STATUS = {
    Lookup.OK: pb.RECORD_STATUS_OK,
    Lookup.MISSING: pb.RECORD_STATUS_MISSING,
    Lookup.CORRUPT: pb.RECORD_STATUS_CORRUPT,
}


class _RedisInfoCollector:
    """Exports Redis's own memory and eviction counters at scrape time."""

    def __init__(self, metrics: Metrics, store: RecordStore) -> None:
        self._name = metrics.name
        self._store = store

    def collect(self) -> Iterator[object]:
        try:
            info = self._store.info()
        except ServiceError:
            return
        yield CounterMetricFamily(
            self._name("redis_evicted_keys"),
            "keys Redis evicted at its memory bound",
            value=info.get("evicted_keys", 0),
        )
        yield CounterMetricFamily(
            self._name("redis_expired_keys"),
            "keys Redis expired (TTL)",
            value=info.get("expired_keys", 0),
        )
        yield GaugeMetricFamily(
            self._name("redis_used_memory_bytes"),
            "Redis used_memory",
            value=info.get("used_memory", 0),
        )
        yield GaugeMetricFamily(
            self._name("redis_maxmemory_bytes"),
            "Redis maxmemory (0 = unbounded)",
            value=info.get("maxmemory", 0),
        )


class QuantCacheServicer(pb_grpc.QuantCacheServicer):
    """Implements trace.quantcache.v1.QuantCache over a RecordStore."""

    def __init__(
        self,
        store: RecordStore,
        metrics: Metrics,
        *,
        max_record_bytes: int,
        max_batch: int,
        chunk_bytes: int,
    ) -> None:
        self.store = store
        self._metrics = metrics
        self.max_record_bytes = max_record_bytes
        self.max_batch = max_batch
        self.chunk_bytes = chunk_bytes
        m = metrics
        self.records_in = m.counter("records_put", "records stored")
        self.bytes_in = m.counter("put_bytes", "record bytes stored")
        self.records_out = m.counter("records_got", "records returned")
        self.bytes_out = m.counter("got_bytes", "record bytes returned")
        self.hits = m.counter("hits", "lookups that found a valid record")
        self.misses = m.counter("misses", "lookups that found no record")
        self.corrupt = m.counter("corrupt_records", "lookups that found a corrupt record")
        self.redis_errors = m.counter("redis_errors", "Redis calls that failed")
        self.put_seconds = m.histogram("put_seconds", "time to receive and store one record")
        self.get_seconds = m.histogram("get_seconds", "time to read, verify and send one record")
        m.registry.register(_RedisInfoCollector(metrics, store))

    # -- PutRecords ---------------------------------------------------------------------
    def PutRecords(
        self, request_iterator: Iterable[pb.PutRecordsChunk], context: grpc.ServicerContext
    ) -> pb.PutRecordsResponse:
        start = time.perf_counter()
        chunks = iter(request_iterator)
        first = next(chunks, None)
        if first is None:
            raise invalid(
                "empty PutRecords stream: the first message must carry key, total_bytes, crc32"
            )
        if not first.HasField("key"):
            raise invalid("the first PutRecords message has no key")
        key = first.key
        self._check_key(key.run_id, key.policy_version)
        check_id("sample_id", key.sample_id, LONG_ID_RE)
        total = first.total_bytes
        if total > self.max_record_bytes:
            raise exhausted(
                f"record {key.sample_id!r} is {total} bytes, over max_record_bytes={self.max_record_bytes}"
            )
        value = memoryview(bytearray(HEADER_BYTES + total))  # header + blob, filled in place
        received = 0
        for chunk in _prepend(first, chunks):
            if chunk is not first and chunk.HasField("key") and chunk.key != key:
                raise invalid(
                    f"one record per stream: got key {chunk.key.sample_id!r} after {key.sample_id!r}"
                )
            n = len(chunk.data)
            if received + n > total:
                raise invalid(f"record {key.sample_id!r}: more data than total_bytes={total}")
            value[HEADER_BYTES + received : HEADER_BYTES + received + n] = chunk.data
            received += n
        if received != total:
            raise invalid(
                f"record {key.sample_id!r}: stream ended after {received} of total_bytes={total}"
            )
        blob = value[HEADER_BYTES:]
        actual = zlib.crc32(blob)
        if actual != first.crc32:
            raise ServiceError(
                grpc.StatusCode.DATA_LOSS,
                f"record {key.sample_id!r}: crc32 {actual:#010x} of received data != declared {first.crc32:#010x}",
            )
        value[:HEADER_BYTES] = encode_header(actual, total)
        self._redis(
            lambda: self.store.put(
                self.store.key(key.run_id, key.policy_version, key.sample_id), value
            )
        )
        self.records_in.inc()
        self.bytes_in.inc(total)
        self.put_seconds.observe(time.perf_counter() - start)
        return pb.PutRecordsResponse(
            key=key, stored_bytes=total, ttl_seconds=self.store.ttl_seconds
        )

    # -- GetRecords ---------------------------------------------------------------------
    def GetRecords(
        self, request: pb.GetRecordsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetRecordsChunk]:
        self._check_key(request.run_id, request.policy_version)
        ids = list(request.sample_ids)
        if not ids:
            raise invalid("sample_ids is empty")
        if len(ids) > self.max_batch:
            raise exhausted(
                f"{len(ids)} sample_ids in one request, over max_batch={self.max_batch}"
            )
        for sid in ids:
            check_id("sample_id", sid, LONG_ID_RE)
        if len(set(ids)) != len(ids):
            dup = sorted({s for s in ids if ids.count(s) > 1})
            raise invalid(f"duplicate sample_ids: {dup}")
        for sid in ids:
            start = time.perf_counter()
            found = self._redis(
                lambda sid=sid: self.store.get(
                    self.store.key(request.run_id, request.policy_version, sid)
                )
            )
            if found.status is not Lookup.OK:
                (self.misses if found.status is Lookup.MISSING else self.corrupt).inc()
                if found.status is Lookup.CORRUPT:
                    log.error(
                        "corrupt record",
                        extra={
                            "run_id": request.run_id,
                            "policy_version": request.policy_version,
                            "sample_id": sid,
                            "detail": found.detail,
                        },
                    )
                yield pb.GetRecordsChunk(
                    sample_id=sid, status=_STATUS[found.status], detail=found.detail
                )
                continue
            blob = found.blob
            assert blob is not None
            total = len(blob)
            step = self.chunk_bytes
            yield pb.GetRecordsChunk(
                sample_id=sid,
                status=pb.RECORD_STATUS_OK,
                total_bytes=total,
                crc32=found.crc32,
                offset=0,
                data=bytes(blob[:step]),
            )
            for offset in range(step, total, step):
                yield pb.GetRecordsChunk(
                    sample_id=sid, offset=offset, data=bytes(blob[offset : offset + step])
                )
            self.hits.inc()
            self.records_out.inc()
            self.bytes_out.inc(total)
            self.get_seconds.observe(time.perf_counter() - start)

    # -- Delete / Stats -------------------------------------------------------------------
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        check_id("run_id", request.run_id)
        version = request.policy_version if request.HasField("policy_version") else None
        if version is not None:
            check_non_negative("policy_version", version)
        deleted = self._redis(lambda: self.store.delete(request.run_id, version))
        log.info(
            "deleted records",
            extra={"run_id": request.run_id, "policy_version": version, "deleted": deleted},
        )
        return pb.DeleteResponse(deleted_records=deleted)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        info = self._redis(self.store.info)
        return pb.StatsResponse(
            records_put_total=self._total("records_put"),
            bytes_put_total=self._total("put_bytes"),
            records_got_total=self._total("records_got"),
            bytes_got_total=self._total("got_bytes"),
            hits_total=self._total("hits"),
            misses_total=self._total("misses"),
            corrupt_total=self._total("corrupt_records"),
            redis_used_memory_bytes=int(info.get("used_memory", 0)),
            redis_maxmemory_bytes=int(info.get("maxmemory", 0)),
            redis_maxmemory_policy=str(info.get("maxmemory_policy", "")),
            redis_evicted_keys_total=int(info.get("evicted_keys", 0)),
            redis_expired_keys_total=int(info.get("expired_keys", 0)),
            redis_keys=int(info.get("keys", 0)),
            ttl_seconds=self.store.ttl_seconds,
            max_record_bytes=self.max_record_bytes,
        )

    # -- helpers ----------------------------------------------------------------------------
    def _total(self, what: str) -> int:
        value = self._metrics.registry.get_sample_value(f"{self._metrics.name(what)}_total")
        return int(value or 0)

    def _check_key(self, run_id: str, version: int) -> None:
        check_id("run_id", run_id)
        check_non_negative("policy_version", version)

    def _redis(self, call):
        try:
            return call()
        except ServiceError as err:
            if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                self.redis_errors.inc()
            raise


def _prepend(
    first: pb.PutRecordsChunk, rest: Iterator[pb.PutRecordsChunk]
) -> Iterator[pb.PutRecordsChunk]:
    yield first
    yield from rest
