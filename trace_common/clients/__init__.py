"""Clients of the TRACE services (what the trainer, rollout and tools call)."""

from __future__ import annotations

from trace_common.clients.data_path import DirectPathError
from trace_common.clients.quant_cache import CorruptRecordError, QuantCacheClient
from trace_common.clients.weight_sync import WeightSyncClient

__all__ = ["CorruptRecordError", "DirectPathError", "QuantCacheClient", "WeightSyncClient"]
