"""quant-cache under a token holder who declares huge records and sends little: memory
follows the bytes received, not total_bytes (real subprocess, real Redis, real gRPC)."""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2 as pb
from trace_common.protos_gen.trace.quantcache.v1 import quantcache_pb2_grpc as pb_grpc
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.testing import ServiceProcess
from trace_common.stores.redis_local import LocalRedis

TOKEN = "abuse-test-token"
DECLARED = 256 << 20  # what each stream claims (= max_record_bytes)
STREAMS = 6


def _rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_declared_sizes_are_not_allocated_before_data_arrives(local_redis: LocalRedis) -> None:
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_REDIS_URL": local_redis.url,
           "TRACE_MAX_RECORD_BYTES": str(DECLARED)}  # fmt: skip
    with ServiceProcess("services.quant_cache", env) as svc:
        assert svc.proc is not None
        stub = pb_grpc.QuantCacheStub(grpc.insecure_channel(svc.grpc_address))
        meta = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
        before = _rss_bytes(svc.proc.pid)
        release = threading.Event()

        def chunks(i: int) -> Iterator[pb.PutRecordsChunk]:
            key = pb.RecordKey(run_id="abuse", policy_version=0, sample_id=f"s{i}")
            yield pb.PutRecordsChunk(key=key, total_bytes=DECLARED, crc32=0, data=b"x" * 1024)
            release.wait(30)  # hold the stream open with the record unfinished

        calls = [stub.PutRecords.future(chunks(i), metadata=meta) for i in range(STREAMS)]
        time.sleep(2.0)  # every stream's first message has arrived
        grown = _rss_bytes(svc.proc.pid) - before
        release.set()
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call.result(timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"stream ended after 1024 of total_bytes={DECLARED}" in err.value.details()
        # 6 x 256 MiB declared; allocating them up front grew the process by 1,045 MiB here
        assert grown < 64 << 20, f"quant-cache grew {grown / 2**20:.0f} MiB"
        print(f"RSS growth with {STREAMS} x {DECLARED >> 20} MiB declared: {grown / 2**20:.1f} MiB")
