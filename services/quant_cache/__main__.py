"""`python -m services.quant_cache`: the quant-cache service (records in Redis)."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import urllib.parse

import redis

from services.quant_cache.config import LOCAL_MAXMEMORY_BYTES, QuantCacheSettings
from services.quant_cache.servicer import CODECS, QuantCacheServicer
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc
from trace_common.quant_cache_store import (
    SOCKET_READ_BYTES,
    SWEEP_ACTIONS,
    RedisRecordStore,
    record_pattern,
)
from trace_common.redis_local import LocalRedis, LocalRedisConfig, redact_url
from trace_common.service import Metrics, ServiceError, ServiceRuntime, load_settings

log = logging.getLogger("services.quant_cache")


def main() -> None:
    settings = load_settings(QuantCacheSettings)
    rt = ServiceRuntime("quant_cache", settings)
    local = None
    url = settings.redis_url
    if url is None:
        maxmemory = settings.redis_maxmemory_bytes or LOCAL_MAXMEMORY_BYTES
        local = LocalRedis(
            LocalRedisConfig(
                maxmemory_bytes=maxmemory, maxmemory_policy=settings.redis_maxmemory_policy
            )
        ).start()
        rt.after_stop.append(local.stop)
        url = local.url
        log.info(
            "started a local redis-server",
            extra={"redis_url": redact_url(url), "maxmemory_bytes": maxmemory},
        )
    store = RedisRecordStore(
        redis.Redis.from_url(url, socket_timeout=30, socket_read_size=SOCKET_READ_BYTES),
        settings.key_prefix,
        settings.ttl_seconds,
        piece_bytes=settings.chunk_bytes,
    )
    if local is None and settings.redis_maxmemory_bytes is not None:
        store.configure_memory(settings.redis_maxmemory_bytes, settings.redis_maxmemory_policy)
    # The direct data path: clients get this URL (GetDataPlane) and use Redis themselves, as
    # a user that can touch only the record keys (never the service's own credentials).
    plane = None
    if settings.data_plane_enabled:
        plane = settings.data_plane_redis_url or data_plane_user(
            store.client, url, settings.key_prefix, rt.stopping
        )
    if settings.sweep_seconds > 0:
        sweeper = Sweeper(store, settings.max_record_bytes, rt.metrics)
        threading.Thread(target=sweeper.run, args=(settings.sweep_seconds, rt.stopping),
                         name="record-sweep", daemon=True).start()  # fmt: skip
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


DATA_PLANE_USER = "trace-data-plane"
ACL_REFRESH_S = 1.0  # how often the data-plane user is set again (Redis forgets it on restart)
# What the direct path runs, and nothing else: SET (with the TTL), STRLEN and GETRANGE of single
# record keys, PING, SELECT of the URL's database. No DEL, no APPEND or SETRANGE, no listing,
# flushing, configuring or scripting. CLIENT SETINFO, which redis-py sends on connect, is
# refused and redis-py goes on without it.
DATA_PLANE_COMMANDS = ("-@all", "+ping", "+select", "+set", "+strlen", "+getrange")


class DataPlaneUser:
    """A Redis user limited to the record keys under `prefix` and to the direct path's
    commands (DATA_PLANE_COMMANDS), with a random password fixed for this process. Redis
    forgets users when it restarts, so `keep` sets it again every ACL_REFRESH_S while the
    service runs."""

    def __init__(self, admin: redis.Redis, url: str, prefix: str) -> None:
        self.admin, self.prefix = admin, prefix
        self.password = secrets.token_hex(24)
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host  # an IPv6 literal keeps its brackets
        netloc = f"{DATA_PLANE_USER}:{self.password}@{host}" + (
            f":{parts.port}" if parts.port else "")  # fmt: skip
        self.url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def ensure(self) -> None:
        """Create or reset the user (RedisError when Redis refuses)."""
        self.admin.execute_command("ACL", "SETUSER", DATA_PLANE_USER, "reset", "on",
                                   f">{self.password}", f"~{record_pattern(self.prefix)}",
                                   *DATA_PLANE_COMMANDS)  # fmt: skip

    def keep(self, stopping: threading.Event) -> None:
        while not stopping.wait(ACL_REFRESH_S):
            # Redis down: the store's own errors say so; the user is set again once it is back
            with contextlib.suppress(redis.RedisError):
                self.ensure()


def data_plane_user(admin: redis.Redis, url: str, prefix: str,
                    stopping: threading.Event) -> str | None:  # fmt: skip
    """The URL of a `DataPlaneUser` kept alive in the background; None (no direct path,
    clients use gRPC) when this Redis refuses to create it: no ACLs, or the service's own user
    may not create users."""
    user = DataPlaneUser(admin, url, prefix)
    try:
        user.ensure()
    except redis.RedisError as exc:
        log.warning("no direct data path: Redis refused to create the restricted data-plane "
                    "user (%s); clients use gRPC. Set TRACE_DATA_PLANE_REDIS_URL to hand out "
                    "a user of your own.", exc)  # fmt: skip
        return None
    threading.Thread(target=user.keep, args=(stopping,), name="data-plane-user",
                     daemon=True).start()  # fmt: skip
    return user.url


class Sweeper:
    """Runs RedisRecordStore.sweep every `interval` seconds: the service's TTL and size limit hold
    for records whichever path wrote them. Counted as
    `trace_quant_cache_swept_records_total{action}` and logged (a client broke the limits)."""

    def __init__(self, store: RedisRecordStore, max_record_bytes: int, metrics: Metrics) -> None:
        self.store, self.max_record_bytes = store, max_record_bytes
        self.swept = metrics.counter("swept_records", "record keys the sweep fixed or deleted",
                                     labels=("action",))  # fmt: skip
        for action in SWEEP_ACTIONS:
            self.swept.labels(action)  # exported at 0 from the start
        self.seconds = metrics.histogram("sweep_seconds", "time of one sweep over the records")

    def once(self) -> dict[str, int]:
        t0 = time.perf_counter()
        counts = self.store.sweep(self.max_record_bytes)
        self.seconds.observe(time.perf_counter() - t0)
        for action, n in counts.items():
            if n:
                self.swept.labels(action).inc(n)
        if any(counts.values()):
            log.warning("record sweep: %s (written past the service's limits)", counts)
        return counts

    def run(self, interval: float, stopping: threading.Event) -> None:
        while not stopping.wait(interval):
            try:
                self.once()
            except ServiceError as err:  # Redis down: the next sweep tries again
                log.warning("record sweep failed: %s", err.message)


def _stats(store: RedisRecordStore) -> dict[str, object]:
    try:
        info = store.info()
    except ServiceError as err:  # Redis down: /status still answers, saying so
        return {"ttl_seconds": store.ttl_seconds, "redis_error": err.message}
    keys = ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys", "expired_keys", "keys")
    return {"ttl_seconds": store.ttl_seconds, "redis": {k: info.get(k) for k in keys}}


if __name__ == "__main__":
    main()
