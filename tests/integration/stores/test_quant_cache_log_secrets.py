"""quant-cache with its own local Redis logs no Redis password: every URL it writes to its
log has its credentials redacted."""

from __future__ import annotations

import json
import pathlib
import re
import secrets

from trace_common.service.process import LocalService

# A Redis URL that carries credentials in clear: scheme://[user]:password@host
CREDENTIAL_URL = re.compile(r"rediss?://[^\s\"'@*]*:[^\s\"'@*]+@")


def test_the_local_redis_password_stays_out_of_the_log(tmp_path: pathlib.Path) -> None:
    token = secrets.token_hex(16)
    with LocalService("quant-cache", "services.quant_cache", {"TRACE_AUTH_TOKEN": token,
                      "TRACE_GRPC_PORT": "0", "TRACE_HTTP_PORT": "0"}, tmp_path) as svc:  # fmt: skip
        log = svc.log()
    started = [json.loads(x) for x in log.splitlines()
               if x.startswith("{") and "started a local redis-server" in x]  # fmt: skip
    assert started, log[-2000:]
    assert started[0]["redis_url"].startswith("redis://***@127.0.0.1:")
    assert not CREDENTIAL_URL.search(log), CREDENTIAL_URL.search(log)
    assert token not in log
