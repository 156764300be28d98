"""quant-cache's Redis user for the direct data path: limited to the record keys and to the
commands the clients' direct path runs, so the service's own credentials never leave it."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import urllib.parse

import redis

from trace_common.stores.quant_cache_store import record_pattern

log = logging.getLogger("services.quant_cache")


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
