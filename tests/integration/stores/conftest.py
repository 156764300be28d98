"""Fixtures: a real Redis (redis-server subprocess) and the services as real subprocesses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from trace_common.stores.redis_local import LocalRedis, LocalRedisConfig


@pytest.fixture()
def local_redis() -> Iterator[LocalRedis]:
    with LocalRedis(LocalRedisConfig(maxmemory_bytes=256 << 20)) as server:
        yield server


@pytest.fixture()
def raw_redis(local_redis: LocalRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(local_redis.url)
    yield client
    client.close()
