"""A short RL run of the whole local system (Redis, quant-cache, weight-sync, the trainer, a
rollout replica) with its secrets set to known values: the Redis password, the shared auth
token, and the records' HMAC key derived from it. No log line of any service, nor of the
driver (this process: its logging and its output), holds any of them, in clear, URL-encoded
or as hex/base64."""

from __future__ import annotations

import base64
import logging
import pathlib
import re
import time
import urllib.parse

import grpc
import pytest

from trace_common.clients.quant_cache import record_tag_key
from trace_common.launch.cluster import ClusterConfig, LocalCluster
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from trace_common.service.grpc_server import AUTH_HEADER

pytestmark = pytest.mark.timeout(300)

RUN_TIMEOUT_S = 150.0
TOKEN = "tok3n-Secret-4f8e1c2d9a7b"
# Characters that URL-encode (! * & = +), so the encoded form differs from the clear one;
# LocalRedis refuses whitespace, quotes, @, : and /.
REDIS_PASSWORD = "redis-Pw!S3cret*7&x=y+z"
# A Redis URL that carries credentials in clear: scheme://[user]:password@host
CREDENTIAL_URL = re.compile(r"rediss?://[^\s\"'@*]*:[^\s\"'@*]+@")


def secret_forms() -> dict[str, str]:
    key = record_tag_key(TOKEN)
    return {
        "auth token": TOKEN,
        "auth token, URL-encoded": urllib.parse.quote(TOKEN, safe=""),
        "Redis password": REDIS_PASSWORD,
        "Redis password, URL-encoded": urllib.parse.quote(REDIS_PASSWORD, safe=""),
        "Redis password, form-encoded": urllib.parse.quote_plus(REDIS_PASSWORD),
        "HMAC key, hex": key.hex(),
        "HMAC key, base64": base64.b64encode(key).decode(),
        "HMAC key, repr": repr(key)[2:-1],
    }


def test_no_secret_reaches_any_log(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = ClusterConfig(
        replicas=1,
        token=TOKEN,
        redis_password=REDIS_PASSWORD,
        run={
            "task": {"name": "reverse", "difficulty": 2},
            "prompts_per_step": 2,
            "group_size": 2,
            "steps": 2,
            "run_id": "secrets",
            "guidance": {"layers": "all", "mode": "full"},
        },
        # the most the services log: DEBUG, and guidance records at every layer
        trainer_env={"TRACE_START_PAUSED": "true", "TRACE_LOG_LEVEL": "DEBUG"},
        rollout_env={"TRACE_LOG_LEVEL": "DEBUG"},
    )
    with LocalCluster(cfg, tmp_path / "logs") as c:
        assert c.redis is not None and c.redis.password == REDIS_PASSWORD
        assert c.trainer is not None
        with grpc.insecure_channel(c.trainer.grpc_address) as ch:
            trainer_pb2_grpc.TrainerStub(ch).Resume(
                trainer_pb2.ResumeRequest(), metadata=((AUTH_HEADER, f"Bearer {TOKEN}"),),
                timeout=10,
            )  # fmt: skip
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while (st := c.trainer_status())["state"] not in ("finished", "failed"):
            assert time.monotonic() < deadline, f"trainer did not finish: {st}"
            time.sleep(0.3)
        assert st["state"] == "finished", st["detail"]
        assert st["step"] == 2
        # a refused token is logged too: the wrong one may be quoted, never the right one
        with grpc.insecure_channel(c.trainer.grpc_address) as ch, pytest.raises(grpc.RpcError):
            trainer_pb2_grpc.TrainerStub(ch).GetStatus(
                trainer_pb2.GetStatusRequest(), metadata=((AUTH_HEADER, "Bearer wrong"),),
                timeout=10,
            )  # fmt: skip
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")}
    assert {"quant-cache.log", "weight-sync.log", "trainer.log", "rollout-0.log"} <= set(logs)
    out, err = capfd.readouterr()
    logs["driver (logging)"] = caplog.text
    logs["driver (stdout, stderr)"] = out + err
    found = [
        f"{what} in {name}: {line[:300]}"
        for name, text in logs.items()
        for line in text.splitlines()
        for what, secret in secret_forms().items()
        if secret in line
    ]
    found += [
        f"credentials in a Redis URL in {name}: {m.group(0)}"
        for name, text in logs.items()
        for m in CREDENTIAL_URL.finditer(text)
    ]
    assert not found, "\n".join(found)
