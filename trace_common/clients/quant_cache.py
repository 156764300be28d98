"""QuantCacheClient: put and get per-sample record blobs (opaque bytes) over gRPC.

qc = QuantCacheClient("localhost:50051", token)
qc.put_records("run1", 3, "s-0-0", blob)
blobs = qc.get_records("run1", 3, ["s-0-0", "s-0-1"])   # {sample_id: bytes}, found ones
qc.delete("run1", version=3)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from trace_common.checksum import crc32
from trace_common.chunk_wire import bytes_field_codec, with_bytes_field
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as pb
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc as pb_grpc
from trace_common.service.grpc_client import GrpcClient

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB per PutRecords message (the service's GetRecords size)
PUT_DATA_FIELD = pb.PutRecordsChunk.DESCRIPTOR.fields_by_name["data"].number
GET_DATA_FIELD = pb.GetRecordsChunk.DESCRIPTOR.fields_by_name["data"].number


class CorruptRecordError(RuntimeError):
    """Some records failed their checksum (in Redis or in transit); `records` holds the good ones."""

    def __init__(self, corrupt: dict[str, str], records: dict[str, bytes]) -> None:
        super().__init__(f"corrupt records: {corrupt}")
        self.corrupt = corrupt
        self.records = records


class QuantCacheClient(GrpcClient):
    SERVICE = "trace.quantcache.v1.QuantCache"
    # Puts overwrite the same key with the same bytes, so every call is safe to retry.
    IDEMPOTENT = ("PutRecords", "GetRecords", "Delete", "Stats")

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        **kwargs: object,
    ) -> None:
        super().__init__(address, token, **kwargs)  # type: ignore[arg-type]
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
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

    def put_records(
        self, run_id: str, version: int, sample_id: str, blob: bytes | bytearray | memoryview
    ) -> int:
        """Store one sample's record blob; returns the bytes stored. Overwrites."""
        return self.put_many(run_id, version, {sample_id: blob})

    def put_many(
        self, run_id: str, version: int, records: Mapping[str, bytes | bytearray | memoryview]
    ) -> int:
        """Store several samples' blobs in one stream (e.g. a whole GRPO group); returns bytes
        stored. Each record is all-or-nothing; on an error the records before it are stored."""
        if not records:
            raise ValueError("records is empty")

        def chunks() -> Iterator[bytes]:
            for sample_id, blob in records.items():
                yield from self._chunks(run_id, version, sample_id, blob)

        response = self._put(chunks(), metadata=self.metadata, timeout=self.timeout)
        return response.stored_bytes

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
        self, run_id: str, version: int, sample_ids: Sequence[str], *, missing_ok: bool = True
    ) -> dict[str, bytes]:
        """Records of `sample_ids` that exist, each verified against its CRC-32.

        Missing ones (never written, expired, evicted) are left out, or raise KeyError when
        `missing_ok` is False. Corrupt ones raise CorruptRecordError (good ones attached).
        """
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
        if corrupt:
            raise CorruptRecordError(corrupt, records)
        if missing and not missing_ok:
            raise KeyError(f"records not found (expired, evicted or never written): {missing}")
        return records

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
