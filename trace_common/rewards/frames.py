"""Length-prefixed pickle frames between the reward pool and its workers."""

from __future__ import annotations

import pickle
import struct
from typing import Any, BinaryIO

HEADER = struct.Struct("!I")  # frame length, network order
MAX_FRAME_BYTES = 64 * 2**20  # a row or an answer larger than this is refused


def write_frame(out: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"a reward frame of {len(data)} bytes is over {MAX_FRAME_BYTES}")
    out.write(HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> Any:
    header = inp.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError("reward channel closed")
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"a reward frame of {n} bytes is over {MAX_FRAME_BYTES}")
    data = inp.read(n)
    if len(data) < n:
        raise EOFError("reward channel closed mid-frame")
    return pickle.loads(data)
