"""Which device a compute service runs on: the `TRACE_DEVICE` setting."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
DEVICE_HELP = "auto (CUDA when present, else CPU), cpu, cuda or cuda:N"


def resolve_device(value: str) -> torch.device:
    """The torch device of a `TRACE_DEVICE` value; ValueError naming the value when it is
    malformed or asks for a CUDA device this machine does not have."""
    if not DEVICE_RE.match(value):
        raise ValueError(f"TRACE_DEVICE={value!r}: expected {DEVICE_HELP}")
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(value)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"TRACE_DEVICE={value!r} but CUDA is not available on this machine")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"TRACE_DEVICE={value!r} but this machine has {n} CUDA device(s)")
    return dev


_ALIGN = 16  # bytes: every tensor starts at an offset any dtype's view accepts


def to_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU, each with its dtype and shape. Device tensors are packed into
    one device buffer and copied in one transfer (one copy per tensor costs a host sync each:
    thousands for a policy's per-expert weights); the results are views into that one host
    buffer. CPU tensors are returned as they are."""
    on_device = [(k, t) for k, t in tensors.items() if t.device.type != "cpu"]
    if not on_device:
        return dict(tensors)
    device = on_device[0][1].device
    spans: list[tuple[str, int, torch.Tensor]] = []
    total = 0
    for k, t in on_device:
        if t.device != device:
            raise ValueError(f"tensor {k!r} is on {t.device}, the others on {device}")
        spans.append((k, total, t))
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    packed = torch.empty(total, dtype=torch.uint8, device=device)
    for _, offset, t in spans:
        n = t.numel() * t.element_size()
        packed[offset : offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    host = packed.cpu()
    out = dict(tensors)
    for k, offset, t in spans:
        n = t.numel() * t.element_size()
        out[k] = host[offset : offset + n].view(t.dtype).view(t.shape)
    return out
