"""torch.Tensor <-> raw bytes for weight transfers (see trace_common.tensor_wire)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from trace_common.checksum import crc32
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.tensor_wire import DTYPE_ITEMSIZE, expected_nbytes


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
    raw = t.reshape(-1).view(torch.uint8).numpy()  # [nbytes] uint8 sharing t's storage
    view = memoryview(raw).cast("B")
    spec = common_pb2.TensorSpec(
        name=name,
        dtype=dtype_name(t.dtype),
        shape=list(t.shape),
        nbytes=len(view),
        crc32=crc32(view),
    )
    return spec, view


class TensorAssembler:
    """Receives one tensor's bytes in ordered chunks into a preallocated buffer."""

    def __init__(self, spec: common_pb2.TensorSpec) -> None:
        nbytes = expected_nbytes(spec.dtype, spec.shape)
        if nbytes != spec.nbytes:
            raise ValueError(
                f"tensor {spec.name!r}: nbytes={spec.nbytes} but dtype/shape give {nbytes}"
            )
        self.spec = spec
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes]
        self._np = self.buffer.numpy()
        self.received = 0

    def add(self, offset: int, data: bytes | memoryview) -> None:
        if offset != self.received or offset + len(data) > self.spec.nbytes:
            raise ValueError(
                f"tensor {self.spec.name!r}: chunk at offset {offset} (+{len(data)}) after {self.received} of {self.spec.nbytes} bytes"
            )
        self._np[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.received += len(data)

    def fill(self, recv_into: Callable[[memoryview], int]) -> None:
        """Receive the rest of the bytes straight into the buffer (a socket's recv_into:
        no intermediate copies); EOFError when it returns 0 (the peer closed) before the end."""
        view = memoryview(self._np)
        while self.received < self.spec.nbytes:
            n = recv_into(view[self.received :])
            if n == 0:
                raise EOFError(
                    f"tensor {self.spec.name!r}: connection closed after {self.received} of {self.spec.nbytes} bytes"
                )
            self.received += n

    @property
    def complete(self) -> bool:
        return self.received == self.spec.nbytes

    def tensor(self) -> torch.Tensor:
        """The rebuilt tensor, after checking length and CRC-32 (ValueError otherwise)."""
        if not self.complete:
            raise ValueError(
                f"tensor {self.spec.name!r}: got {self.received} of {self.spec.nbytes} bytes"
            )
        crc = crc32(memoryview(self._np))
        if crc != self.spec.crc32:
            raise ValueError(
                f"tensor {self.spec.name!r}: crc32 {crc:#010x} != expected {self.spec.crc32:#010x}"
            )
        dtype = getattr(torch, self.spec.dtype)
        return self.buffer.view(dtype).reshape(tuple(self.spec.shape))
