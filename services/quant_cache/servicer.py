"""quant-cache gRPC servicer: validation, chunk assembly, checksum checks, metrics."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.quant_cache.store import HEADER_BYTES, Found, Lookup, RecordStore, encode_header
from trace_common.checksum import crc32
from trace_common.chunk_wire import bytes_field_codec, with_bytes_field
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

PUT_FLUSH_BYTES = 8 << 20  # write complete records to Redis in pipelines of about this size
GET_GROUP_BYTES = 8 << 20  # read records with one MGET per about this many bytes
GET_MAX_GROUP = 64  # most keys in one MGET

PUT_DATA_FIELD = pb.PutRecordsChunk.DESCRIPTOR.fields_by_name["data"].number  # 4
GET_DATA_FIELD = pb.GetRecordsChunk.DESCRIPTOR.fields_by_name["data"].number  # 6
PUT_DESERIALIZE, _ = bytes_field_codec(pb.PutRecordsChunk, PUT_DATA_FIELD)
_, GET_SERIALIZE = bytes_field_codec(pb.GetRecordsChunk, GET_DATA_FIELD)
# PutRecords data arrives as a view into the received message (no protobuf copies) and
# GetRecords sends messages serialized by _send: GrpcServer.add(codecs=CODECS).
CODECS = {
    "PutRecords": {"request_deserializer": PUT_DESERIALIZE},
    "GetRecords": {"response_serializer": GET_SERIALIZE},
}

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
        self.put_seconds = m.histogram(
            "put_seconds", "time to receive and store one PutRecords stream"
        )
        self.get_seconds = m.histogram(
            "get_seconds", "time to read, verify and send one group of records"
        )
        m.registry.register(_RedisInfoCollector(metrics, store))

    # -- PutRecords ---------------------------------------------------------------------
    def PutRecords(
        self, request_iterator: Iterable[pb.PutRecordsChunk], context: grpc.ServicerContext
    ) -> pb.PutRecordsResponse:
        start = time.perf_counter()
        pending: list[tuple[str, memoryview]] = []  # complete records not yet written
        pending_bytes = 0
        totals = [0, 0]  # records, bytes stored
        current: _Assembly | None = None
        try:
            for chunk in request_iterator:
                if chunk.HasField("key"):
                    if current is not None:
                        pending.append(current.finish(self.store))
                        pending_bytes += current.total
                    current = self._start(chunk)
                elif current is None:
                    raise invalid("the first PutRecords message has no key")
                current.add(chunk.data)
                if pending_bytes >= PUT_FLUSH_BYTES:
                    self._flush(pending, totals)
                    pending_bytes = 0
            if current is None:
                raise invalid(
                    "empty PutRecords stream: the first message must carry key, total_bytes, crc32"
                )
            pending.append(current.finish(self.store))
        except BaseException:
            # Records completed before the failing one are kept (documented in the proto).
            with contextlib.suppress(ServiceError):
                self._flush(pending, totals)
            raise
        self._flush(pending, totals)
        self.put_seconds.observe(time.perf_counter() - start)
        return pb.PutRecordsResponse(
            records=totals[0], stored_bytes=totals[1], ttl_seconds=self.store.ttl_seconds
        )

    def _start(self, chunk: pb.PutRecordsChunk) -> _Assembly:
        key = chunk.key
        self._check_key(key.run_id, key.policy_version)
        check_id("sample_id", key.sample_id, LONG_ID_RE)
        if chunk.total_bytes > self.max_record_bytes:
            raise exhausted(
                f"record {key.sample_id!r} is {chunk.total_bytes} bytes, over max_record_bytes={self.max_record_bytes}"
            )
        return _Assembly(key, chunk.total_bytes, chunk.crc32)

    def _flush(self, pending: list[tuple[str, memoryview]], totals: list[int]) -> None:
        if not pending:
            return
        self._redis(lambda: self.store.put_many(pending))
        nbytes = sum(len(v) - HEADER_BYTES for _, v in pending)
        self.records_in.inc(len(pending))
        self.bytes_in.inc(nbytes)
        totals[0] += len(pending)
        totals[1] += nbytes
        pending.clear()

    # -- GetRecords ---------------------------------------------------------------------
    def GetRecords(
        self, request: pb.GetRecordsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetRecordsChunk | bytes]:
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
        group, i = 1, 0
        while i < len(ids):
            # One MGET per group; the group grows while records are small, so a batch of
            # 64 KiB records costs a few round trips and a batch of 16 MiB ones stays bounded.
            start = time.perf_counter()
            batch = ids[i : i + group]
            keys = [self.store.key(request.run_id, request.policy_version, sid) for sid in batch]
            founds = self._redis(lambda keys=keys: self.store.get_many(keys, self.chunk_bytes))
            nbytes = 0
            for sid, found in zip(batch, founds, strict=True):
                yield from self._send(request, sid, found)
                nbytes += found.nbytes
            self.get_seconds.observe(time.perf_counter() - start)
            i += len(batch)
            group = max(1, min(GET_MAX_GROUP, GET_GROUP_BYTES // max(1, nbytes // len(batch))))

    def _send(
        self, request: pb.GetRecordsRequest, sid: str, found: Found
    ) -> Iterator[pb.GetRecordsChunk | bytes]:
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
            return
        parts = found.parts
        assert parts is not None  # get_many reads records as pieces of <= chunk_bytes
        total = found.nbytes
        # Serialized here (GET_SERIALIZE passes bytes through): the record piece is joined
        # once onto the small fields instead of copied into a message and again out of it.
        first = pb.GetRecordsChunk(
            sample_id=sid, status=pb.RECORD_STATUS_OK, total_bytes=total, crc32=found.crc32
        )
        yield with_bytes_field(first.SerializeToString(), GET_DATA_FIELD, parts[0])
        offset = len(parts[0])
        for part in parts[1:]:
            rest = pb.GetRecordsChunk(sample_id=sid, offset=offset).SerializeToString()
            yield with_bytes_field(rest, GET_DATA_FIELD, part)
            offset += len(part)
        self.hits.inc()
        self.records_out.inc()
        self.bytes_out.inc(total)

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


class _Assembly:
    """One record being received: header space + blob, filled in place."""

    def __init__(self, key: pb.RecordKey, total: int, crc32: int) -> None:
        self.key = key
        self.total = total
        self.crc32 = crc32
        self.value = memoryview(bytearray(HEADER_BYTES + total))
        self.received = 0

    def add(self, data: bytes) -> None:
        n = len(data)
        if self.received + n > self.total:
            raise invalid(f"record {self.key.sample_id!r}: more data than total_bytes={self.total}")
        self.value[HEADER_BYTES + self.received : HEADER_BYTES + self.received + n] = data
        self.received += n

    def finish(self, store: RecordStore) -> tuple[str, memoryview]:
        """Check length and CRC-32; return (redis key, header + blob)."""
        sid = self.key.sample_id
        if self.received != self.total:
            raise invalid(
                f"record {sid!r}: stream ended after {self.received} of total_bytes={self.total}"
            )
        actual = crc32(self.value[HEADER_BYTES:])
        if actual != self.crc32:
            raise ServiceError(
                grpc.StatusCode.DATA_LOSS,
                f"record {sid!r}: crc32 {actual:#010x} of received data != declared {self.crc32:#010x}",
            )
        self.value[:HEADER_BYTES] = encode_header(actual, self.total)
        return store.key(self.key.run_id, self.key.policy_version, sid), self.value
