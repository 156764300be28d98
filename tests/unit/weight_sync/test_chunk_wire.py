"""chunk_wire writes and reads the same bytes as the generated protobuf classes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as qc
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.wire.chunk_wire import (
    ChunkView,
    bytes_field_codec,
    chunk_codec,
    encode_chunk,
    fields,
    varint,
    with_bytes_field,
)

DESERIALIZE, SERIALIZE = chunk_codec(pb.PullChunk)


@given(
    index=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**63 - 1),
    data=st.binary(max_size=300),
)
def test_encode_equals_protobuf_and_decodes_back(index: int, offset: int, data: bytes) -> None:
    msg = pb.PullChunk(chunk=pb.TensorChunk(tensor_index=index, offset=offset, data=data))
    wire = encode_chunk(index, offset, memoryview(data))
    assert wire == msg.SerializeToString()
    assert pb.PushChunk.FromString(wire).chunk.data == data  # Push and Pull share the layout
    view = DESERIALIZE(msg.SerializeToString())
    assert isinstance(view, ChunkView)
    assert (view.tensor_index, view.offset, bytes(view.data)) == (index, offset, data)


def test_header_messages_go_through_protobuf() -> None:
    msg = pb.PullChunk(header=pb.VersionHeader(version=3, metadata_json="{}", total_bytes=9))
    decoded = DESERIALIZE(msg.SerializeToString())
    assert isinstance(decoded, pb.PullChunk) and decoded.header.version == 3
    assert SERIALIZE(decoded) == msg.SerializeToString()
    assert SERIALIZE(b"as-is") == b"as-is"


def test_malformed_input_is_a_clear_error() -> None:
    good = encode_chunk(1, 2, b"abcdef")
    with pytest.raises(ValueError, match="past the end"):
        DESERIALIZE(good[:-1])
    with pytest.raises(ValueError, match="truncated varint"):
        list(fields(memoryview(b"\x08\xff")))
    with pytest.raises(ValueError, match="negative"):
        varint(-1)


@given(
    sample=st.text(st.sampled_from("ab.-_0"), min_size=1, max_size=20),
    total=st.integers(0, 2**40),
    crc=st.integers(0, 2**32 - 1),
    data=st.binary(max_size=300),
)
def test_bytes_field_codec_matches_protobuf(sample: str, total: int, crc: int, data: bytes) -> None:
    """quant-cache's record chunks: data is the highest field set, so prefix + data is
    exactly protobuf's encoding, and the decoder returns the other fields parsed."""
    key = qc.RecordKey(run_id="r", policy_version=3, sample_id=sample)
    full = qc.PutRecordsChunk(key=key, total_bytes=total, crc32=crc, data=data)
    prefix = qc.PutRecordsChunk(key=key, total_bytes=total, crc32=crc).SerializeToString()
    assert with_bytes_field(prefix, 4, memoryview(data)) == full.SerializeToString()
    decode, encode = bytes_field_codec(qc.PutRecordsChunk, 4)
    got = decode(full.SerializeToString())
    assert bytes(got.data) == data and got.key.sample_id == sample and got.HasField("key")
    assert (got.total_bytes, got.crc32) == (total, crc)
    ok = qc.GetRecordsChunk(sample_id=sample, status=qc.RECORD_STATUS_OK, offset=total, data=data)
    head = qc.GetRecordsChunk(sample_id=sample, status=qc.RECORD_STATUS_OK, offset=total)
    assert with_bytes_field(head.SerializeToString(), 6, data) == ok.SerializeToString()
    assert encode(ok) == ok.SerializeToString()
