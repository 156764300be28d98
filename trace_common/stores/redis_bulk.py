"""redis-py plumbing for moving large values without its copies (quant-cache's data path).

Both are plugged into an ordinary `redis.Redis` through its documented connection options
(`bulk_connection_options()`: `parser_class`, `command_packer`); the wire protocol, the
commands and the stored bytes are exactly redis-py's.

- `Joined(header, blob)`: a command argument sent as several buffers, one after the other,
  which Redis receives (and stores) as one value. redis-py's own packer would need them
  joined first, a copy of the whole blob into fresh memory per put.
- `BulkParser`: redis-py's pure-Python parser, except that a bulk reply of at least
  BIG_BULK_BYTES is received straight into its own buffer (`recv_into`) and returned as a
  bytearray. redis-py's reader copies each reply 3-4 times (recv -> its BytesIO -> out ->
  `[:-2]`), and in a pipeline its BytesIO grows to the whole batch.
"""

from __future__ import annotations

from redis._parsers import Encoder, _RESP3Parser
from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer
from redis.connection import PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.utils import SENTINEL

BIG_BULK_BYTES = 64 << 10  # smaller replies take redis-py's own path


class Joined:
    """One command argument made of several buffers (sent in order, never concatenated)."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: bytes | bytearray | memoryview) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes


class JoinedPacker(PythonRespSerializer):
    """redis-py's command packer, plus `Joined` arguments."""

    def __init__(self) -> None:
        super().__init__(6000, Encoder("utf-8", "strict", False).encode)

    def pack(self, *args: object) -> list[bytes | memoryview]:
        if not any(isinstance(a, Joined) for a in args):
            return super().pack(*args)
        out: list[bytes | memoryview] = []
        head = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, Joined):
                head.append(b"$%d\r\n" % arg.nbytes)
                for part in arg.parts:
                    if part.nbytes < self._buffer_cutoff:  # e.g. the header: one send
                        head.append(part.tobytes())
                    else:
                        out.append(b"".join(head))
                        out.append(part)
                        head = []
                head.append(b"\r\n")
            else:
                value = self.encode(arg)
                head.append(b"$%d\r\n%s\r\n" % (len(value), value))
        out.append(b"".join(head))
        return out


class _BulkSocketBuffer(SocketBuffer):
    def read(self, length: int, timeout: object = SENTINEL) -> bytes | bytearray:
        if length < BIG_BULK_BYTES or timeout is not SENTINEL:
            return super().read(length, timeout)
        out = bytearray(length + 2)  # + the CRLF terminator
        view = memoryview(out)
        got = self._buffer.readinto(view)  # what redis-py has buffered already
        while got < len(out):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise RedisConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
            got += n
        view.release()
        del out[length:]  # the CRLF (shrinks in place)
        return out


class BulkParser(_RESP3Parser):
    """redis-py's default pure-Python parser (RESP3; it reads RESP2 too), receiving big
    bulk replies straight into their buffer (module doc). A failed read leaves the socket
    mid-reply; redis-py disconnects on any read error."""

    def on_connect(self, connection) -> None:  # type: ignore[no-untyped-def]
        super().on_connect(connection)
        self._buffer = _BulkSocketBuffer(
            self._sock, self.socket_read_size, connection.socket_timeout
        )


def bulk_connection_options() -> dict[str, object]:
    """Keyword arguments for `redis.Redis(...)` / `from_url(...)` enabling both."""
    return {"parser_class": BulkParser, "command_packer": JoinedPacker()}
