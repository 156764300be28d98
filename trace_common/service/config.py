"""Typed service configuration: `TRACE_`-prefixed environment variables plus an optional YAML file.

Precedence (highest first): constructor arguments, environment variables, the YAML file named
by `TRACE_CONFIG_FILE`, field defaults. A missing or invalid setting stops the service at
start-up with a message naming the environment variable (`load_settings`).
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from typing import Any, Literal, TypeVar

from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

ENV_PREFIX = "TRACE_"
CONFIG_FILE_ENV = "TRACE_CONFIG_FILE"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # 64 MiB: one gRPC message (chunks are far smaller)


class ServiceSettings(BaseSettings):
    """Settings every TRACE service shares; each service subclasses it with its own fields."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    grpc_host: str = Field("0.0.0.0", description="interface the gRPC server binds")
    grpc_port: int = Field(50050, ge=0, le=65535, description="gRPC port (0 = any free port)")
    http_host: str = Field("0.0.0.0", description="interface of /healthz /readyz /metrics /status")
    http_port: int = Field(8050, ge=0, le=65535, description="HTTP port (0 = any free port)")
    http_enabled: bool = Field(True, description="serve /healthz /readyz /metrics /status")
    auth_token: SecretStr | None = Field(None, description="shared bearer token")
    auth_token_file: pathlib.Path | None = Field(None, description="file holding the token")
    auth_exempt_health: bool = Field(
        True, description="let grpc.health.v1 and reflection through without a token (probes)"
    )
    tls_cert_file: pathlib.Path | None = Field(None, description="server certificate (PEM)")
    tls_key_file: pathlib.Path | None = Field(None, description="server private key (PEM)")
    tls_client_ca_file: pathlib.Path | None = Field(
        None, description="CA for client certificates: set it to require mTLS"
    )
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, gt=0)
    max_workers: int = Field(64, gt=0, description="gRPC handler threads (streams hold one)")
    grace_seconds: float = Field(5.0, ge=0, description="graceful-shutdown drain time")
    log_level: str = Field("INFO")
    log_json: bool = Field(True, description="one JSON object per log line")

    @model_validator(mode="after")
    def _check_auth_and_tls(self) -> ServiceSettings:
        if self.auth_token is None and self.auth_token_file is None:
            raise ValueError(
                "auth: set TRACE_AUTH_TOKEN or TRACE_AUTH_TOKEN_FILE (shared bearer token)"
            )
        if self.auth_token_file is not None and not self.auth_token_file.is_file():
            raise ValueError(f"TRACE_AUTH_TOKEN_FILE={self.auth_token_file} is not a file")
        if not self.token():
            source = "TRACE_AUTH_TOKEN" if self.auth_token is not None else "TRACE_AUTH_TOKEN_FILE"
            raise ValueError(f"auth: the token from {source} is empty")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "TLS needs both TRACE_TLS_CERT_FILE and TRACE_TLS_KEY_FILE, got "
                f"cert={self.tls_cert_file} key={self.tls_key_file}"
            )
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("TRACE_TLS_CLIENT_CA_FILE (mTLS) needs TRACE_TLS_CERT_FILE/KEY_FILE")
        return self

    @classmethod
    def env_names(cls) -> frozenset[str]:
        """Every `TRACE_*` environment variable this service reads."""
        return frozenset(ENV_PREFIX + name.upper() for name in cls.model_fields)

    def token(self) -> str:
        """The bearer token (from the variable, else the file, stripped of whitespace)."""
        if self.auth_token is not None:
            token = self.auth_token.get_secret_value().strip()
        else:
            assert self.auth_token_file is not None
            token = self.auth_token_file.read_text().strip()
        return token

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        yaml_file = os.environ.get(CONFIG_FILE_ENV)
        if yaml_file:
            if not pathlib.Path(yaml_file).is_file():
                raise ValueError(f"{CONFIG_FILE_ENV}={yaml_file} is not a file")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)


S = TypeVar("S", bound=ServiceSettings)


class StoreClientSettings(ServiceSettings):
    """A service that is a client of both stores (the trainer, a rollout replica)."""

    weight_sync_address: str = Field(..., description="host:port of weight-sync (required)")
    quant_cache_address: str = Field(..., description="host:port of quant-cache (required)")
    quant_cache_data_path: Literal["auto", "direct", "grpc"] = Field(
        "auto",
        description="record bytes straight to/from Redis (direct, coordinates from quant-cache) "
        "or through quant-cache (grpc); auto = direct when Redis is reachable",
    )


def describe_errors(exc: ValidationError) -> list[str]:
    """One line per problem, naming the environment variable (`TRACE_REDIS_URL: ...`)."""
    lines = []
    for err in exc.errors():
        loc = "_".join(str(p) for p in err["loc"])
        name = f"{ENV_PREFIX}{loc.upper()}" if loc else "settings"
        kind = "missing required setting" if err["type"] == "missing" else err["msg"]
        lines.append(f"{name}: {kind}")
    return lines


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build `cls` from the environment; on a bad or missing setting exit(2) naming it."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        problems = "; ".join(describe_errors(exc))
        print(f"{cls.__name__}: invalid configuration: {problems}", file=sys.stderr)
        raise SystemExit(2) from exc
    except ValueError as exc:  # e.g. a JSON-valued setting that does not parse: name its variable
        text = re.sub(r'field "(\w+)"', lambda m: f"{ENV_PREFIX}{m.group(1).upper()}", str(exc))
        print(f"{cls.__name__}: invalid configuration: {text}", file=sys.stderr)
        raise SystemExit(2) from exc
