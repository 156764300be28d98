"""Trainer checkpoints: master weights (safetensors), optimizer state, step, version, prompt
cursor and RNG states, written atomically (temp dir + rename) so a crash mid-save never leaves
a half checkpoint that resume would pick up.

Layout of ``<dir>/step-<N>/``: ``model.safetensors``, ``optimizer.pt``, ``rng.pt``,
``trainer_state.json``; ``<dir>/latest`` names the newest complete one.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
CHECKPOINT_FORMAT = 1  # bump when the layout changes


@dataclass(kw_only=True, slots=True)
class Checkpoint:
    """What a trainer needs to continue exactly where it stopped."""

    step: int
    version: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    prompt_state: dict[str, int]
    extra: dict[str, Any]
    rng: dict[str, Any] | None = None


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(root: str | pathlib.Path, ckpt: Checkpoint) -> pathlib.Path:
    """Write ``root/step-<step>`` atomically and point ``root/latest`` at it."""
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{ckpt.step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # safetensors refuses shared or non-contiguous storage: save plain contiguous copies.
    save_file({k: v.detach().contiguous().clone() for k, v in ckpt.model.items()}, tmp / MODEL_FILE)
    torch.save(ckpt.optimizer, tmp / OPTIMIZER_FILE)
    torch.save(ckpt.rng if ckpt.rng is not None else capture_rng(), tmp / RNG_FILE)
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": ckpt.step,
        "version": ckpt.version,
        "prompt_state": ckpt.prompt_state,
        "extra": ckpt.extra,
    }
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".{LATEST_FILE}.tmp"
    latest_tmp.write_text(name)
    os.replace(latest_tmp, root / LATEST_FILE)
    return final


def latest_checkpoint(root: str | pathlib.Path) -> pathlib.Path | None:
    """The newest complete checkpoint under ``root``, or None when there is none."""
    root = pathlib.Path(root)
    pointer = root / LATEST_FILE
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: str | pathlib.Path) -> Checkpoint:
    """Read a checkpoint directory written by :func:`save_checkpoint`."""
    path = pathlib.Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise ValueError(f"{path} is not a checkpoint (no {STATE_FILE})")
    state = json.loads(state_file.read_text())
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"checkpoint {path} has format {state.get('format')}, expected {CHECKPOINT_FORMAT}"
        )
    return Checkpoint(
        step=int(state["step"]),
        version=int(state["version"]),
        model=load_file(path / MODEL_FILE),
        optimizer=torch.load(path / OPTIMIZER_FILE, weights_only=False),
        prompt_state=state["prompt_state"],
        extra=state.get("extra", {}),
        rng=torch.load(path / RNG_FILE, weights_only=False),
    )
