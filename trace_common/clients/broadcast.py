"""A policy version's bytes sent from the trainer to replicas on other nodes in one
torch.distributed broadcast (NCCL between GPUs, gloo between CPUs).

weight-sync is the control plane: the trainer offers a version with a `BroadcastGroup` that
names its rendezvous store (a c10d TCPStore the trainer hosts, `Source`), weight-sync picks
the members (replicas registered with the same backend) and tells them (a notice with
`broadcast_group_id`, then GetOffer). The trainer is rank 0 and each member rank i + 1; the
version travels as one flat byte buffer, every tensor a view at its offset.

Groups are process groups built on a prefix of the store, never the default group: a
replica joins and leaves them as weight-sync's membership changes (a new `group_id`), and
keeps its communicator while the membership stays the same. A broadcast that fails (a
member that never joins or dies mid-transfer, a timeout) raises `BroadcastError` on every
rank that sees it, its group is dropped on that rank, and the version is pulled over the
network instead: a replica never swaps in a partial version.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from trace_common.clients import cuda_ipc
from trace_common.clients.tensors import from_raw, raw_bytes, tensor_to_wire
from trace_common.protos_gen.trace.common.v1 import common_pb2
from trace_common.protos_gen.trace.weightsync.v1 import weightsync_pb2 as pb
from trace_common.wire.checksum import crc32

log = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
ALIGN = 256  # byte alignment of each tensor in the broadcast buffer


class BroadcastError(RuntimeError):
    """A broadcast that did not deliver the whole version (group not formed, timeout, a peer
    gone, a checksum that does not match)."""


def backend_for(device: torch.device) -> str:
    """The backend that moves tensors on `device`: NCCL for CUDA, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def max_buffer_bytes(specs: Sequence[common_pb2.TensorSpec]) -> int:
    """The largest buffer a manifest's tensors may take: their bytes, each padded to ALIGN."""
    return sum(s.nbytes for s in specs) + ALIGN * (len(specs) + 1)


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[int], int]:
    """(each tensor's byte offset, the buffer's size) of `tensors` packed in order."""
    offsets, off = [], 0
    for t in tensors.values():
        offsets.append(off)
        off += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
    return offsets, max(off, 1)


def pack(tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """`tensors` (on one device) copied into one flat uint8 buffer there, and their offsets."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(
            f"broadcast tensors must be on one device, got {sorted(map(str, devices))}"
        )
    offsets, size = layout(tensors)
    flat = torch.empty(size, dtype=torch.uint8, device=devices.pop())
    for t, off in zip(tensors.values(), offsets, strict=True):
        n = t.numel() * t.element_size()
        flat[off : off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return flat, offsets


def flat_view(tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One flat uint8 buffer holding `tensors` and their offsets in it: their own storage when
    they already are views of one (a packed export, `to_host`'s buffer), else a packed copy."""
    first = next(iter(tensors.values()))
    storage = first.untyped_storage()
    base = storage.data_ptr()
    if all(t.untyped_storage().data_ptr() == base and t.is_contiguous() for t in tensors.values()):
        flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
        return flat, [t.data_ptr() - base for t in tensors.values()]
    return pack(tensors)


def manifest(
    tensors: Mapping[str, torch.Tensor], *, checksummed: bool
) -> list[common_pb2.TensorSpec]:
    """TensorSpecs of `tensors`, with their CRC-32s when `checksummed` (host tensors)."""
    if not checksummed:
        return cuda_ipc.manifest(tensors)
    return [tensor_to_wire(name, t)[0] for name, t in tensors.items()]


def unpack(
    flat: torch.Tensor, specs: Sequence[common_pb2.TensorSpec], offsets: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Views of `flat` as the manifest's tensors (BroadcastError when one falls outside)."""
    if len(offsets) != len(specs):
        raise BroadcastError(f"{len(offsets)} tensor offsets for {len(specs)} manifest tensors")
    out = {}
    for spec, off in zip(specs, offsets, strict=True):
        if off + spec.nbytes > flat.numel():
            raise BroadcastError(
                f"tensor {spec.name!r} at offset {off} + {spec.nbytes} bytes is outside the "
                f"{flat.numel()}-byte buffer"
            )
        out[spec.name] = from_raw(flat[off : off + spec.nbytes], spec)
    return out


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _process_group(store: dist.Store, group: pb.BroadcastGroup, rank: int) -> dist.ProcessGroup:
    """Rank `rank` of `group`, built on the store's prefix `group_id`. Every rank first
    checks in on the store and waits for all the others up to the group's timeout, so that a
    member that is gone fails here, in the store, and not inside NCCL's initialization."""
    if group.backend not in BACKENDS:
        raise BroadcastError(
            f"unknown broadcast backend {group.backend!r}; expected one of {BACKENDS}"
        )
    prefixed = dist.PrefixStore(group.group_id, store)
    size = len(group.members) + 1
    timeout = _timeout(group.timeout_seconds)
    prefixed.set(f"joined/{rank}", "1")
    prefixed.wait([f"joined/{r}" for r in range(size)], timeout)
    if group.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, size, options)


def nccl_errors_raise() -> None:
    """Have a NCCL collective that fails or times out raise in its caller (abort the
    communicator, keep the process: TORCH_NCCL_ASYNC_ERROR_HANDLING=2), where torch's
    default ends the process. Only in a process that runs no NCCL groups of its own
    (not under torchrun), and only where the setting was not given."""
    if not dist.is_initialized() and "LOCAL_RANK" not in os.environ:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def _broadcast(pg: dist.ProcessGroup, flat: torch.Tensor, group: pb.BroadcastGroup) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = _timeout(group.timeout_seconds)
    work = pg.broadcast([flat], opts)
    if not work.wait(_timeout(group.timeout_seconds)):
        raise BroadcastError(f"group {group.group_id}: the broadcast timed out")
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()


class _Groups:
    """One process group at a time per side: the current membership's."""

    def __init__(self) -> None:
        self.group_id = ""
        self.pg: dist.ProcessGroup | None = None

    def get(self, store: dist.Store, group: pb.BroadcastGroup, rank: int) -> dist.ProcessGroup:
        if self.pg is None or self.group_id != group.group_id:
            self.drop()
            self.pg = _process_group(store, group, rank)
            self.group_id = group.group_id
        return self.pg

    def run(self, store: Callable[[], dist.Store], group: pb.BroadcastGroup, rank: int,
            flat: torch.Tensor, what: str) -> None:  # fmt: skip
        """Broadcast `flat` in `group` as `rank` (its process group built on first use, on
        `store()`); on any failure the group is dropped and BroadcastError says `what`
        failed and why."""
        try:
            _broadcast(self.get(store(), group, rank), flat, group)
        except Exception as exc:
            self.drop()
            raise BroadcastError(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    def drop(self) -> None:
        pg, self.pg, self.group_id = self.pg, None, ""
        if pg is not None and hasattr(pg, "abort"):
            try:
                pg.abort()
            except Exception as exc:  # a broken communicator: dropping it is all we want
                log.debug("aborting a broadcast group failed: %s", exc)


class Source:
    """The trainer's side: hosts the rendezvous store on `port` (0: any free port) and sends
    each version to the group weight-sync formed (`send`)."""

    def __init__(self, host: str, port: int, backend: str, timeout_seconds: float) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"broadcast backend {backend!r}: expected one of {BACKENDS}")
        if timeout_seconds <= 0:
            raise ValueError(f"broadcast timeout_seconds must be > 0, got {timeout_seconds}")
        self.backend = backend
        self.timeout_seconds = timeout_seconds
        if backend == "nccl":
            nccl_errors_raise()
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_timeout(timeout_seconds)
        )
        self.host = host
        self.port = self.store.port
        self._groups = _Groups()
        # Ask weight-sync for a new group: at start (replicas may still hold a group of the
        # same name from a trainer before this one) and after a failed broadcast.
        self.renew_group = True

    def endpoint(
        self,
        offsets: Sequence[int],
        size: int,
        *,
        checksummed: bool,
        node: str = "",
        device_uuid: str = "",
    ) -> pb.BroadcastGroup:
        """What an offer asks for: this store, backend and timeout, the buffer's layout, and
        where the bytes are (node and GPU: no NCCL member may share that GPU)."""
        return pb.BroadcastGroup(
            store_host=self.host, store_port=self.port, backend=self.backend,
            timeout_seconds=self.timeout_seconds, buffer_bytes=size,
            tensor_offsets=list(offsets), checksummed=checksummed, source_node_id=node,
            source_device_uuid=device_uuid,
        )  # fmt: skip

    def send(self, group: pb.BroadcastGroup, flat: torch.Tensor) -> None:
        """Broadcast `flat` to `group`'s members (BroadcastError on failure: the group is
        dropped and the next offer asks for a new one)."""
        self.renew_group = True  # until it has worked
        self._groups.run(
            lambda: self.store, group, 0, flat,
            f"broadcast to group {group.group_id} ({len(group.members)} members)",
        )  # fmt: skip
        self.renew_group = False

    def close(self) -> None:
        self._groups.drop()


class Member:
    """A replica's side: joins the groups weight-sync puts it in and receives versions into
    fresh buffers on `device`."""

    def __init__(self, replica_id: str, device: torch.device) -> None:
        self.replica_id = replica_id
        self.device = device
        self.backend = backend_for(device)
        if self.backend == "nccl":
            nccl_errors_raise()
        # The GPU it receives on, for weight-sync (no NCCL member on the trainer's own GPU).
        self.device_uuid = (
            str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
        )
        self._store: dist.TCPStore | None = None
        self._store_at: tuple[str, int] = ("", 0)
        self._groups = _Groups()
        self._lock = threading.Lock()

    def rank(self, group: pb.BroadcastGroup) -> int:
        try:
            return list(group.members).index(self.replica_id) + 1
        except ValueError:
            raise BroadcastError(
                f"replica {self.replica_id!r} is not a member of group {group.group_id}"
            ) from None

    def _store_for(self, group: pb.BroadcastGroup) -> dist.TCPStore:
        at = (group.store_host, group.store_port)
        if self._store is None or self._store_at != at:
            self._groups.drop()
            self._store = dist.TCPStore(
                group.store_host, group.store_port, is_master=False,
                timeout=_timeout(group.timeout_seconds),
            )  # fmt: skip
            self._store_at = at
        return self._store

    def receive(
        self, group: pb.BroadcastGroup, specs: Sequence[common_pb2.TensorSpec]
    ) -> dict[str, torch.Tensor]:
        """The version's tensors, received whole (views of one new buffer on this device);
        BroadcastError when the group does not form, the transfer fails or a checksum does
        not match (the group is dropped; the caller pulls the version instead)."""
        if group.backend != self.backend:
            raise BroadcastError(
                f"group {group.group_id} uses {group.backend!r}; this replica joins {self.backend!r}"
            )
        rank = self.rank(group)
        most = max_buffer_bytes(specs)
        if group.buffer_bytes > most:
            raise BroadcastError(
                f"group {group.group_id}: a {group.buffer_bytes}-byte buffer for a manifest "
                f"of {len(specs)} tensors (at most {most} bytes with their alignment)"
            )
        with self._lock:
            flat = torch.empty(max(group.buffer_bytes, 1), dtype=torch.uint8, device=self.device)
            try:
                self._groups.run(
                    lambda: self._store_for(group), group, rank, flat,
                    f"receiving from group {group.group_id} as rank {rank}",
                )  # fmt: skip
            except BroadcastError:
                self._store = None  # reconnect next time (the trainer may have restarted)
                raise
        tensors = unpack(flat, specs, group.tensor_offsets)
        if group.checksummed:
            for spec in specs:
                got = crc32(memoryview(raw_bytes(tensors[spec.name])))
                if got != spec.crc32:
                    raise BroadcastError(
                        f"tensor {spec.name!r}: CRC-32 {got:#010x} after the broadcast, "
                        f"{spec.crc32:#010x} in the manifest"
                    )
        return tensors

    def close(self) -> None:
        self._groups.drop()
        self._store = None
