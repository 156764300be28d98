"""`account_samples`: samples lost, duplicated and unmatched across trainer restarts, from
hand-written metrics rows and audit files (the soak's accounting, bench/soak.py)."""

from __future__ import annotations

import pathlib

import pytest

from trace_common.rl.audit import RecordAudit, TrainerLife, account_samples

PROMPTS, GROUP = 2, 2  # 4 samples per step


def _blob(step_index: int, unit: int, attempt: int, p: int, g: int) -> tuple[str, bytes]:
    sid = f"s{step_index}-u{unit}-a{attempt}-{p}-{g}"
    return sid, sid.encode()


def _write_steps(
    trainer: RecordAudit, rollout: RecordAudit, steps: range, *, version_of=lambda s: s
) -> None:
    """Every sample of `steps` (1-based) written by a rollout and read by the trainer."""
    for step in steps:
        for unit in range(PROMPTS):
            for g in range(GROUP):
                sid, blob = _blob(step - 1, unit, 0, 0, g)
                rollout.log("run", version_of(step), sid, blob)
                trainer.log("run", version_of(step), sid, blob)


def _rows(steps: range, trained: int = PROMPTS * GROUP) -> list[dict]:
    return [
        {"step": s, "samples_trained": trained, "samples_regenerated": 0, "samples_unguided": 0}
        for s in steps
    ]


@pytest.fixture()
def audits(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    return {k: tmp_path / f"{k}.jsonl" for k in ("rollout", "t1", "t2")}


def _account(rows: list[dict], lives: list[TrainerLife], rollout: pathlib.Path, steps: int):
    return account_samples(
        rows, lives, rollout, steps=steps, prompts_per_step=PROMPTS, group_size=GROUP
    )


def test_a_resumed_trainer_owns_the_steps_after_its_checkpoint(audits) -> None:
    """The first trainer ran steps 1-5 and died; the second resumed from step 3 and ran 4-6
    again with the same sample ids: nothing lost or duplicated."""
    rollout = RecordAudit(audits["rollout"])
    _write_steps(RecordAudit(audits["t1"]), rollout, range(1, 6))
    _write_steps(RecordAudit(audits["t2"]), rollout, range(4, 7))
    lives = [TrainerLife(audit=audits["t1"]), TrainerLife(audit=audits["t2"], resumed_step=3)]
    got = _account(_rows(range(1, 7)), lives, audits["rollout"], 6)
    assert (got["lost"], got["duplicated"], got["unmatched"]) == (0, 0, 0), got
    assert got["records_audited"] == got["expected"] == 24


def test_a_missing_row_and_a_short_step_are_lost(audits) -> None:
    _write_steps(RecordAudit(audits["t1"]), RecordAudit(audits["rollout"]), range(1, 4))
    rows = _rows(range(1, 3)) + _rows(range(3, 4), trained=3)  # step 3 trained 3 of 4
    got = _account([rows[0], rows[2]], [TrainerLife(audit=audits["t1"])], audits["rollout"], 3)
    assert got["lost"] == 4 + 1, got


def test_a_sample_read_twice_and_a_slot_trained_twice_are_duplicates(audits) -> None:
    trainer, rollout = RecordAudit(audits["t1"]), RecordAudit(audits["rollout"])
    _write_steps(trainer, rollout, range(1, 3))
    sid, blob = _blob(0, 0, 0, 0, 0)
    trainer.log("run", 1, sid, blob)  # the same record of step 1 trained again
    sid, blob = _blob(1, 1, 1, 0, 1)  # a second attempt of step 2's unit 1 trained as well
    rollout.log("run", 2, sid, blob)
    trainer.log("run", 2, sid, blob)
    got = _account(_rows(range(1, 3)), [TrainerLife(audit=audits["t1"])], audits["rollout"], 2)
    assert (got["duplicated_ids"], got["duplicated_slots"]) == (1, 1), got
    assert got["duplicated"] == 2


def test_a_blob_no_rollout_wrote_is_unmatched(audits) -> None:
    trainer, rollout = RecordAudit(audits["t1"]), RecordAudit(audits["rollout"])
    _write_steps(trainer, rollout, range(1, 2))
    sid, _ = _blob(0, 0, 0, 0, 0)
    trainer.log("run", 1, sid, b"other bytes")
    got = _account(_rows(range(1, 2)), [TrainerLife(audit=audits["t1"])], audits["rollout"], 1)
    assert got["unmatched"] == 1 and got["duplicated_ids"] == 1, got


def test_trained_samples_missing_from_the_audit_are_unaudited(audits) -> None:
    """Rows say step 2 trained 4 samples but its trainer read no blob for it."""
    _write_steps(RecordAudit(audits["t1"]), RecordAudit(audits["rollout"]), range(1, 2))
    got = _account(_rows(range(1, 3)), [TrainerLife(audit=audits["t1"])], audits["rollout"], 2)
    assert got["unaudited"] == 4 and got["lost"] == 0, got


def test_a_lineage_that_does_not_fit_the_audits_is_unaudited(audits) -> None:
    """The second trainer said to have started fresh (it resumed from step 3): steps 1-3 are
    then its own, and it read nothing for them."""
    rollout = RecordAudit(audits["rollout"])
    _write_steps(RecordAudit(audits["t1"]), rollout, range(1, 6))
    _write_steps(RecordAudit(audits["t2"]), rollout, range(4, 7))
    lives = [TrainerLife(audit=audits["t1"]), TrainerLife(audit=audits["t2"], resumed_step=0)]
    got = _account(_rows(range(1, 7)), lives, audits["rollout"], 6)
    assert got["unaudited"] == 3 * PROMPTS * GROUP, got
