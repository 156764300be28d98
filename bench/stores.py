"""Throughput of the two store services against the raw transports they sit on.

quant-cache: put then get of record blobs (64 KiB .. 16 MiB) with QuantCacheClient on its
default (direct) data path -- the client reads and writes Redis itself in the service's
layout (header, CRC-32, TTL, counters), with the coordinates from the service -- and on
its gRPC path (every byte through the service), vs redis-py on the same Redis in the same
run, both one SET/GET per record and pipelined (SETs in a pipeline, MGET) with the client's
batch size.
weight-sync: push of one policy version, then a concurrent pull by 1 and 4 replica
processes with WeightSyncClient on its default (auto: the bulk data plane) path and on its
gRPC path, vs a raw TCP socket copy of the same bytes to the same number of processes.
All on loopback. Prints a table (and writes a PNG with --plot).

    python bench/stores.py [--qc-total-mib 64] [--ws-mib 128] [--repeats 5] [--plot docs/stores_bench.png]

Each number is the median of --repeats runs after one warm-up run, the paths interleaved.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from trace_common.clients import QuantCacheClient, WeightSyncClient
from trace_common.clients.quant_cache import DEFAULT_CHUNK_BYTES as QC_DEFAULT_CHUNK
from trace_common.clients.tensors import tensor_to_wire
from trace_common.service.testing import ServiceProcess
from trace_common.stores.redis_local import LocalRedis, LocalRedisConfig

TOKEN = "bench-token"
KIB, MIB = 1 << 10, 1 << 20
RECORD_SIZES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
QC_BATCH_BYTES = 8 * MIB  # records per call: a batch of about this many bytes (at least one)
QC_CHUNK = QC_DEFAULT_CHUNK  # message size of QuantCacheClient and the gRPC-only echo
RAW_CHUNK = 4 * MIB  # recv/send block for the raw socket copy
DEFAULT_PULL_PATHS: set[str] = set()  # data paths the default ("service") pullers used
console = Console(width=150)


@dataclass(slots=True)
class Row:
    name: str
    size: str
    service_mb_s: float
    raw_mb_s: float
    raw_batched_mb_s: float | None = None  # quant-cache only: redis-py pipelined/MGET
    grpc_only_mb_s: float | None = None  # quant-cache only: the gRPC hop alone, no Redis
    grpc_path_mb_s: float | None = None  # the service's gRPC data path (default: direct)

    @property
    def ratio(self) -> float:
        return self.service_mb_s / self.raw_mb_s


def mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def median_of(repeats: int, fn: Callable[[], float]) -> float:
    """Median throughput of `repeats` runs after one warm-up run that is not counted."""
    fn()
    return statistics.median(fn() for _ in range(repeats))


# -- quant-cache ------------------------------------------------------------------------------
def _qc_runs(
    raw: redis.Redis, size: int, n: int, blobs: list[bytes]
) -> tuple[Callable[[QuantCacheClient], float], Callable[[], float], Callable[[], float]]:
    """(service via a client, raw SET/GET, raw pipelined) runs: put n records, get them
    back, MB/s."""
    batch = max(1, QC_BATCH_BYTES // size)
    groups = [list(range(i, min(n, i + batch))) for i in range(0, n, batch)]
    moved = 2 * n * size

    def service(qc: QuantCacheClient) -> float:
        start = time.perf_counter()
        for g in groups:
            qc.put_many("bench", 0, {f"s{i}": blobs[i % len(blobs)] for i in g})
        for g in groups:
            got = qc.get_records("bench", 0, [f"s{i}" for i in g], missing_ok=False)
            assert all(len(v) == size for v in got.values())
        return mb_s(moved, time.perf_counter() - start)

    def raw_single() -> float:
        start = time.perf_counter()
        for i in range(n):
            raw.set(f"raw:{i}", blobs[i % len(blobs)], ex=3600)
        for i in range(n):
            assert len(raw.get(f"raw:{i}")) == size
        return mb_s(moved, time.perf_counter() - start)

    def raw_pipelined() -> float:
        start = time.perf_counter()
        for g in groups:
            pipe = raw.pipeline(transaction=False)
            for i in g:
                pipe.set(f"raw:{i}", blobs[i % len(blobs)], ex=3600)
            pipe.execute()
        for g in groups:
            assert all(len(v) == size for v in raw.mget([f"raw:{i}" for i in g]))
        return mb_s(moved, time.perf_counter() - start)

    return service, raw_single, raw_pipelined


def _echo_server(ports_file: str) -> None:
    """Subprocess: the gRPC hop alone. Put streams are read and dropped; Get streams back
    `n` records of `size` bytes. Same message sizes and thread pool as a service, no Redis."""
    import json
    from concurrent import futures

    import grpc

    blobs: dict[int, bytes] = {}

    def put(messages: Iterator[bytes], ctx: object) -> bytes:
        for _ in messages:
            pass
        return b""

    def get(req: bytes, ctx: object) -> Iterator[bytes]:
        n, size = int.from_bytes(req[:8], "little"), int.from_bytes(req[8:], "little")
        blob = blobs.setdefault(size, os.urandom(size))
        for _ in range(n):
            for off in range(0, size, QC_CHUNK):
                yield blob[off : off + QC_CHUNK] if size > QC_CHUNK else blob

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Put": grpc.stream_unary_rpc_method_handler(put),
            "Get": grpc.unary_stream_rpc_method_handler(get),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(8), options=_ECHO_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = f"{ports_file}.tmp"
    with open(tmp, "w") as f:
        json.dump({"grpc": port}, f)
    os.replace(tmp, ports_file)
    server.wait_for_termination()


_ECHO_OPTIONS = [
    ("grpc.max_send_message_length", 64 * MIB),
    ("grpc.max_receive_message_length", 64 * MIB),
]


class Echo:
    """Client of the echo subprocess: the same bytes over the gRPC hop only."""

    def __init__(self) -> None:
        import json
        import tempfile

        import grpc

        self._dir = tempfile.TemporaryDirectory()
        ports = os.path.join(self._dir.name, "ports.json")
        self.proc = subprocess.Popen([sys.executable, __file__, "--echo-server", ports])
        while not os.path.exists(ports):
            time.sleep(0.05)
        with open(ports) as f:
            port = json.load(f)["grpc"]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=_ECHO_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.put = self.channel.stream_unary("/bench.Echo/Put")
        self.get = self.channel.unary_stream("/bench.Echo/Get")

    def run(self, groups: list[list[int]], size: int, blobs: list[bytes]) -> float:
        """put+get of the same records through the gRPC hop only; MB/s."""

        def messages(g: list[int]) -> Iterator[bytes]:
            for i in g:
                blob = blobs[i % len(blobs)]
                for off in range(0, size, QC_CHUNK):
                    yield blob[off : off + QC_CHUNK] if size > QC_CHUNK else blob

        start = time.perf_counter()
        for g in groups:
            self.put(messages(g))
        for g in groups:
            request = len(g).to_bytes(8, "little") + size.to_bytes(8, "little")
            assert sum(len(m) for m in self.get(request)) == len(g) * size
        return mb_s(2 * sum(map(len, groups)) * size, time.perf_counter() - start)

    def close(self) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.wait()
        self._dir.cleanup()


def bench_quant_cache(total_bytes: int, repeats: int, progress: Progress) -> list[Row]:
    rows = []
    with LocalRedis(LocalRedisConfig(maxmemory_bytes=4 * total_bytes + 256 * MIB)) as server:
        raw = redis.Redis.from_url(server.url)
        env = {
            "TRACE_AUTH_TOKEN": TOKEN,
            "TRACE_REDIS_URL": server.url,
            "TRACE_LOG_LEVEL": "WARNING",
        }
        with ServiceProcess("services.quant_cache", env) as svc:
            qc = QuantCacheClient(svc.grpc_address, TOKEN)  # the default: direct here
            assert qc.path == "direct", f"expected the direct data path, got {qc.path}"
            qc_grpc = QuantCacheClient(svc.grpc_address, TOKEN, data_path="grpc")
            echo = Echo()
            task = progress.add_task("quant-cache", total=len(RECORD_SIZES))
            for size in RECORD_SIZES:
                n = max(8, total_bytes // size)
                blobs = [os.urandom(size) for _ in range(min(n, 8))]  # reused round-robin
                service, single, pipelined = _qc_runs(raw, size, n, blobs)
                # Interleave the paths so that load changes hit all of them alike.
                batch = max(1, QC_BATCH_BYTES // size)
                groups = [list(range(i, min(n, i + batch))) for i in range(0, n, batch)]
                results: dict[str, list[float]] = {
                    "svc": [], "one": [], "pipe": [], "hop": [], "svc_grpc": []
                }  # fmt: skip
                for rep in range(repeats + 1):  # the first round warms up, not counted
                    for name, run in (
                        ("svc", functools.partial(service, qc)),
                        ("one", single),
                        ("pipe", pipelined),
                        ("hop", functools.partial(echo.run, groups, size, blobs)),
                        ("svc_grpc", functools.partial(service, qc_grpc)),
                    ):
                        value = run()
                        if rep:
                            results[name].append(value)
                med = {k: statistics.median(v) for k, v in results.items()}
                rows.append(
                    Row(
                        "quant-cache put+get",
                        _size(size),
                        med["svc"],
                        med["one"],
                        med["pipe"],
                        med["hop"],
                        med["svc_grpc"],
                    )
                )
                qc.delete("bench")
                raw.flushdb()
                progress.advance(task)
            echo.close()
            qc.close()
            qc_grpc.close()
        raw.close()
    return rows


# -- weight-sync ------------------------------------------------------------------------------
def make_policy(total_bytes: int) -> dict[str, torch.Tensor]:
    """NVFP4 expert weights (uint8 packed + e4m3 scales + fp32 scale_2) and BF16 tensors."""
    out, inp = 2048, 2048
    per_expert = out * inp // 2 + out * inp // 16 + 4
    tensors: dict[str, torch.Tensor] = {}
    i = 0
    while (
        sum(t.numel() * t.element_size() for t in tensors.values()) + per_expert < total_bytes * 0.8
    ):
        p = f"layers.{i // 8}.mlp.experts.{i % 8}.down_proj"
        tensors[f"{p}.weight"] = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8)
        tensors[f"{p}.weight_scale"] = torch.rand(out, inp // 16).to(torch.float8_e4m3fn)
        tensors[f"{p}.weight_scale_2"] = torch.tensor(0.01)
        i += 1
    rest = total_bytes - sum(t.numel() * t.element_size() for t in tensors.values())
    tensors["embed_tokens.weight"] = torch.randn(max(1, rest // (2 * inp)), inp).bfloat16()
    return tensors


def _worker(kind: str, address: str, replica_id: str) -> None:
    """Subprocess: wait for 'go' on stdin, pull everything, print seconds and bytes.
    "service": WeightSyncClient on its default data path (auto: the bulk data plane);
    "grpc": the same client on its gRPC path (PullVersion)."""
    if kind in ("service", "grpc"):
        data_path = "auto" if kind == "service" else "grpc"
        ws = WeightSyncClient(address, TOKEN, data_path=data_path)
        ws.register(replica_id, "bench:0")
        ws.wait_ready()
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    path = "raw"
    if kind in ("service", "grpc"):
        _, tensors, _ = ws.pull_version(replica_id=replica_id)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        path = ws.path
    else:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            total = int.from_bytes(_recv_exact(sock, 8), "little")
            buf = bytearray(total)
            view, got = memoryview(buf), 0
            while got < total:
                n = sock.recv_into(view[got : got + RAW_CHUNK])
                if n == 0:
                    raise ConnectionError("raw sender closed early")
                got += n
            nbytes = got
    print(f"{time.perf_counter() - start} {nbytes} {path}", flush=True)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def _run_pullers(kind: str, address: str, replicas: int, expected: int) -> float:
    """Start `replicas` worker processes, release them together, return aggregate MB/s."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--address", address, "--replica-id", f"r{i}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for i in range(replicas)
    ]  # fmt: skip
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    start = time.perf_counter()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        _, nbytes, path = p.stdout.readline().split()
        assert int(nbytes) == expected, f"worker got {nbytes} of {expected} bytes"
        if kind == "service":
            DEFAULT_PULL_PATHS.add(path)
    elapsed = time.perf_counter() - start  # last worker done (process exit not counted)
    for p in procs:
        p.wait()
    return mb_s(replicas * expected, elapsed)


class RawSender:
    """Raw TCP: sends `payload` (length-prefixed) to every connecting client, a thread each."""

    def __init__(self, payload: memoryview) -> None:
        self.payload = payload
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._send, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket) -> None:
        with conn:
            conn.sendall(len(self.payload).to_bytes(8, "little"))
            for off in range(0, len(self.payload), RAW_CHUNK):
                conn.sendall(self.payload[off : off + RAW_CHUNK])

    def close(self) -> None:
        self.sock.close()


def bench_weight_sync(total_bytes: int, repeats: int, progress: Progress) -> list[Row]:
    policy = make_policy(total_bytes)
    payload_bytes = b"".join(bytes(tensor_to_wire(n, t)[1]) for n, t in policy.items())
    nbytes = len(payload_bytes)
    rows = []
    env = {"TRACE_AUTH_TOKEN": TOKEN, "TRACE_KEEP_VERSIONS": "2", "TRACE_LOG_LEVEL": "WARNING"}
    task = progress.add_task("weight-sync", total=2 + (repeats + 1) * 6)
    with ServiceProcess("services.weight_sync", env) as svc:
        ws = WeightSyncClient(svc.grpc_address, TOKEN)
        version = 0

        def push() -> float:
            nonlocal version
            version += 1
            start = time.perf_counter()
            ws.push_version(version, policy, {"bench": True})
            return mb_s(nbytes, time.perf_counter() - start)

        push_mb_s = median_of(repeats, push)
        progress.advance(task)
        raw_push_mb_s = median_of(repeats, lambda: _raw_push(payload_bytes))
        progress.advance(task)
        rows.append(Row("weight-sync push", _size(nbytes), push_mb_s, raw_push_mb_s))
        sender = RawSender(memoryview(payload_bytes))
        for replicas in (1, 4):
            pulls, grpcs, raws = [], [], []
            for rep in range(repeats + 1):  # the first round warms up, not counted
                pull = _run_pullers("service", svc.grpc_address, replicas, nbytes)
                progress.advance(task)
                grpc_pull = _run_pullers("grpc", svc.grpc_address, replicas, nbytes)
                progress.advance(task)
                raw_pull = _run_pullers("raw", sender.address, replicas, nbytes)
                progress.advance(task)
                if rep:
                    pulls.append(pull)
                    grpcs.append(grpc_pull)
                    raws.append(raw_pull)
            rows.append(
                Row(
                    f"weight-sync pull x{replicas}",
                    _size(nbytes),
                    statistics.median(pulls),
                    statistics.median(raws),
                    grpc_path_mb_s=statistics.median(grpcs),
                )
            )
        sender.close()
    # push + pull to N replicas: bytes moved over the time of both phases.
    for row in [r for r in rows if r.name.startswith("weight-sync pull")]:
        replicas = int(row.name.rsplit("x", 1)[1])
        assert row.grpc_path_mb_s is not None
        rows.append(
            Row(
                f"weight-sync push+pull x{replicas}",
                _size(nbytes),
                _push_pull(nbytes, replicas, push_mb_s, row.service_mb_s),
                _push_pull(nbytes, replicas, raw_push_mb_s, row.raw_mb_s),
                grpc_path_mb_s=_push_pull(nbytes, replicas, push_mb_s, row.grpc_path_mb_s),
            )
        )
    return rows


def _push_pull(nbytes: int, replicas: int, push_mb_s: float, pull_mb_s: float) -> float:
    """MB/s of one push and `replicas` pulls of `nbytes`, one after the other."""
    seconds = nbytes / (push_mb_s * 1e6) + replicas * nbytes / (pull_mb_s * 1e6)
    return mb_s((1 + replicas) * nbytes, seconds)


def _raw_push(payload: bytes) -> float:
    """Raw TCP push to a receiving subprocess (the raw worker, reversed: it connects to us)."""
    sender = RawSender(memoryview(payload))
    try:
        return _run_pullers("raw", sender.address, 1, len(payload))
    finally:
        sender.close()


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def print_table(rows: list[Row]) -> None:
    table = Table(title="TRACE stores: service vs raw transport (loopback, MB/s = 1e6 B/s)")
    cols = (
        "path",
        "size",
        "service MB/s",
        "raw MB/s",
        "service / raw",
        "raw batched MB/s",
        "service / batched",
        "via gRPC MB/s",
        "via gRPC / raw",
        "gRPC hop only MB/s",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("path", "size") else "right")
    for r in rows:
        batched = r.raw_batched_mb_s
        extra = (
            ("-", "-")
            if batched is None
            else (f"{batched:,.0f}", f"{r.service_mb_s / batched:.0%}")
        )
        via = r.grpc_path_mb_s
        via_cols = ("-", "-") if via is None else (f"{via:,.0f}", f"{via / r.raw_mb_s:.0%}")
        hop = "-" if r.grpc_only_mb_s is None else f"{r.grpc_only_mb_s:,.0f}"
        table.add_row(
            r.name,
            r.size,
            f"{r.service_mb_s:,.0f}",
            f"{r.raw_mb_s:,.0f}",
            f"{r.ratio:.0%}",
            *extra,
            *via_cols,
            hop,
        )
    console.print(table)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r.name}\n{r.size}" for r in rows]
    x = list(range(len(rows)))
    w = 0.16
    series = [
        ("raw: redis-py SET/GET, TCP socket copy", [r.raw_mb_s for r in rows]),
        ("raw: redis-py pipelined", [r.raw_batched_mb_s or 0 for r in rows]),
        ("gRPC hop only (no Redis)", [r.grpc_only_mb_s or 0 for r in rows]),
        (
            "via gRPC (every byte through the service's gRPC stream)",
            [r.grpc_path_mb_s or 0 for r in rows],
        ),
        ("TRACE service (default: direct data paths)", [r.service_mb_s for r in rows]),
    ]
    for k, (label, values) in enumerate(series):
        ax.bar([i + (k - 2) * w for i in x], values, w, label=label)
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("MB/s")
    ax.set_title("quant-cache vs redis-py, weight-sync vs raw TCP (loopback)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qc-total-mib", type=int, default=64, help="bytes per record size")
    parser.add_argument("--ws-mib", type=int, default=128, help="policy version size")
    parser.add_argument(
        "--repeats", type=int, default=5, help="counted runs (median), after a warm-up"
    )
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
    parser.add_argument("--skip", choices=["qc", "ws"], default=None, help="leave one part out")
    parser.add_argument("--worker", choices=["service", "grpc", "raw"], help=argparse.SUPPRESS)
    parser.add_argument("--echo-server", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--replica-id", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        _echo_server(args.echo_server)
        return
    if args.worker:
        _worker(args.worker, args.address, args.replica_id)
        return
    console.print(f"cpus: {os.cpu_count()}, load average before: {os.getloadavg()}")
    rows: list[Row] = []
    with Progress(console=console, transient=True) as progress:
        if args.skip != "qc":
            rows += bench_quant_cache(args.qc_total_mib * MIB, args.repeats, progress)
        if args.skip != "ws":
            rows += bench_weight_sync(args.ws_mib * MIB, args.repeats, progress)
    console.print(f"load average after: {os.getloadavg()}")
    print_table(rows)
    qc = [r for r in rows if r.raw_batched_mb_s]
    if qc:
        one = statistics.median(r.ratio for r in qc)
        piped = statistics.median(r.service_mb_s / r.raw_batched_mb_s for r in qc)
        via = statistics.median(r.grpc_path_mb_s / r.raw_mb_s for r in qc if r.grpc_path_mb_s)
        console.print(
            f"quant-cache (direct) / redis-py: median {one:.0%} of SET/GET, {piped:.0%} of "
            f"pipelined (target >= 70%); via gRPC: median {via:.0%} of SET/GET"
        )
    ws = [r.ratio for r in rows if "push+pull" in r.name]
    if ws:
        console.print(f"weight-sync default pulls used data paths: {sorted(DEFAULT_PULL_PATHS)}")
        console.print(
            f"weight-sync push+pull / raw socket: {', '.join(f'{x:.0%}' for x in ws)} (target >= 50%)"
        )
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
