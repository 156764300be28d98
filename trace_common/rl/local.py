"""In-process implementations of the loop's stores: a dict record store and a publisher that
hands each new policy version to in-process replicas. Used by unit tests and benchmarks; the
services use quant-cache and weight-sync instead, with the same interfaces."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from trace_common.rollout.engine import EngineFactory, EngineHolder


class MemoryRecordStore:
    """``put`` / ``fetch`` of record blobs keyed by (run, version, sample)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.blobs: dict[tuple[str, int, str], bytes] = {}

    def put(self, run_id: str, version: int, sample_id: str, blob: bytes) -> None:
        with self._lock:
            self.blobs[(run_id, version, sample_id)] = bytes(blob)

    def fetch(
        self,
        run_id: str,
        policy_version: int,
        sample_ids: Sequence[str],
        *,
        generations: Mapping[str, bytes] | None = None,
    ) -> dict[str, bytes]:
        """The stored blobs (an in-process store: `put` reports no generation, so none is
        expected)."""
        with self._lock:
            return {
                s: self.blobs[(run_id, policy_version, s)]
                for s in sample_ids
                if (run_id, policy_version, s) in self.blobs
            }


class LocalPublisher:
    """Builds every replica's engine from the exported tensors (as a replica pulling from
    weight-sync would) and swaps it in."""

    def __init__(self, holders: Sequence[EngineHolder], factory: EngineFactory) -> None:
        self.holders = list(holders)
        self.factory = factory

    def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any]
    ) -> None:
        str_meta = {k: v for k, v in metadata.items() if isinstance(v, str)}
        for h in self.holders:
            h.swap(
                self.factory({k: v.clone() for k, v in tensors.items()}, str_meta, version), version
            )
