"""The embedded Redis requires a password: a client without it is refused, the password is
not on the command line, and the URL the services use carries it."""

from __future__ import annotations

import pathlib

import pytest
import redis

from trace_common.stores.redis_local import LocalRedis, LocalRedisConfig, redact_url


def test_embedded_redis_refuses_clients_without_its_password() -> None:
    with LocalRedis() as server:
        assert server.password and len(server.password) >= 24
        assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
        assert redact_url(server.url) == f"redis://***@127.0.0.1:{server.port}/0"
        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("k", b"forged")
        wrong = redis.Redis(host="127.0.0.1", port=server.port, password="guess")
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        assert redis.Redis.from_url(server.url).ping()
        assert server._proc is not None
        cmdline = pathlib.Path(f"/proc/{server._proc.pid}/cmdline").read_bytes()
        assert server.password.encode() not in cmdline


def test_two_servers_get_different_passwords_unless_configured() -> None:
    a, b = LocalRedis(), LocalRedis()
    assert a.password != b.password
    assert LocalRedis(LocalRedisConfig(password="fixed-secret")).password == "fixed-secret"
    with pytest.raises(ValueError, match="must not contain"):
        LocalRedis(LocalRedisConfig(password="has space"))
