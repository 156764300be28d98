"""Records the trainer refuses (HMAC tag, a replayed write, CRC-32) are counted by reason and
exported as trace_trainer_records_refused_total{reason}, every label present from the start."""

from __future__ import annotations

from prometheus_client import generate_latest

from services.trainer.metrics import TrainerMetrics
from services.trainer.remote import QuantCacheRecords
from trace_common.clients import CorruptRecordError
from trace_common.clients.quant_cache import REPLAYED, TAG_MISMATCH
from trace_common.service import Metrics


class RefusingClient:
    def get_records(self, run_id, version, sample_ids, *, missing_ok, generations):
        assert generations == {"s4": b"g" * 16}, "the expected generations reach the client"
        raise CorruptRecordError(
            {"s1": TAG_MISMATCH, "s2": "checksum mismatch after transfer",
             "s3": "received 3 of 9 bytes", "s4": REPLAYED},
            {"s0": b"ok"},
        )  # fmt: skip


def value(text: str, reason: str) -> float:
    line = next(x for x in text.splitlines()
                if x.startswith(f'trace_trainer_records_refused_total{{reason="{reason}"}}'))  # fmt: skip
    return float(line.split()[-1])


def test_refusals_are_counted_by_reason_and_exported() -> None:
    records = QuantCacheRecords(RefusingClient())  # type: ignore[arg-type]
    metrics = Metrics("trainer")
    tm = TrainerMetrics(metrics, None)
    before = generate_latest(metrics.registry).decode()
    assert all(value(before, r) == 0 for r in ("tag", "replay", "checksum"))
    got = records.fetch("run", 1, ["s0", "s1", "s2", "s3", "s4"], generations={"s4": b"g" * 16})
    assert got == {"s0": b"ok"}
    refused = records.take_refused()
    assert refused == {"tag": 1, "checksum": 2, "replay": 1} and records.take_refused() == {}
    for reason, n in refused.items():
        tm.refused.labels(reason).inc(n)
    after = generate_latest(metrics.registry).decode()
    assert value(after, "tag") == 1 and value(after, "checksum") == 2
    assert value(after, "replay") == 1
