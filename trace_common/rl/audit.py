"""Record audit trail: one JSON line per record blob (run, version, sample, bytes, sha256).

The rollout writes a line for every blob it stores; the trainer for every blob it trains on.
Comparing the two files proves the records the trainer used are byte-for-byte the ones the
rollout wrote (the end-to-end test does exactly that). Off unless a path is configured.

`account_samples` reads these files after a run whose trainer was restarted (the soak,
bench/soak.py) and counts the samples lost, trained twice, or trained from a blob no rollout
wrote.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# WorkUnit.sample_id_prefix (s<step index>-u<unit>-a<attempt>) + run_request's -<prompt>-<completion>
SAMPLE_ID = re.compile(r"^s(\d+)-u(\d+)-a(\d+)-(\d+)-(\d+)$")


class RecordAudit:
    """Appends digests to a JSONL file (thread-safe)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def log(self, run_id: str, version: int, sample_id: str, blob: bytes) -> None:
        line = json.dumps(
            {
                "run_id": run_id,
                "version": version,
                "sample_id": sample_id,
                "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest(),
            }
        )
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")


def read_audit(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of a state dict (sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(kw_only=True, slots=True)
class TrainerLife:
    """One trainer process: its record audit and the checkpoint step it started from."""

    audit: pathlib.Path
    resumed_step: int = 0


def account_samples(
    rows: Sequence[Mapping[str, Any]],
    lives: Sequence[TrainerLife],
    rollout_audit: pathlib.Path,
    *,
    steps: int,
    prompts_per_step: int,
    group_size: int,
) -> dict[str, int]:
    """Samples of steps 1..`steps` lost, duplicated and unmatched, from the metrics rows
    (metrics.jsonl), the trainer processes in the order they ran and the rollouts' audit.

    A trainer process started from checkpoint step c owns steps c+1 up to the step its
    successor resumed from (the steps after that ran again). Over steps 1..`steps`:
    - lost: a step's row missing, or fewer samples trained than prompts x group size;
    - duplicated: more samples trained than that; a (version, sample id) read for training
      twice; or two attempts of the same first-round slot (step, unit, prompt, completion);
    - unmatched: a blob read for training whose sha256 no rollout wrote under its key;
    - unaudited: a step's samples trained with records (all but the unguided ones) outnumber
      the blobs its trainer process read for it (an audit that misses what was trained).
    """
    per_step = prompts_per_step * group_size
    by_step = {r["step"]: r for r in rows if r["step"] <= steps}
    lost = dup_count = 0
    for s in range(1, steps + 1):
        trained = by_step[s]["samples_trained"] if s in by_step else 0
        lost += max(0, per_step - trained)
        dup_count += max(0, trained - per_step)
    produced = {}
    if rollout_audit.exists():
        produced = {(a["version"], a["sample_id"]): a["sha256"] for a in read_audit(rollout_audit)}
    ids: collections.Counter[tuple[int, str]] = collections.Counter()
    slots: dict[tuple[int, ...], set[int]] = collections.defaultdict(set)
    unmatched = 0
    read_for: collections.Counter[int] = collections.Counter()  # step -> blobs read
    for k, life in enumerate(lives):
        last = lives[k + 1].resumed_step if k + 1 < len(lives) else steps
        for a in read_audit(life.audit) if life.audit.exists() else []:
            m = SAMPLE_ID.match(a["sample_id"])
            if m is None:
                raise ValueError(f"sample id {a['sample_id']!r} in {life.audit} is not "
                                 "s<step>-u<unit>-a<attempt>-<prompt>-<completion>")  # fmt: skip
            index, unit, attempt, prompt, completion = map(int, m.groups())
            step = index + 1  # sample ids carry the step index before the step (from 0)
            if not life.resumed_step < step <= last:
                continue  # run again by the next trainer process, or after `steps`
            ids[(a["version"], a["sample_id"])] += 1
            read_for[step] += 1
            if unit < prompts_per_step:  # first round; regenerations number units after it
                slots[(step, unit, prompt, completion)].add(attempt)
            if produced.get((a["version"], a["sample_id"])) != a["sha256"]:
                unmatched += 1
    unaudited = sum(
        max(0, r["samples_trained"] - r["samples_unguided"] - read_for[s])
        for s, r in by_step.items()
    )
    dup_ids = sum(n - 1 for n in ids.values())
    dup_slots = sum(len(a) - 1 for a in slots.values())
    return {
        "expected": per_step * steps,
        "trained": sum(r["samples_trained"] for r in by_step.values()),
        "lost": lost,
        "duplicated": dup_count + dup_ids + dup_slots,  # the three checks below, summed
        "duplicated_by_count": dup_count,
        "duplicated_ids": dup_ids,
        "duplicated_slots": dup_slots,
        "unmatched": unmatched,
        "unaudited": unaudited,
        "regenerated": sum(r["samples_regenerated"] for r in by_step.values()),
        "unguided": sum(r["samples_unguided"] for r in by_step.values()),
        "records_audited": sum(ids.values()),
        "rollout_records_written": len(produced),
    }
