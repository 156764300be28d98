"""torch.Tensor <-> raw bytes for weight transfers (see trace_common.wire.tensor_wire)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.wire.checksum import crc32
from trace_common.wire.tensor_wire import DTYPE_ITEMSIZE, expected_nbytes


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise TypeError(f"dtype {dtype} cannot travel; supported: {sorted(DTYPE_ITEMSIZE)}")
    return name


def tensor_to_wire(name: str, tensor: torch.Tensor) -> tuple[common_pb2.TensorSpec, memoryview]:
    """The tensor's spec (with CRC-32) and a zero-copy view of its raw bytes (CPU, contiguous)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    view = memoryview(raw_bytes(t)).cast("B")  # [nbytes] sharing t's storage
    spec = common_pb2.TensorSpec(
        name=name,
        dtype=dtype_name(t.dtype),
        shape=list(t.shape),
        nbytes=len(view),
        crc32=crc32(view),
    )
    return spec, view


class BytesAssembler:
    """Receives `nbytes` bytes in ordered chunks into a preallocated buffer (`name` for errors)."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes]
        self._np = self.buffer.numpy()
        self.received = 0

    def add(self, offset: int, data: bytes | memoryview) -> None:
        if offset != self.received or offset + len(data) > self.nbytes:
            raise ValueError(
                f"tensor {self.name!r}: chunk at offset {offset} (+{len(data)}) after {self.received} of {self.nbytes} bytes"
            )
        self._np[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.received += len(data)

    def fill(self, recv_into: Callable[[memoryview], int]) -> None:
        """Receive the rest of the bytes straight into the buffer (a socket's recv_into:
        no intermediate copies); EOFError when it returns 0 (the peer closed) before the end."""
        view = memoryview(self._np)
        while self.received < self.nbytes:
            n = recv_into(view[self.received :])
            if n == 0:
                raise EOFError(
                    f"tensor {self.name!r}: connection closed after {self.received} of {self.nbytes} bytes"
                )
            self.received += n

    @property
    def complete(self) -> bool:
        return self.received == self.nbytes

    def array(self) -> np.ndarray:
        """The received bytes (uint8), after checking their length (ValueError otherwise)."""
        if not self.complete:
            raise ValueError(f"tensor {self.name!r}: got {self.received} of {self.nbytes} bytes")
        return self._np


class TensorAssembler(BytesAssembler):
    """Receives one tensor's raw bytes; `tensor()` checks them against the spec's CRC-32."""

    def __init__(self, spec: common_pb2.TensorSpec) -> None:
        nbytes = expected_nbytes(spec.dtype, spec.shape)
        if nbytes != spec.nbytes:
            raise ValueError(
                f"tensor {spec.name!r}: nbytes={spec.nbytes} but dtype/shape give {nbytes}"
            )
        super().__init__(spec.name, nbytes)
        self.spec = spec

    def tensor(self) -> torch.Tensor:
        """The rebuilt tensor, after checking length and CRC-32 (ValueError otherwise)."""
        crc = crc32(memoryview(self.array()))
        if crc != self.spec.crc32:
            raise ValueError(
                f"tensor {self.spec.name!r}: crc32 {crc:#010x} != expected {self.spec.crc32:#010x}"
            )
        return from_raw(self.buffer, self.spec)


def from_raw(raw: torch.Tensor, spec: common_pb2.TensorSpec) -> torch.Tensor:
    """A uint8 tensor of raw bytes viewed as the spec's dtype and shape (no copy)."""
    return raw.view(getattr(torch, spec.dtype)).reshape(tuple(spec.shape))


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A CPU contiguous tensor's raw bytes as a uint8 array sharing its storage."""
    return tensor.reshape(-1).view(torch.uint8).numpy()
