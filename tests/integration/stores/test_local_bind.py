"""The one-machine launcher (LocalCluster) binds loopback only: weight-sync started the way
it starts it listens on 127.0.0.1 for gRPC, HTTP and the bulk data plane, whatever the
services' own default (0.0.0.0, which Compose and the Helm chart set explicitly)."""

from __future__ import annotations

import pathlib

import httpx

from trace_common.launch.cluster import ClusterConfig, LocalCluster

LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp
# 127.0.0.1 as /proc/net/tcp writes it (little-endian hex), and as ::ffff:127.0.0.1 in
# /proc/net/tcp6 (gRPC listens on an IPv4-mapped IPv6 socket).
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if state == LISTEN and int(port_hex, 16) == port:
                found.add(address)
    return found


def test_the_local_launcher_binds_loopback(tmp_path: pathlib.Path) -> None:
    cluster = LocalCluster(ClusterConfig(replicas=1), tmp_path)
    ws = cluster._weight_sync(port=0).launch()
    try:
        ws.wait_ports().wait_serving()
        data_port = httpx.get(f"{ws.http_url}/status").json()["data_plane_port"]
        for what, port in (("grpc", ws.grpc_port), ("http", ws.http_port), ("data", data_port)):
            listening = _listening(port)
            assert listening and listening <= LOOPBACK, (what, port, listening)
    finally:
        ws.stop()
