"""QuantCacheClient: put and get per-sample record blobs (opaque bytes).

qc = QuantCacheClient("localhost:50051", token)
qc.put_records("run1", 3, "s-0-0", blob)
blobs = qc.get_records("run1", 3, ["s-0-0", "s-0-1"])   # {sample_id: bytes}, found ones
qc.delete("run1", version=3)

Two data paths, same records, same errors:

- direct: the client asks the service for the data plane once (GetDataPlane: Redis URL,
  key prefix, TTL, size limit, layout version) and then reads and writes Redis itself in
  the service's storage layout (trace_common.stores.quant_cache_store, the one codec both use):
  one hop for the bytes instead of two.
- grpc: every byte goes through the service (PutRecords / GetRecords streams), for clients
  that cannot reach Redis.

`data_path="auto"` (the default) takes the direct path when the service hands out a data
plane and this process can reach that Redis (a PING at first use), else gRPC, and logs the
choice; "direct" requires the direct path (DirectPathError otherwise); "grpc" never asks.
Delete and Stats always go through the service, the authority over the namespace.
A Redis that is briefly unavailable (UNAVAILABLE: a blip, a restart) is retried with
backoff within `DIRECT_RETRY` on the direct path, as gRPC's retry policy does on the other.
Records are authenticated end to end: the writer puts a write generation (16 random bytes
per write) and an HMAC-SHA256 tag (keyed from the deployment's shared token, over run,
version, sample id, generation and blob) in front of each blob, and the reader checks and
strips both. A record altered or written in Redis by anyone without the token (a valid CRC is
easy to forge) is refused as corrupt; so is a genuine older write of the same key put back,
when the reader passes the generation it expects (`generations`: the rollout hands the
trainer each record's generation with the completion). The service and the store see the
sealed bytes as opaque data.
Errors are the same on both paths: CorruptRecordError for records failing their checksum or tag,
KeyError for missing ones when `missing_ok=False`, and a grpc.RpcError with the status code
(on the direct path a DirectPathError, a grpc.RpcError with `code()` and `details()`) for
bad input, oversize records, an unreachable or full Redis.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence

import grpc
import redis

from trace_common.clients.data_path import DataPath, DirectPathError, check_data_path, offered
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as pb
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc as pb_grpc
from trace_common.service.errors import ServiceError
from trace_common.service.grpc_client import GrpcClient, resolve_token
from trace_common.service.retry import Backoff, retry_transient
from trace_common.stores import quant_cache_store as layout
from trace_common.stores.redis_bulk import Joined, bulk_connection_options
from trace_common.stores.redis_local import redact_url
from trace_common.wire.checksum import crc32
from trace_common.wire.chunk_wire import bytes_field_codec, with_bytes_field

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB per PutRecords message (the service's GetRecords size)
PUT_DATA_FIELD = pb.PutRecordsChunk.DESCRIPTOR.fields_by_name["data"].number
GET_DATA_FIELD = pb.GetRecordsChunk.DESCRIPTOR.fields_by_name["data"].number
REDIS_CONNECT_TIMEOUT_S = 2.0  # the reachability check of "auto" waits this long at most
REDIS_TIMEOUT_S = 30.0  # socket timeout of direct-path Redis calls
# Direct-path reads and writes retried on UNAVAILABLE this long (a blip or a quick restart;
# callers that can wait longer, like the trainer, retry on top).
DIRECT_RETRY = Backoff(budget_s=3.0, initial_s=0.1, max_s=1.0)
GENERATION_BYTES = 16  # write generation, first in every stored record blob
RECORD_TAG_BYTES = 32  # HMAC-SHA256 tag, after the generation
SEAL_BYTES = GENERATION_BYTES + RECORD_TAG_BYTES
_TAG_KEY_CONTEXT = b"trace quant-cache record tag v2\0"
TAG_MISMATCH = ("record tag mismatch: written without this deployment's token, altered in "
                "the store, or copied from another key")  # fmt: skip
REPLAYED = "record replayed: its write generation is not the one the writer reported"


def record_tag_key(token: str) -> bytes:
    """The records' HMAC key, derived from the deployment's shared token."""
    return hashlib.sha256(_TAG_KEY_CONTEXT + token.encode()).digest()


def new_generation() -> bytes:
    """A fresh write generation: 16 random bytes, unique to one write of one record."""
    return os.urandom(GENERATION_BYTES)


def check_generation(generation: bytes) -> bytes:
    if len(generation) != GENERATION_BYTES:
        raise ValueError(f"a write generation is {GENERATION_BYTES} bytes, got {len(generation)}")
    return bytes(generation)


def record_tag(key: bytes, run_id: str, version: int, sample_id: str, generation: bytes,
               blob: bytes | memoryview) -> bytes:  # fmt: skip
    """HMAC-SHA256 over the record's key fields, its write generation and its blob: a tag
    that binds the bytes to the place and the write they were made for (a record copied to
    another key fails; an older write of the same key carries an older generation)."""
    mac = hmac.new(key, f"{run_id}\0{version}\0{sample_id}\0".encode(), hashlib.sha256)
    mac.update(generation)
    mac.update(blob)
    return mac.digest()


class CorruptRecordError(RuntimeError):
    """Some records failed their checksum (in Redis or in transit); `records` holds the good ones."""

    def __init__(self, corrupt: dict[str, str], records: dict[str, bytes]) -> None:
        super().__init__(f"corrupt records: {corrupt}")
        self.corrupt = corrupt
        self.records = records


def _results(
    records: dict[str, bytes], missing: list[str], corrupt: dict[str, str], missing_ok: bool
) -> dict[str, bytes]:
    """What get_records returns or raises, the same for both paths."""
    if corrupt:
        raise CorruptRecordError(corrupt, records)
    if missing and not missing_ok:
        raise KeyError(f"records not found (expired, evicted or never written): {missing}")
    return records


class DirectPath:
    """Records read and written in Redis directly, in the layout the service handed out."""

    def __init__(self, plane: pb.GetDataPlaneResponse, client: redis.Redis) -> None:
        self.plane = plane
        # not counted in the service's stats: the data-plane user may not write them
        self.store = layout.RedisRecordStore(client, plane.key_prefix, plane.ttl_seconds,
                                        piece_bytes=plane.piece_bytes, count=False)  # fmt: skip

    def put_many(
        self, run_id: str, version: int, records: Mapping[str, bytes | bytearray | memoryview]
    ) -> int:
        """Same contract as the gRPC path: each record is all-or-nothing, and records are
        stored in pipelines of about PUT_FLUSH_BYTES (on an error the earlier ones stay)."""
        pending: list[tuple[str, Joined]] = []
        pending_bytes = stored = 0

        def flush() -> None:
            nonlocal stored, pending_bytes
            self.store.put_many(pending)
            stored += pending_bytes
            pending.clear()
            pending_bytes = 0

        try:
            for sid, blob in records.items():
                nbytes = memoryview(blob).nbytes
                try:
                    layout.check_key(run_id, version, sid)
                    layout.check_size(sid, nbytes, self.plane.max_record_bytes)
                except ServiceError:
                    flush()  # the records before the bad one are stored, as on the gRPC path
                    raise
                # header and blob sent as two buffers: no joining copy of the blob
                value = Joined(*layout.encode_parts(blob))
                pending.append((self.store.key(run_id, version, sid), value))
                pending_bytes += nbytes
                if pending_bytes >= layout.PUT_FLUSH_BYTES:
                    flush()
            flush()
        except ServiceError as err:
            raise DirectPathError(err.code, err.message) from err
        return stored

    def get_records(
        self, run_id: str, version: int, sample_ids: Sequence[str], missing_ok: bool
    ) -> dict[str, bytes]:
        records: dict[str, bytes] = {}
        missing: list[str] = []
        corrupt: dict[str, str] = {}
        try:
            layout.check_key(run_id, version)
            layout.check_sample_ids(sample_ids)
            sample_of = {self.store.key(run_id, version, s): s for s in sample_ids}
            for keys, founds in self.store.get_groups(list(sample_of)):
                for key, found in zip(keys, founds, strict=True):
                    sid = sample_of[key]
                    if found.status is layout.Lookup.OK:
                        records[sid] = found.blob()
                    elif found.status is layout.Lookup.MISSING:
                        missing.append(sid)
                    else:
                        corrupt[sid] = found.detail
        except ServiceError as err:
            raise DirectPathError(err.code, err.message) from err
        return _results(records, missing, corrupt, missing_ok)


class QuantCacheClient(GrpcClient):
    SERVICE = "trace.quantcache.v1.QuantCache"
    # Puts overwrite the same key with the same bytes, so every call is safe to retry.
    IDEMPOTENT = ("PutRecords", "GetRecords", "Delete", "Stats", "GetDataPlane")

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        data_path: DataPath = "auto",
        **kwargs: object,
    ) -> None:
        super().__init__(address, token, **kwargs)  # type: ignore[arg-type]
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._tag_key = record_tag_key(resolve_token(token))
        self.data_path = check_data_path(data_path)
        self._direct: DirectPath | None = None
        self._resolved = data_path == "grpc"
        self._resolve_lock = threading.Lock()
        self._stub = pb_grpc.QuantCacheStub(self.channel)
        # The two bulk RPCs with chunk_wire's codecs: record data is written and read
        # without protobuf's copies (same bytes on the wire as the generated stub).
        _, put_serialize = bytes_field_codec(pb.PutRecordsChunk, PUT_DATA_FIELD)
        get_deserialize, _ = bytes_field_codec(pb.GetRecordsChunk, GET_DATA_FIELD)
        self._put = self.channel.stream_unary(
            f"/{self.SERVICE}/PutRecords",
            request_serializer=put_serialize,
            response_deserializer=pb.PutRecordsResponse.FromString,
        )
        self._get = self.channel.unary_stream(
            f"/{self.SERVICE}/GetRecords",
            request_serializer=pb.GetRecordsRequest.SerializeToString,
            response_deserializer=get_deserialize,
        )

    # -- which path -------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The path in use: "direct" or "grpc" (asks the service on first use)."""
        return "direct" if self.direct() is not None else "grpc"

    def direct(self) -> DirectPath | None:
        """The direct path, or None for gRPC; resolved once (see the module docstring). A
        service that does not answer yet is asked again at the next call."""
        if self._resolved:
            return self._direct
        with self._resolve_lock:
            if not self._resolved:
                self._direct = self._connect()  # raises (stays unresolved) if not answered
                self._resolved = True
        return self._direct

    def _connect(self) -> DirectPath | None:
        strict = self.data_path == "direct"
        plane = offered(
            lambda: self._stub.GetDataPlane(
                pb.GetDataPlaneRequest(layout_version=layout.LAYOUT_VERSION),
                metadata=self.metadata,
                timeout=self.timeout,
            ),
            strict,
            "quant-cache",
        )
        if plane is None:
            return None
        client = redis.Redis.from_url(
            plane.redis_url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
            socket_read_size=layout.SOCKET_READ_BYTES,
            **bulk_connection_options(),  # Joined values, big replies read without copies
        )
        where = redact_url(plane.redis_url)
        try:
            client.ping()
        except redis.RedisError as exc:
            client.close()
            if strict:
                raise DirectPathError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"data_path='direct' but Redis at {where} is unreachable: {exc}",
                ) from exc
            log.warning("quant-cache: gRPC data path (Redis at %s unreachable: %s)", where, exc)
            return None
        log.info("quant-cache: direct data path (Redis at %s)", where)
        return DirectPath(plane, client)

    # -- records ----------------------------------------------------------------------------
    def put_records(
        self,
        run_id: str,
        version: int,
        sample_id: str,
        blob: bytes | bytearray | memoryview,
        *,
        generation: bytes | None = None,
    ) -> int:
        """Store one sample's record blob; returns the bytes stored. Overwrites."""
        return self.put_many(run_id, version, {sample_id: blob}, generation=generation)

    def put_many(
        self,
        run_id: str,
        version: int,
        records: Mapping[str, bytes | bytearray | memoryview],
        *,
        generation: bytes | None = None,
    ) -> int:
        """Store several samples' blobs in one call (e.g. a whole GRPO group); returns bytes
        stored. Each record is all-or-nothing; on an error the records before it are stored.
        The records are sealed with `generation` (new_generation(); a fresh one when None):
        a reader that expects it refuses any other write of the same keys."""
        if not records:
            raise ValueError("records is empty")
        gen = new_generation() if generation is None else check_generation(generation)
        sealed = {sid: self._seal(run_id, version, sid, gen, blob) for sid, blob in records.items()}
        tags = SEAL_BYTES * len(sealed)
        direct = self.direct()
        if direct is not None:
            return (
                retry_transient(
                    lambda: direct.put_many(run_id, version, sealed), "Redis write", DIRECT_RETRY
                )
                - tags
            )

        def chunks() -> Iterator[bytes]:
            for sample_id, blob in sealed.items():
                yield from self._chunks(run_id, version, sample_id, blob)

        response = self._put(chunks(), metadata=self.metadata, timeout=self.timeout)
        return response.stored_bytes - tags

    def _seal(self, run_id: str, version: int, sample_id: str, generation: bytes,
              blob: bytes | bytearray | memoryview) -> bytes:  # fmt: skip
        view = memoryview(blob).cast("B")
        tag = record_tag(self._tag_key, run_id, version, sample_id, generation, view)
        return b"".join((generation, tag, view))

    def _open(self, run_id: str, version: int, sealed: dict[str, bytes],
              corrupt: dict[str, str], generations: Mapping[str, bytes]) -> dict[str, bytes]:  # fmt: skip
        """The blobs of records whose tag checks out and whose generation is the expected
        one (where `generations` names one); the others into `corrupt`."""
        good: dict[str, bytes] = {}
        for sid, data in sealed.items():
            view = memoryview(data)
            gen = bytes(view[:GENERATION_BYTES])
            body = view[SEAL_BYTES:]
            if len(view) < SEAL_BYTES or not hmac.compare_digest(
                bytes(view[GENERATION_BYTES:SEAL_BYTES]),
                record_tag(self._tag_key, run_id, version, sid, gen, body),
            ):
                corrupt[sid] = TAG_MISMATCH
            elif sid in generations and not hmac.compare_digest(gen, generations[sid]):
                corrupt[sid] = REPLAYED
            else:
                good[sid] = bytes(body)
        return good

    def _chunks(
        self, run_id: str, version: int, sample_id: str, blob: bytes | bytearray | memoryview
    ) -> Iterator[bytes]:
        """The record's PutRecordsChunk messages, serialized (data joined on, one copy)."""
        view = memoryview(blob).cast("B")
        key = pb.RecordKey(run_id=run_id, policy_version=version, sample_id=sample_id)
        step = self.chunk_bytes
        first = pb.PutRecordsChunk(key=key, total_bytes=len(view), crc32=crc32(view))
        yield with_bytes_field(first.SerializeToString(), PUT_DATA_FIELD, view[:step])
        for offset in range(step, len(view), step):
            yield with_bytes_field(b"", PUT_DATA_FIELD, view[offset : offset + step])

    def get_records(
        self,
        run_id: str,
        version: int,
        sample_ids: Sequence[str],
        *,
        missing_ok: bool = True,
        generations: Mapping[str, bytes] | None = None,
    ) -> dict[str, bytes]:
        """Records of `sample_ids` that exist, each verified against its CRC-32 and its tag,
        and against its expected write generation where `generations` names one.

        Missing ones (never written, expired, evicted) are left out, or raise KeyError when
        `missing_ok` is False. Corrupt ones (a bad checksum or tag, or replayed: an older
        write) raise CorruptRecordError (good ones attached).
        """
        try:
            sealed, corrupt = self._get_sealed(run_id, version, sample_ids, missing_ok), {}
        except CorruptRecordError as exc:
            sealed, corrupt = exc.records, dict(exc.corrupt)
        good = self._open(run_id, version, sealed, corrupt, generations or {})
        if corrupt:
            raise CorruptRecordError(corrupt, good)
        return good

    def _get_sealed(
        self, run_id: str, version: int, sample_ids: Sequence[str], missing_ok: bool
    ) -> dict[str, bytes]:
        """The stored (tagged) bytes of the records, CRC-checked."""
        direct = self.direct()
        if direct is not None:
            return retry_transient(
                lambda: direct.get_records(run_id, version, sample_ids, missing_ok),
                "Redis read",
                DIRECT_RETRY,
            )
        request = pb.GetRecordsRequest(
            run_id=run_id, policy_version=version, sample_ids=list(sample_ids)
        )
        records: dict[str, bytes] = {}
        missing: list[str] = []
        corrupt: dict[str, str] = {}
        # sample, total, crc, parts (views into the received messages)
        current: tuple[str, int, int, list[memoryview]] | None = None

        def finish(item: tuple[str, int, int, list[memoryview]]) -> None:
            sid, total, crc, parts = item
            data = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
            if len(data) != total:
                corrupt[sid] = f"received {len(data)} of {total} bytes"
            elif crc32(data) != crc:
                corrupt[sid] = "checksum mismatch after transfer"
            else:
                records[sid] = data

        for chunk in self._get(request, metadata=self.metadata, timeout=self.timeout):
            if chunk.status != pb.RECORD_STATUS_UNSPECIFIED:  # first chunk of a sample
                if current is not None:
                    finish(current)
                    current = None
                if chunk.status == pb.RECORD_STATUS_OK:
                    current = (chunk.sample_id, chunk.total_bytes, chunk.crc32, [chunk.data])
                elif chunk.status == pb.RECORD_STATUS_MISSING:
                    missing.append(chunk.sample_id)
                else:
                    corrupt[chunk.sample_id] = chunk.detail or "corrupt"
            elif current is not None and chunk.sample_id == current[0]:
                current[3].append(chunk.data)
            else:
                raise ValueError(
                    f"GetRecords: data chunk for {chunk.sample_id!r} without its first chunk"
                )
        if current is not None:
            finish(current)
        return _results(records, missing, corrupt, missing_ok)

    # -- control plane (always through the service) -----------------------------------------
    def delete(self, run_id: str, version: int | None = None) -> int:
        """Delete a run's records (all versions when `version` is None); returns the count."""
        request = pb.DeleteRequest(run_id=run_id)
        if version is not None:
            request.policy_version = version
        return self._stub.Delete(
            request, metadata=self.metadata, timeout=self.timeout
        ).deleted_records

    def stats(self) -> pb.StatsResponse:
        return self._stub.Stats(pb.StatsRequest(), metadata=self.metadata, timeout=self.timeout)

    def close(self) -> None:
        if self._direct is not None:
            self._direct.store.client.close()
        super().close()
