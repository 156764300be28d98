"""Which device a compute service runs on: the `TRACE_DEVICE` setting."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

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


HOST_ALIGN = 64  # bytes: each tensor's offset in the host buffer (any dtype's alignment)
# Above this, `to_host` copies into pageable memory: page-locked memory is taken from the
# OS's reclaimable pool (and PyTorch rounds its blocks up to a power of two).
HOST_PINNED_MAX_BYTES = 4 << 30


def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of `tensors` (CPU ones are returned as they are). The CUDA ones are copied
    into one page-locked buffer, every copy queued before a single wait: a `.cpu()` per
    tensor waits for each copy and stages it through pageable memory. The returned tensors
    are views of that buffer (contiguous, their own dtype and shape); it lives as long as
    any of them does. Where they are the views of one packed buffer (`pack_on_device`), one
    copy of that buffer. Beyond HOST_PINNED_MAX_BYTES in all, into pageable memory (a `.cpu()`
    per tensor where they are not packed)."""
    on_gpu = [(k, t) for k, t in tensors.items() if t.device.type == "cuda"]
    out = dict(tensors)
    if not on_gpu:
        return out
    offsets, total = [], 0
    for _, t in on_gpu:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // HOST_ALIGN) * HOST_ALIGN
    pinned = total <= HOST_PINNED_MAX_BYTES
    whole = _packed_to_host(on_gpu, total, pinned=pinned)
    if whole is not None:
        return {**out, **whole}
    if not pinned:
        return {**out, **{k: t.cpu() for k, t in on_gpu}}
    buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    for (k, t), off in zip(on_gpu, offsets, strict=True):
        dst = buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        dst.copy_(t, non_blocking=True)
        out[k] = dst
    for dev in {t.device for _, t in on_gpu}:
        torch.cuda.synchronize(dev)
    return out


def _packed_to_host(
    on_gpu: Sequence[tuple[str, torch.Tensor]], nbytes: int, *, pinned: bool
) -> dict[str, torch.Tensor] | None:
    """Host copies of tensors (`nbytes` in all) that are contiguous views of one device
    allocation not much larger than they are (a `pack_on_device` buffer), made by one copy of
    that allocation into page-locked or pageable memory and viewed at the same offsets; None
    otherwise."""
    storage = on_gpu[0][1].untyped_storage()
    base = storage.data_ptr()
    if storage.nbytes() > 2 * nbytes + (64 << 20) or any(
        t.untyped_storage().data_ptr() != base or not t.is_contiguous() for _, t in on_gpu
    ):
        return None
    flat = torch.empty(0, dtype=torch.uint8, device=on_gpu[0][1].device).set_(storage)
    host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=pinned)
    host.copy_(flat, non_blocking=pinned)
    if pinned:
        torch.cuda.synchronize(flat.device)
    out = {}
    for k, t in on_gpu:
        off = t.data_ptr() - base
        out[k] = host[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return out


DEVICE_ALIGN = 256  # bytes: each tensor's offset in a packed GPU buffer (CUDA's alignment)


def pack_on_device(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of `tensors` (all on one CUDA device) as views of one new buffer there, in
    order, each at a DEVICE_ALIGN-aligned offset: one allocation that another process can
    map whole (CUDA IPC), and that later writes to the originals leave alone."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(
            f"pack_on_device takes tensors on one CUDA device, got {sorted(map(str, devices))}"
        )
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    aligned = [-(-n // DEVICE_ALIGN) * DEVICE_ALIGN for n in sizes]
    buf = torch.empty(max(1, sum(aligned)), dtype=torch.uint8, device=devices.pop())
    out, off = {}, 0
    dst_bytes, src_bytes = [], []
    for (name, t), n, step in zip(tensors.items(), sizes, aligned, strict=True):
        dst = buf[off : off + n]
        out[name] = dst.view(t.dtype).view(t.shape)
        if t.is_contiguous():  # byte to byte, all in a few fused copies below
            dst_bytes.append(dst)
            src_bytes.append(t.reshape(-1).view(torch.uint8))
        else:
            out[name].copy_(t)
        off += step
    if dst_bytes:
        torch._foreach_copy_(dst_bytes, src_bytes)
    return out
