"""Prometheus metrics named `trace_<component>_<what>_<unit>`, one registry per service."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

# Latency buckets (seconds) from 0.5 ms to ~1 min: store RPCs are short, version pushes long.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


class Metrics:
    """Factory of a component's metrics. Its own registry keeps several in-process instances
    (tests) from colliding and lets /metrics serve exactly this service's series."""

    def __init__(self, component: str, registry: CollectorRegistry | None = None) -> None:
        if not component.replace("_", "").isalnum() or not component.islower():
            raise ValueError(f"component must be lower_snake_case, got {component!r}")
        self.component = component
        self.registry = registry if registry is not None else CollectorRegistry()
        if registry is None:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)

    def name(self, what: str) -> str:
        return f"trace_{self.component}_{what}"

    def counter(self, what: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """`what` without `_total` (added by Prometheus), e.g. "put_bytes"."""
        return Counter(self.name(what), doc, labelnames=labels, registry=self.registry)

    def gauge(self, what: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.name(what), doc, labelnames=labels, registry=self.registry)

    def histogram(
        self,
        what: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        return Histogram(
            self.name(what), doc, labelnames=labels, buckets=buckets, registry=self.registry
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
