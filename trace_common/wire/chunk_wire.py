"""Protobuf wire encoding of the big chunk messages, without protobuf's copies of the data.

Two helpers: chunk_codec for weight-sync's chunks (below), bytes_field_codec /
with_bytes_field for any message with one big `bytes` field (quant-cache's record chunks).

Python protobuf copies a `bytes` field three times on the way out (into the message, into
the serialized string, and `bytes(view)` before that) and twice on the way in (parse, then
`.data`). For the weight-sync chunks that is most of the CPU a transfer costs besides gRPC
itself, so these messages are written and read here by hand, in the standard wire format
(https://protobuf.dev/programming-guides/encoding/): the bytes on the wire are the same as
the generated classes write, and either side may use the generated classes instead.

The layout handled is the one PushChunk and PullChunk share (trace.weightsync.v1):

    oneof kind { VersionHeader header = 1; TensorChunk chunk = 2; }
    TensorChunk { uint32 tensor_index = 1; uint64 offset = 2; bytes data = 3; }

Because the two messages are the same on the wire, weight-sync keeps a pushed chunk's
received bytes as the pull message unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32 = 0, 1, 2, 5
HEADER_FIELD, CHUNK_FIELD = 1, 2  # PushChunk / PullChunk oneof fields
INDEX_FIELD, OFFSET_FIELD, DATA_FIELD = 1, 2, 3  # TensorChunk fields


def varint(value: int) -> bytes:
    """Base-128 varint of a non-negative integer."""
    if value < 0:
        raise ValueError(f"varint of a negative value {value}")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); ValueError if the buffer ends inside it."""
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _spans(buf: memoryview) -> Iterator[tuple[int, int, int, int | memoryview, int]]:
    """(field number, wire type, start of its key, value, end) of each field."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == WIRE_VARINT:
            value, pos = read_varint(buf, pos)
            yield number, wire, start, value, pos
            continue
        if wire == WIRE_LEN:
            size, pos = read_varint(buf, pos)
        elif wire in (WIRE_I64, WIRE_I32):
            size = 8 if wire == WIRE_I64 else 4
        else:
            raise ValueError(f"unsupported wire type {wire} (field {number})")
        if pos + size > len(buf):
            raise ValueError(f"field {number} runs past the end of the message")
        yield number, wire, start, buf[pos : pos + size], pos + size
        pos += size


def fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field: an int for varints, a zero-copy view
    for length-delimited and fixed-width fields. ValueError on malformed input."""
    for number, wire, _, value, _ in _spans(buf):
        yield number, wire, value


def with_bytes_field(prefix: bytes, number: int, data: bytes | memoryview) -> bytes:
    """`prefix` (a message serialized without its big field) + field `number` = `data`:
    equal to protobuf's own bytes when `number` is the highest field set. One copy."""
    if not len(data):
        return prefix
    return b"".join((prefix, varint(number << 3 | WIRE_LEN), varint(len(data)), data))


class WithData:
    """A message parsed without its big bytes field, plus that field as a view into the
    received bytes; reads like the message (`.key`, `.HasField(...)`, `.data`)."""

    __slots__ = ("data", "message")

    def __init__(self, message: Any, data: memoryview) -> None:
        self.message = message
        self.data = data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    def HasField(self, name: str) -> bool:
        return self.message.HasField(name)


def bytes_field_codec(
    message_type: Any, number: int
) -> tuple[Callable[[bytes], WithData], Callable[[Any], bytes]]:
    """(deserializer, serializer) for messages whose field `number` is big bytes: the
    deserializer parses the other fields with protobuf and returns the big one as a view
    (WithData); the serializer passes bytes (from with_bytes_field) through."""

    def deserialize(raw: bytes) -> WithData:
        view = memoryview(raw)
        data = view[0:0]
        rest: list[memoryview] = []
        for field, wire, start, value, end in _spans(view):
            if field == number and wire == WIRE_LEN:
                assert isinstance(value, memoryview)
                data = value  # the last one wins, as in protobuf
            else:
                rest.append(view[start:end])
        return WithData(message_type.FromString(b"".join(rest)), data)

    def serialize(message: Any) -> bytes:
        return message if isinstance(message, bytes) else message.SerializeToString()

    return deserialize, serialize


@dataclass(slots=True)
class ChunkView:
    """A decoded TensorChunk: `data` is a view into `raw`, the whole received message."""

    tensor_index: int
    offset: int
    data: memoryview
    raw: bytes


def encode_chunk(tensor_index: int, offset: int, data: bytes | memoryview) -> bytes:
    """The wire bytes of PushChunk/PullChunk{chunk: {tensor_index, offset, data}}: one copy
    of `data` (the join). proto3 leaves zero-valued scalars out, as protobuf does."""
    meta = b""
    if tensor_index:
        meta += varint(INDEX_FIELD << 3 | WIRE_VARINT) + varint(tensor_index)
    if offset:
        meta += varint(OFFSET_FIELD << 3 | WIRE_VARINT) + varint(offset)
    data_key = varint(DATA_FIELD << 3 | WIRE_LEN) + varint(len(data)) if len(data) else b""
    inner = len(meta) + len(data_key) + len(data)
    outer = varint(CHUNK_FIELD << 3 | WIRE_LEN) + varint(inner)
    return b"".join((outer, meta, data_key, data))


def chunk_codec(message_type: Any) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    """(deserializer, serializer) for a PushChunk/PullChunk-shaped `message_type`.

    The deserializer returns a ChunkView for a chunk message (no copy of the data) and a
    parsed `message_type` for anything else (the header). The serializer passes bytes
    (from encode_chunk, or kept from a push) through and serializes messages as usual."""

    def deserialize(raw: bytes) -> Any:
        view = memoryview(raw)
        top = list(fields(view))
        if len(top) == 1 and top[0][0] == CHUNK_FIELD and top[0][1] == WIRE_LEN:
            index = offset = 0
            data = view[0:0]
            inner = top[0][2]
            assert isinstance(inner, memoryview)
            for number, wire, value in fields(inner):
                if number == INDEX_FIELD and wire == WIRE_VARINT:
                    index = value
                elif number == OFFSET_FIELD and wire == WIRE_VARINT:
                    offset = value
                elif number == DATA_FIELD and wire == WIRE_LEN:
                    data = value
            assert isinstance(index, int) and isinstance(offset, int)
            assert isinstance(data, memoryview)
            return ChunkView(index & 0xFFFFFFFF, offset, data, raw)
        return message_type.FromString(raw)

    def serialize(message: Any) -> bytes:
        return message if isinstance(message, bytes) else message.SerializeToString()

    return deserialize, serialize
