"""Checkpoint save/load round trip and resume semantics."""

from __future__ import annotations

import random

import pytest
import torch

from trace_common.rl.checkpoint import (
    Checkpoint,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.manual_seed(5)
    random.seed(9)
    ckpt = Checkpoint(
        step=7,
        version=7,
        model=model.state_dict(),
        optimizer=opt.state_dict(),
        prompt_state={"seed": 0, "cursor": 56},
        extra={"mode": "trace"},
    )
    path = save_checkpoint(tmp_path, ckpt)
    expected_next = (torch.rand(3), random.random())
    assert latest_checkpoint(tmp_path) == path
    got = load_checkpoint(path)
    assert (got.step, got.version, got.prompt_state, got.extra) == (
        7, 7, {"seed": 0, "cursor": 56}, {"mode": "trace"},
    )  # fmt: skip
    for k, v in model.state_dict().items():
        assert torch.equal(got.model[k], v), k
    model2 = torch.nn.Linear(4, 3)
    model2.load_state_dict(got.model)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(got.optimizer)
    assert torch.equal(
        opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    restore_rng(got.rng)
    assert torch.equal(torch.rand(3), expected_next[0]) and random.random() == expected_next[1]


def test_latest_moves_and_missing_is_none(tmp_path) -> None:
    assert latest_checkpoint(tmp_path) is None
    base = dict(version=0, model={"w": torch.zeros(2)}, optimizer={}, prompt_state={}, extra={})
    save_checkpoint(tmp_path, Checkpoint(step=1, **base))
    p2 = save_checkpoint(tmp_path, Checkpoint(step=2, **base))
    assert latest_checkpoint(tmp_path) == p2
    with pytest.raises(ValueError, match="is not a checkpoint"):
        load_checkpoint(tmp_path / "nope")
