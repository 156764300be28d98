"""A policy version's bytes shared GPU to GPU between processes of one node (CUDA IPC).

The trainer packs an exported version into one GPU buffer (`trace_common.device.pack_on_device`:
every tensor a view at its offset) and shares it (`share`): the buffer's CUDA allocation handle, PyTorch's
shared-memory reference count of it, and the offset of each tensor. weight-sync hands that
description to replicas (`CudaIpcBuffer` in weightsync.proto); a replica on the same node
opens it (`open_shared`) and its engine copies the tensors GPU to GPU. Nothing crosses the
host: the only bytes on the network are the handles.

The trainer never writes into a shared buffer (each version is a new one), so an opener
reads one whole version. While an opener holds the mapping, PyTorch's reference count keeps
the allocation alive even after the trainer dropped it; an opener that comes after the
trainer released it, or from another node or IPC namespace, gets `IpcError` and pulls
the version over the network instead.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from trace_common.clients.tensors import dtype_name, from_raw
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb

BOOT_ID = pathlib.Path("/proc/sys/kernel/random/boot_id")


class IpcError(RuntimeError):
    """A shared buffer that cannot be opened here (other node, released, bad handle)."""


@functools.cache
def node_id() -> str:
    """This host's id for CUDA IPC: the kernel's boot id (shared by its containers); empty
    where the kernel has none (no IPC offers are made or taken then)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device(uuid: str) -> torch.device:
    """The CUDA device of this process whose UUID is `uuid`; IpcError when it has none."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return torch.device("cuda", i)
    raise IpcError(f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)")


@dataclass(frozen=True, slots=True)
class Shared:
    """A packed version's buffer as other processes open it (CudaIpcBuffer)."""

    buffer: pb.CudaIpcBuffer
    storage: torch.UntypedStorage  # the owner's: the buffer lives while this does


def share(packed: Mapping[str, torch.Tensor]) -> Shared:
    """The IPC description of `pack`'s output (its tensors, in order)."""
    first = next(iter(packed.values()))
    storage = first.untyped_storage()
    for name, t in packed.items():
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            raise ValueError(f"tensor {name!r} is not in the packed buffer")
    (_dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
    base = storage.data_ptr()
    return Shared(
        pb.CudaIpcBuffer(
            node_id=node_id(),
            device_uuid=device_uuid(first.device),
            memory_handle=handle,
            allocation_offset=offset,
            buffer_bytes=size,
            ref_counter_handle=rc_handle,
            ref_counter_offset=rc_offset,
            event_handle=ev_handle or b"",
            event_sync_required=ev_sync,
            tensor_offsets=[t.data_ptr() - base for t in packed.values()],
        ),
        storage,
    )


def open_shared(
    buffer: pb.CudaIpcBuffer, specs: Sequence[common_pb2.TensorSpec]
) -> dict[str, torch.Tensor]:
    """The tensors of a shared buffer, as views of this process's mapping of it (GPU
    memory of the owner's device, read only by convention). The mapping is released when
    the last view is dropped. IpcError names what failed."""
    if buffer.node_id != node_id() or not buffer.node_id:
        raise IpcError(f"the buffer is on node {buffer.node_id!r}, this is {node_id()!r}")
    if len(buffer.tensor_offsets) != len(specs):
        raise IpcError(
            f"{len(buffer.tensor_offsets)} tensor offsets for a manifest of {len(specs)} tensors"
        )
    device = local_device(buffer.device_uuid)
    torch.cuda.set_device(device)  # the handles are opened on the current device
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            buffer.memory_handle,
            buffer.buffer_bytes,
            buffer.allocation_offset,
            buffer.ref_counter_handle,
            buffer.ref_counter_offset,
            buffer.event_handle or None,
            buffer.event_sync_required,
        )
    except (RuntimeError, OSError) as exc:
        raise IpcError(
            f"cannot open the CUDA IPC buffer on GPU {buffer.device_uuid}: {exc}"
        ) from exc
    flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    out = {}
    for spec, off in zip(specs, buffer.tensor_offsets, strict=True):
        if off + spec.nbytes > buffer.buffer_bytes:
            raise IpcError(
                f"tensor {spec.name!r} at offset {off} + {spec.nbytes} bytes is outside the "
                f"{buffer.buffer_bytes}-byte buffer"
            )
        out[spec.name] = from_raw(flat[off : off + spec.nbytes], spec)
    return out


def manifest(tensors: Mapping[str, torch.Tensor]) -> list[common_pb2.TensorSpec]:
    """TensorSpecs of `tensors` without CRC-32s (what an offer's header lists)."""
    return [
        common_pb2.TensorSpec(
            name=name,
            dtype=dtype_name(t.dtype),
            shape=list(t.shape),
            nbytes=t.numel() * t.element_size(),
        )
        for name, t in tensors.items()
    ]
