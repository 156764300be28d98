"""GRPO advantages, clipped-ratio loss with truncated IS, staleness filter: hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from trace_common.rl import clipped_policy_loss, filter_stale, grpo_advantages


def test_grpo_advantages_hand_computed() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv = grpo_advantages(rewards)
    # group 0: mean .5, population std .5 -> +-1; group 1: zero variance -> 0;
    # group 2: mean .75, std sqrt(1.6875) -> 2.25/1.299 = sqrt(3), -0.75/1.299 = -1/sqrt(3)
    expected = torch.tensor(
        [
            [1.0, -1.0, -1.0, 1.0],
            [0.0, 0.0, 0.0, 0.0],
            [-1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), math.sqrt(3)],
        ]
    )
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        grpo_advantages(rewards, scale_by_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5])
    )


def test_grpo_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[num_groups, group_size\]"):
        grpo_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="group_size >= 2, got 1"):
        grpo_advantages(torch.zeros(3, 1))


def test_loss_on_policy_with_tis_weights() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    logp_old = logp.detach().clone()
    logp_rollout = torch.log(torch.tensor([[0.5, 0.5]]))
    out = clipped_policy_loss(
        logp, logp_old, logp_rollout, torch.tensor([2.0]), torch.ones(1, 2), tis_cap=5.0
    )
    # ratio 1; tis weights [1, 0.25/0.5]; loss = (-2*1 - 2*0.5) / 2 = -1.5
    assert out.loss.item() == pytest.approx(-1.5)
    assert out.tis_mean == pytest.approx(0.75)
    assert out.clip_frac == 0.0 and out.tis_capped_frac == 0.0
    out.loss.backward()
    # d loss / d logp_t = -A * w_t * ratio / n_tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.5]]))


def test_loss_clipping_depends_on_advantage_sign() -> None:
    logp_old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(1.5), requires_grad=True)
    mask = torch.ones(1, 1)
    pos = clipped_policy_loss(logp, logp_old, logp_old, torch.tensor([1.0]), mask)
    # ratio 1.5 > 1.2 with A > 0: clipped branch active, value -1.2, no gradient
    assert pos.loss.item() == pytest.approx(-1.2)
    assert pos.clip_frac == 1.0
    pos.loss.backward()
    assert logp.grad.item() == 0.0
    logp.grad = None
    neg = clipped_policy_loss(logp, logp_old, logp_old, torch.tensor([-1.0]), mask)
    # A < 0: min(-1.5, -1.2) = -1.5 is the unclipped branch, gradient = -A * ratio = 1.5
    assert neg.loss.item() == pytest.approx(1.5)
    assert neg.clip_frac == 0.0
    neg.loss.backward()
    assert logp.grad.item() == pytest.approx(1.5)


def test_tis_cap_and_mask() -> None:
    logp = torch.zeros(1, 3, requires_grad=True)
    logp_rollout = torch.tensor([[-math.log(10.0), 0.0, 0.0]])  # first token weight 10 -> capped 5
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # last token is padding
    out = clipped_policy_loss(
        logp, logp.detach(), logp_rollout, torch.tensor([1.0]), mask, tis_cap=5.0
    )
    assert out.loss.item() == pytest.approx(-(5.0 + 1.0) / 2)
    assert out.tis_capped_frac == pytest.approx(0.5)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.5, -0.5, 0.0]]))


def test_loss_rejects_bad_input() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one shape"):
        clipped_policy_loss(z, z, torch.zeros(2, 4), torch.zeros(2), z)
    with pytest.raises(ValueError, match="advantages"):
        clipped_policy_loss(z, z, z, torch.zeros(3), z)
    with pytest.raises(ValueError, match="tis_cap must be > 0, got 0"):
        clipped_policy_loss(z, z, z, torch.zeros(2), z, tis_cap=0.0)


def test_staleness_filter_counts_drops() -> None:
    res = filter_stale([5, 4, 2, 1, 5], current_version=5, max_gap=3)
    assert res.keep == [0, 1, 2, 4]
    assert res.dropped == 1
    assert res.staleness == [0, 1, 3, 0]
    assert filter_stale([3, 3], current_version=3, max_gap=0).dropped == 0
    assert filter_stale([2, 3], current_version=3, max_gap=0).keep == [1]


def test_staleness_rejects_future_versions() -> None:
    with pytest.raises(
        ValueError, match="sample 1 has policy version 7, newer than the trainer's 5"
    ):
        filter_stale([5, 7], current_version=5, max_gap=3)
    with pytest.raises(ValueError, match="max staleness must be >= 0"):
        filter_stale([1], current_version=1, max_gap=-1)
