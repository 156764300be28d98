"""Records the trainer refuses (HMAC tag, CRC-32) are counted by reason and exported as
trace_trainer_records_refused_total{reason}, both labels present from the start."""

from __future__ import annotations

from prometheus_client import generate_latest

from services.trainer.metrics import TrainerMetrics
from services.trainer.remote import QuantCacheRecords
from trace_common.clients import CorruptRecordError
from trace_common.service import Metrics


class RefusingClient:
    def get_records(self, run_id, version, sample_ids, *, missing_ok):
        raise CorruptRecordError(
            {"s1": "record tag mismatch: written without this deployment's token",
             "s2": "checksum mismatch after transfer", "s3": "received 3 of 9 bytes"},
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
    assert value(before, "tag") == 0 and value(before, "checksum") == 0
    assert records.fetch("run", 1, ["s0", "s1", "s2", "s3"]) == {"s0": b"ok"}
    refused = records.take_refused()
    assert refused == {"tag": 1, "checksum": 2} and records.take_refused() == {}
    tm.refused.labels("tag").inc(refused["tag"])
    tm.refused.labels("checksum").inc(refused["checksum"])
    after = generate_latest(metrics.registry).decode()
    assert value(after, "tag") == 1 and value(after, "checksum") == 2
