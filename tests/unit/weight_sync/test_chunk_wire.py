"""chunk_wire writes and reads the same bytes as the generated protobuf classes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_common.chunk_wire import ChunkView, chunk_codec, encode_chunk, fields, varint
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb

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
