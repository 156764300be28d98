"""quant-cache's server-side bounds: a periodic sweep gives every record key the service's TTL
and deletes values over its size limit, whichever client wrote them."""

from __future__ import annotations

import logging
import threading
import time

from trace_common.service import Metrics, ServiceError
from trace_common.stores.quant_cache_store import SWEEP_ACTIONS, RedisRecordStore

log = logging.getLogger("services.quant_cache")


class Sweeper:
    """Runs RedisRecordStore.sweep every `interval` seconds: the service's TTL and size limit hold
    for records whichever path wrote them. Counted as
    `trace_quant_cache_swept_records_total{action}` and logged (a client broke the limits)."""

    def __init__(self, store: RedisRecordStore, max_record_bytes: int, metrics: Metrics) -> None:
        self.store, self.max_record_bytes = store, max_record_bytes
        self.swept = metrics.counter("swept_records", "record keys the sweep fixed or deleted",
                                     labels=("action",))  # fmt: skip
        for action in SWEEP_ACTIONS:
            self.swept.labels(action)  # exported at 0 from the start
        self.seconds = metrics.histogram("sweep_seconds", "time of one sweep over the records")

    def once(self) -> dict[str, int]:
        t0 = time.perf_counter()
        counts = self.store.sweep(self.max_record_bytes)
        self.seconds.observe(time.perf_counter() - t0)
        for action, n in counts.items():
            if n:
                self.swept.labels(action).inc(n)
        if any(counts.values()):
            log.warning("record sweep: %s (written past the service's limits)", counts)
        return counts

    def start(self, interval: float, stopping: threading.Event) -> None:
        """Sweep every `interval` seconds on a daemon thread until `stopping` is set."""
        threading.Thread(target=self.run, args=(interval, stopping), name="record-sweep",
                         daemon=True).start()  # fmt: skip

    def run(self, interval: float, stopping: threading.Event) -> None:
        while not stopping.wait(interval):
            try:
                self.once()
            except ServiceError as err:  # Redis down: the next sweep tries again
                log.warning("record sweep failed: %s", err.message)
