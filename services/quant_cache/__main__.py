"""`python -m services.quant_cache`: the quant-cache service (records in Redis)."""

from __future__ import annotations

import logging

import redis

from services.quant_cache.config import LOCAL_MAXMEMORY_BYTES, QuantCacheSettings
from services.quant_cache.data_plane import data_plane_user
from services.quant_cache.servicer import CODECS, QuantCacheServicer
from services.quant_cache.sweep import Sweeper
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc
from trace_common.service import ServiceError, ServiceRuntime, load_settings
from trace_common.stores.quant_cache_store import SOCKET_READ_BYTES, RedisRecordStore
from trace_common.stores.redis_local import LocalRedis, LocalRedisConfig, redact_url

log = logging.getLogger("services.quant_cache")


def main() -> None:
    settings = load_settings(QuantCacheSettings)
    rt = ServiceRuntime("quant_cache", settings)
    url = redis_url(settings, rt)  # the configured Redis, or a local one started here
    store = open_store(settings, url)
    # The direct data path: clients get this URL (GetDataPlane) and use Redis themselves, as
    # a user that can touch only the record keys (never the service's own credentials).
    plane = None
    if settings.data_plane_enabled:
        plane = settings.data_plane_redis_url or data_plane_user(
            store.client, url, settings.key_prefix, rt.stopping
        )
    if settings.sweep_seconds > 0:  # the TTL and size limit, whoever wrote the records
        Sweeper(store, settings.max_record_bytes, rt.metrics).start(
            settings.sweep_seconds, rt.stopping
        )
    servicer = QuantCacheServicer(
        store,
        rt.metrics,
        max_record_bytes=settings.max_record_bytes,
        max_batch=settings.max_batch,
        data_plane_url=plane,
    )
    rt.grpc.add(
        quantcache_pb2_grpc.add_QuantCacheServicer_to_server,
        servicer,
        "trace.quantcache.v1.QuantCache",
        codecs=CODECS,
    )
    rt.run(
        ready=store.ping,
        status=lambda: {
            "redis_url": redact_url(url),
            "data_plane_redis_url": None if plane is None else redact_url(plane),
            **_stats(store),
        },
        private_status=("redis_url", "data_plane_redis_url"),  # addresses: with the token only
    )


def redis_url(settings: QuantCacheSettings, rt: ServiceRuntime) -> str:
    """TRACE_REDIS_URL, or the URL of a local redis-server started for this service (stopped
    with it), bounded by the memory settings."""
    if settings.redis_url is not None:
        return settings.redis_url
    maxmemory = settings.redis_maxmemory_bytes or LOCAL_MAXMEMORY_BYTES
    local = LocalRedis(
        LocalRedisConfig(
            maxmemory_bytes=maxmemory, maxmemory_policy=settings.redis_maxmemory_policy
        )
    ).start()
    rt.after_stop.append(local.stop)
    log.info(
        "started a local redis-server",
        extra={"redis_url": redact_url(local.url), "maxmemory_bytes": maxmemory},
    )
    return local.url


def open_store(settings: QuantCacheSettings, url: str) -> RedisRecordStore:
    """The records' layout over the Redis at `url`, with the configured memory bound applied
    to a Redis of the user's own (a local one got it at start)."""
    store = RedisRecordStore(
        redis.Redis.from_url(url, socket_timeout=30, socket_read_size=SOCKET_READ_BYTES),
        settings.key_prefix,
        settings.ttl_seconds,
        piece_bytes=settings.chunk_bytes,
    )
    if settings.redis_url is not None and settings.redis_maxmemory_bytes is not None:
        store.configure_memory(settings.redis_maxmemory_bytes, settings.redis_maxmemory_policy)
    return store


def _stats(store: RedisRecordStore) -> dict[str, object]:
    try:
        info = store.info()
    except ServiceError as err:  # Redis down: /status still answers, saying so
        return {"ttl_seconds": store.ttl_seconds, "redis_error": err.message}
    keys = ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys", "expired_keys", "keys")
    return {"ttl_seconds": store.ttl_seconds, "redis": {k: info.get(k) for k in keys}}


if __name__ == "__main__":
    main()
