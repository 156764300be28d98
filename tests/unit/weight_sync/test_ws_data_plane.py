"""weight-sync's bulk data plane: the framing, the ticket rules, and the replica's receive
(truncation, corruption, refusals) over real loopback sockets, the service in-process."""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from test_ws_servicer import TENSORS, Ctx, header, make, messages

from services.weight_sync.data_plane import DataPlane, parse_advertise
from services.weight_sync.servicer import WeightSyncServicer
from trace_common.clients import DirectPathError
from trace_common.clients.tensors import TensorAssembler
from trace_common.clients.weight_sync import receive_version
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.service import Metrics, ServiceError
from trace_common.stores import ws_data_plane as wire

WANT = b"".join(TENSORS.values())  # the bytes the data plane sends for a TENSORS version


# -- framing ----------------------------------------------------------------------------------
def test_request_and_reply_framing_round_trip_and_reject_bad_input() -> None:
    ticket = bytes(range(wire.TICKET_BYTES))
    request = wire.encode_request(ticket)
    assert request == b"TWS1" + ticket and len(request) == wire.REQUEST_BYTES == 36
    assert wire.decode_request(request) == ticket
    with pytest.raises(ValueError, match="a ticket is 32 bytes, got 3"):
        wire.encode_request(b"abc")
    with pytest.raises(ValueError, match="request is 35 bytes, expected 36"):
        wire.decode_request(request[:-1])
    with pytest.raises(ValueError, match=r"request magic b'GET ' != b'TWS1'"):
        wire.decode_request(b"GET " + ticket)

    reply = wire.encode_reply(wire.Status.OK, (5 << 32) + 7)
    # magic, status byte, 3 zero bytes, little-endian u64 length
    assert reply == b"TWSR" + b"\x00" + b"\x00" * 3 + bytes([7, 0, 0, 0, 5, 0, 0, 0])
    assert wire.decode_reply(reply) == (wire.Status.OK, (5 << 32) + 7)
    with pytest.raises(ValueError, match="reply magic"):
        wire.decode_reply(b"XXXX" + reply[4:])
    with pytest.raises(ValueError, match="unknown reply status 9"):
        wire.decode_reply(reply[:4] + b"\x09" + reply[5:])
    with pytest.raises(ValueError, match="reply header is 15 bytes"):
        wire.decode_reply(reply[:-1])

    refused = wire.refusal(wire.Status.BAD_TICKET, "x" * 10_000)
    status, length = wire.decode_reply(refused[: wire.REPLY_BYTES])
    assert status == wire.Status.BAD_TICKET and length == wire.MAX_REASON_BYTES
    assert len(refused) == wire.REPLY_BYTES + wire.MAX_REASON_BYTES
    assert wire.Status.BAD_TICKET.grpc_code == grpc.StatusCode.UNAUTHENTICATED
    assert wire.Status.BAD_REQUEST.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


def test_parse_advertise() -> None:
    assert parse_advertise("", 50062) == ("", 50062)
    assert parse_advertise("weight-sync", 50062) == ("weight-sync", 50062)
    assert parse_advertise("10.0.0.5:7000", 50062) == ("10.0.0.5", 7000)
    for bad in ("host:", ":7000", "host:x", "host:70000"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_advertise(bad, 1)


def test_assembler_fill_receives_in_place_and_reports_eof() -> None:
    spec = common_pb2.TensorSpec(
        name="w", dtype="uint8", shape=[6], nbytes=6, crc32=zlib.crc32(b"abcdef")
    )
    pieces = [b"ab", b"cde", b"f"]
    part = TensorAssembler(spec)
    part.fill(_feeder(pieces))
    assert bytes(part.tensor().numpy()) == b"abcdef"
    part = TensorAssembler(spec)
    with pytest.raises(EOFError, match="connection closed after 5 of 6 bytes"):
        part.fill(_feeder(pieces[:2]))


def _feeder(pieces: list[bytes]) -> Callable[[memoryview], int]:
    """A recv_into over `pieces`, then EOF."""
    queue = list(pieces)

    def recv_into(view: memoryview) -> int:
        if not queue:
            return 0
        piece = queue.pop(0)
        view[: len(piece)] = piece
        return len(piece)

    return recv_into


# -- the replica's receive against a scripted peer --------------------------------------------
def _scripted(reply: bytes, header: pb.VersionHeader) -> dict[str, torch.Tensor]:
    """receive_version against a peer that reads the request, sends `reply`, and closes."""
    ours, theirs = socket.socketpair()

    def peer() -> None:
        with theirs:
            wire.recv_exact(theirs, wire.REQUEST_BYTES)
            theirs.sendall(reply)

    threading.Thread(target=peer, daemon=True).start()
    with ours:
        return receive_version(ours, b"t" * wire.TICKET_BYTES, header, "peer")


def _header() -> pb.VersionHeader:
    return header(1, TENSORS)


def test_receive_version_exact_truncated_corrupt_and_refused() -> None:
    ok = wire.encode_reply(wire.Status.OK, len(WANT))
    got = _scripted(ok + WANT, _header())
    assert {k: bytes(v.numpy()) for k, v in got.items()} == TENSORS

    with pytest.raises(DirectPathError, match="truncated transfer of version 1") as err:
        _scripted(ok + WANT[:-1], _header())
    assert err.value.code() == grpc.StatusCode.DATA_LOSS

    flipped = bytearray(WANT)
    flipped[2] ^= 0x01
    with pytest.raises(ValueError, match=r"tensor 'a': crc32 0x[0-9a-f]+ != expected"):
        _scripted(ok + bytes(flipped), _header())

    short = wire.encode_reply(wire.Status.OK, len(WANT) - 1)
    with pytest.raises(DirectPathError, match="sends 9 bytes for version 1") as err:
        _scripted(short + WANT[:-1], _header())
    assert err.value.code() == grpc.StatusCode.DATA_LOSS

    with pytest.raises(DirectPathError, match="refused the pull: ticket already used") as err:
        _scripted(wire.refusal(wire.Status.BAD_TICKET, "ticket already used"), _header())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    with pytest.raises(DirectPathError, match="closed the connection before replying") as err:
        _scripted(b"", _header())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    with pytest.raises(DirectPathError, match="reply magic") as err:
        _scripted(b"HTTP/1.1 400 Bad", _header())
    assert err.value.code() == grpc.StatusCode.DATA_LOSS


# -- the service side, in-process --------------------------------------------------------------
@pytest.fixture()
def served() -> Iterator[tuple[WeightSyncServicer, DataPlane]]:
    s = make()
    plane = DataPlane(
        "127.0.0.1", 0, Metrics("weight_sync"), s.count_pull, ticket_seconds=0.5, max_tickets=2
    )
    s.data_plane = plane
    s.PushVersion(iter(messages(3, TENSORS)), Ctx())
    yield s, plane
    plane.close()


def _pull(reply: pb.PullTicketResponse) -> dict[str, torch.Tensor]:
    with socket.create_connection(("127.0.0.1", reply.data_port), 5) as sock:
        return receive_version(sock, reply.ticket, reply.header, "test")


def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _refused(plane: DataPlane, reason: str) -> float:
    return plane.refused.labels(reason)._value.get()


def test_ticket_is_single_use_short_lived_and_unforgeable(
    served: tuple[WeightSyncServicer, DataPlane],
) -> None:
    s, plane = served
    reply = s.GetPullTicket(pb.PullTicketRequest(replica_id="r0"), Ctx())
    assert reply.header.version == 3 and len(reply.ticket) == wire.TICKET_BYTES
    assert reply.data_host == "" and reply.data_port == plane.port
    assert reply.expires_in_seconds == 0.5
    got = _pull(reply)
    assert {k: bytes(v.numpy()) for k, v in got.items()} == TENSORS
    # Counted like a gRPC pull, by the sending thread once its last sendall returns.
    assert _eventually(lambda: s.pull_bytes.labels("r0")._value.get() == len(WANT))

    with pytest.raises(DirectPathError, match="ticket already used") as err:
        _pull(reply)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and _refused(plane, "used") == 1

    forged = pb.PullTicketResponse()
    forged.CopyFrom(reply)
    forged.ticket = bytes(wire.TICKET_BYTES)
    with pytest.raises(DirectPathError, match="unknown ticket") as err:
        _pull(forged)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and _refused(plane, "unknown") == 1

    late = s.GetPullTicket(pb.PullTicketRequest(version=3, replica_id="r0"), Ctx())
    time.sleep(0.6)
    with pytest.raises(DirectPathError, match=r"ticket expired \(tickets last 0.5 s\)"):
        _pull(late)
    assert _refused(plane, "expired") == 1
    assert s.pull_bytes.labels("r0")._value.get() == len(WANT), "refusals send nothing"

    with socket.create_connection(("127.0.0.1", plane.port), 5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 18)
        status, length = wire.decode_reply(wire.recv_exact(sock, wire.REPLY_BYTES))
        assert status == wire.Status.BAD_REQUEST
        assert b"request magic" in wire.recv_exact(sock, length)
    assert _refused(plane, "bad_request") == 1


def test_ticket_rpc_errors_and_outstanding_bound(
    served: tuple[WeightSyncServicer, DataPlane],
) -> None:
    s, _ = served

    def code(request: pb.PullTicketRequest) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(ServiceError) as err:
            s.GetPullTicket(request, Ctx())
        return err.value.code, err.value.message

    assert code(pb.PullTicketRequest(version=9, replica_id="r0")) == (
        grpc.StatusCode.NOT_FOUND,
        "version 9 is not available; kept: [3]",
    )
    assert (
        code(pb.PullTicketRequest(version=-2, replica_id="r0"))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "replica_id='a b'" in code(pb.PullTicketRequest(replica_id="a b"))[1]
    s.GetPullTicket(pb.PullTicketRequest(replica_id="r1"), Ctx())
    s.GetPullTicket(pb.PullTicketRequest(replica_id="r2"), Ctx())
    status, message = code(pb.PullTicketRequest(replica_id="r3"))
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tickets=2" in message
    time.sleep(0.6)  # expired tickets stop counting
    assert s.GetPullTicket(pb.PullTicketRequest(replica_id="r3"), Ctx()).ticket

    s.data_plane = None
    status, message = code(pb.PullTicketRequest(replica_id="r0"))
    assert status == grpc.StatusCode.FAILED_PRECONDITION and "PullVersion" in message


def test_ticket_keeps_a_dropped_version(served: tuple[WeightSyncServicer, DataPlane]) -> None:
    """A version dropped (keep last K) after its ticket was issued is still sent whole."""
    s, _ = served
    reply = s.GetPullTicket(pb.PullTicketRequest(version=3, replica_id="r0"), Ctx())
    for v in (4, 5):
        s.PushVersion(iter(messages(v, TENSORS)), Ctx())
    assert [v.version for v in s.versions.all()] == [4, 5]
    got = _pull(reply)
    assert {k: bytes(v.numpy()) for k, v in got.items()} == TENSORS


def test_tickets_per_replica_are_bounded() -> None:
    s = make()
    plane = DataPlane(
        "127.0.0.1", 0, Metrics("weight_sync"), s.count_pull,
        ticket_seconds=5, max_tickets=10, max_tickets_per_replica=2,
    )  # fmt: skip
    s.data_plane = plane
    try:
        s.PushVersion(iter(messages(3, TENSORS)), Ctx())
        for _ in range(2):
            s.GetPullTicket(pb.PullTicketRequest(replica_id="greedy"), Ctx())
        with pytest.raises(ServiceError) as err:
            s.GetPullTicket(pb.PullTicketRequest(replica_id="greedy"), Ctx())
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "replica_id='greedy' holds 2 unused" in err.value.message
        # another replica is not affected, and a redeemed ticket frees its slot
        reply = s.GetPullTicket(pb.PullTicketRequest(replica_id="honest"), Ctx())
        _pull(reply)
        s.GetPullTicket(pb.PullTicketRequest(replica_id="honest"), Ctx())
        s.GetPullTicket(pb.PullTicketRequest(replica_id="honest"), Ctx())
    finally:
        plane.close()
