"""Trainer checkpoints: master weights (safetensors), optimizer state, step, version, prompt
cursor and RNG states, written atomically (temp dir + rename) so a crash mid-save never leaves
a half checkpoint that resume would pick up.

Layout of ``<dir>/step-<N>/``: ``model.safetensors``, ``optimizer.pt``, ``rng.pt``,
``trainer_state.json``; ``<dir>/latest`` names the newest complete one.

Checkpoints move across devices: tensors are read onto the CPU (``map_location``) and the
learner copies them onto its own device, so one written on a GPU resumes on a CPU and back.
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
    prompt_state: dict[str, Any]  # the prompt stream's state_dict (JSON)
    extra: dict[str, Any]
    rng: dict[str, Any] | None = None


def capture_rng() -> dict[str, Any]:
    """The CPU and Python generators, and every CUDA device's when CUDA is in use."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what `capture_rng` saved; CUDA generators only when this machine has as many
    devices (a GPU checkpoint resumed on a CPU keeps the CPU and Python streams)."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


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
    # safetensors refuses shared or non-contiguous storage: save plain contiguous CPU copies.
    model = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in ckpt.model.items()}
    save_file(model, tmp / MODEL_FILE)
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


def read_state(path: pathlib.Path, expected_format: str, kind: str) -> dict[str, Any]:
    """A checkpoint directory's trainer state; ValueError when `path` is not `kind` (no state
    file) or was written in another format (the single-process and sharded ones name each
    other)."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise ValueError(f"{path} is not {kind} (no {STATE_FILE})")
    state = json.loads(state_file.read_text())
    if state.get("format") != expected_format:
        raise ValueError(
            f"checkpoint {path} has format {state.get('format')}, expected {expected_format}"
        )
    return state


def load_checkpoint(
    path: str | pathlib.Path, map_location: str | torch.device = "cpu"
) -> Checkpoint:
    """Read a checkpoint directory written by :func:`save_checkpoint`, its tensors onto
    ``map_location`` (the CPU by default, whatever device wrote them)."""
    path = pathlib.Path(path)
    state = read_state(path, CHECKPOINT_FORMAT, "a checkpoint")
    return Checkpoint(
        step=int(state["step"]),
        version=int(state["version"]),
        model=load_file(path / MODEL_FILE, device=str(map_location)),
        optimizer=torch.load(path / OPTIMIZER_FILE, map_location=map_location, weights_only=False),
        prompt_state=state["prompt_state"],
        extra=state.get("extra", {}),
        rng=torch.load(path / RNG_FILE, map_location="cpu", weights_only=False),
    )
