"""Typed settings: environment, YAML file, required settings named at start-up."""

from __future__ import annotations

import pathlib

import pytest
from pydantic import Field

from trace_common.service import ServiceSettings, load_settings


class DemoSettings(ServiceSettings):
    redis_url: str = Field(..., description="required")
    ttl_seconds: int = Field(60, gt=0)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("TRACE_"):
            monkeypatch.delenv(name)


def test_missing_required_setting_exits_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRACE_AUTH_TOKEN", "t")
    with pytest.raises(SystemExit) as exc:
        load_settings(DemoSettings)
    assert exc.value.code == 2
    assert "TRACE_REDIS_URL: missing required setting" in capsys.readouterr().err


def test_missing_token_exits_naming_both_variables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRACE_REDIS_URL", "redis://x:1")
    with pytest.raises(SystemExit):
        load_settings(DemoSettings)
    err = capsys.readouterr().err
    assert "TRACE_AUTH_TOKEN" in err and "TRACE_AUTH_TOKEN_FILE" in err


def test_bad_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRACE_AUTH_TOKEN", "t")
    monkeypatch.setenv("TRACE_REDIS_URL", "redis://x:1")
    monkeypatch.setenv("TRACE_TTL_SECONDS", "-5")
    with pytest.raises(SystemExit):
        load_settings(DemoSettings)
    assert "TRACE_TTL_SECONDS" in capsys.readouterr().err


def test_env_overrides_yaml_overrides_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    yaml_file = tmp_path / "qc.yaml"
    yaml_file.write_text("redis_url: redis://from-yaml:6379\nttl_seconds: 5\ngrpc_port: 6000\n")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    monkeypatch.setenv("TRACE_CONFIG_FILE", str(yaml_file))
    monkeypatch.setenv("TRACE_TTL_SECONDS", "7")
    monkeypatch.setenv("TRACE_AUTH_TOKEN_FILE", str(token_file))
    s = load_settings(DemoSettings)
    assert (s.redis_url, s.ttl_seconds, s.grpc_port, s.http_port) == (
        "redis://from-yaml:6379",
        7,
        6000,
        8050,
    )
    assert s.token() == "s3cret"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"TRACE_AUTH_TOKEN": "  "}, "token from TRACE_AUTH_TOKEN is empty"),
        ({"TRACE_AUTH_TOKEN_FILE": "/nonexistent/token"}, "is not a file"),
        ({"TRACE_AUTH_TOKEN": "t", "TRACE_TLS_CERT_FILE": "/c.pem"}, "TRACE_TLS_KEY_FILE"),
        ({"TRACE_AUTH_TOKEN": "t", "TRACE_TLS_CLIENT_CA_FILE": "/ca.pem"}, "mTLS"),
        ({"TRACE_AUTH_TOKEN": "t", "TRACE_CONFIG_FILE": "/nonexistent.yaml"}, "TRACE_CONFIG_FILE"),
    ],
)
def test_bad_auth_tls_config(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    needle: str,
) -> None:
    monkeypatch.setenv("TRACE_REDIS_URL", "redis://x:1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit):
        load_settings(DemoSettings)
    assert needle in capsys.readouterr().err
