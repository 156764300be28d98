"""Record audit trail: one JSON line per record blob (run, version, sample, bytes, sha256).

The rollout writes a line for every blob it stores; the trainer for every blob it trains on.
Comparing the two files proves the records the trainer used are byte-for-byte the ones the
rollout wrote (the end-to-end test does exactly that). Off unless a path is configured.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import threading
from collections.abc import Mapping

import torch


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
