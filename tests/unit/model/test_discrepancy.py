"""Discrepancy measures on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from trace_common.model.discrepancy import (
    code_flip_rate,
    d_act,
    logprob_discrepancy,
    routing_mismatch,
)


def test_d_act_and_flip_rate() -> None:
    r = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    assert d_act(r, r) == 0.0
    assert d_act(r + torch.tensor([[0.0, 0.0], [0.0, 5.0]]), r) == pytest.approx(1.0)
    assert (
        code_flip_rate(torch.tensor([1.0, -0.0, 2.0, 6.0]), torch.tensor([1.0, 0.0, 3.0, 6.0]))
        == 0.25
    )
    with pytest.raises(ValueError, match="shapes differ"):
        d_act(r, r[:1])


def test_logprob_measures() -> None:
    lt = torch.tensor([-1.0, -2.0, -0.5, 0.0])
    lr = torch.tensor([-1.5, -2.0, -0.5, -9.0])
    mask = torch.tensor([True, True, True, False])
    m = logprob_discrepancy(lt, lr, mask)
    assert m.num_tokens == 3
    assert m.mean_abs == pytest.approx(0.5 / 3) and m.max_abs == pytest.approx(0.5)
    assert m.k3_kl == pytest.approx((math.exp(0.5) - 1.5) / 3)
    assert m.exp_mean_abs == pytest.approx(math.exp(0.5 / 3))
    assert logprob_discrepancy(lr, lr).k3_kl == 0.0
    with pytest.raises(ValueError, match="no tokens"):
        logprob_discrepancy(lt, lr, torch.zeros(4, dtype=torch.bool))


def test_routing_mismatch_ignores_slot_order() -> None:
    own = torch.tensor([[1, 2], [3, 4], [0, 5]])
    rec = torch.tensor([[2, 1], [3, 5], [0, 5]])
    assert routing_mismatch(own, rec) == pytest.approx(1 / 3)
