"""Which device a compute service runs on: the `TRACE_DEVICE` setting."""

from __future__ import annotations

import re

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
