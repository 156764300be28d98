"""trace_common.stores.redis_bulk against a real Redis: Joined values are stored as the joined
bytes, big replies come back byte-exact, and the connection stays in step afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from trace_common.stores import quant_cache_store as layout
from trace_common.stores.redis_bulk import (
    BIG_BULK_BYTES,
    Joined,
    JoinedPacker,
    bulk_connection_options,
)
from trace_common.stores.redis_local import LocalRedis


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    with LocalRedis() as server:
        # a small read size, so replies arrive split across the buffered part and recv_into
        c = redis.Redis.from_url(server.url, socket_read_size=4096, **bulk_connection_options())
        yield c
        c.close()


def test_joined_value_is_stored_as_the_encoded_record(client: redis.Redis) -> None:
    for n in (0, 5, BIG_BULK_BYTES + 3, 3 << 20):
        blob = os.urandom(n)
        client.set("j", Joined(*layout.encode_parts(blob)), ex=60)
        assert client.get("j") == layout.encode(blob)
        assert 0 < client.ttl("j") <= 60


def test_joined_in_a_pipeline_with_other_commands(client: redis.Redis) -> None:
    blobs = [os.urandom(n) for n in (10, BIG_BULK_BYTES, 2 << 20)]
    pipe = client.pipeline(transaction=False)
    for i, blob in enumerate(blobs):
        pipe.set(f"p{i}", Joined(b"head", blob))
        pipe.incrby("counter", 1)
    assert pipe.execute() == [True, 1, True, 2, True, 3]
    for i, blob in enumerate(blobs):
        assert client.get(f"p{i}") == b"head" + blob


def test_big_replies_byte_exact_between_small_ones(client: redis.Redis) -> None:
    big = os.urandom(5 << 20)
    client.set("big", big)
    pipe = client.pipeline(transaction=False)
    for start in (0, 1 << 20, (5 << 20) - BIG_BULK_BYTES):
        pipe.strlen("big")
        pipe.getrange("big", start, start + (1 << 20) - 1)
        pipe.getrange("big", start, start + 9)
    replies = pipe.execute()
    for i, start in enumerate((0, 1 << 20, (5 << 20) - BIG_BULK_BYTES)):
        n, piece, small = replies[3 * i : 3 * i + 3]
        assert n == len(big)
        assert bytes(piece) == big[start : start + (1 << 20)]
        assert small == big[start : start + 10]
    assert client.get("big") == big
    assert client.ping()


def test_packer_packs_plain_commands_as_redis_py() -> None:
    plain = redis.connection.PythonRespSerializer(6000, JoinedPacker().encode)
    args = ("SET", "k", b"v" * 7000, "EX", 5)
    assert b"".join(JoinedPacker().pack(*args)) == b"".join(plain.pack(*args))
    joined = b"".join(JoinedPacker().pack("SET", "k", Joined(b"ab", b"cd"), "EX", 5))
    assert joined == b"".join(plain.pack("SET", "k", b"abcd", "EX", 5))
