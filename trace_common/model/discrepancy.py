"""Train-rollout discrepancy measures (docs/design.md, "Training modes"), used by tests, benches and the
trainer's per-step logging.

Activation measures compare, at one (layer, site), the value the training path used
(Q_train(x_train), [N, W]) with the rollout's (Q_rollout(x_rollout), e.g. from a full guidance
record via `fp4.guided.record_values`). Log-prob measures compare per-token log-probs of the
same sampled tokens under both paths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from trace_common.fp4.e2m1 import e2m1_to_f32, unpack_uint4
from trace_common.fp4.guided import record_values
from trace_common.model.records import SampleRecords, batch_guidance

Key = tuple[int, str]


def d_act(q_train: torch.Tensor, q_rollout: torch.Tensor) -> float:
    """||Q_train - Q_rollout||_F / ||Q_rollout||_F (0 when identical; 0/0 -> 0)."""
    if q_train.shape != q_rollout.shape:
        raise ValueError(
            f"shapes differ: train {tuple(q_train.shape)} vs rollout {tuple(q_rollout.shape)}"
        )
    num = (q_train.double() - q_rollout.double()).norm()
    den = q_rollout.double().norm()
    if float(den) == 0.0:
        return 0.0 if float(num) == 0.0 else math.inf
    return float(num / den)


def code_flip_rate(q_train: torch.Tensor, q_rollout: torch.Tensor) -> float:
    """Fraction of elements whose FP4 code differs between the paths.

    Takes each path's E2M1 grid values (fp32 in [-6, 6], e.g. `TrainForwardOutput.site_codes`
    and `rollout_reference`), so it counts flipped codes regardless of small scale
    differences (which D_act captures); +0 and -0 count as the same code.
    """
    if q_train.shape != q_rollout.shape:
        raise ValueError(
            f"shapes differ: train {tuple(q_train.shape)} vs rollout {tuple(q_rollout.shape)}"
        )
    if q_train.numel() == 0:
        return 0.0
    return float((q_train.float() != q_rollout.float()).float().mean())


@dataclass(frozen=True, slots=True)
class LogprobDiscrepancy:
    """Over the compared tokens: mean and max |logp_train - logp_rollout|, the k3 estimator of
    KL(rollout || train) (mean of r - 1 - log r, r = p_train / p_rollout, samples from the
    rollout), and exp(mean |dlogp|)."""

    mean_abs: float
    max_abs: float
    k3_kl: float
    exp_mean_abs: float
    num_tokens: int


def logprob_discrepancy(
    logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor | None = None
) -> LogprobDiscrepancy:
    """Compare log-probs of the same tokens ([...] each, optional bool mask)."""
    if logp_train.shape != logp_rollout.shape:
        raise ValueError(
            f"shapes differ: train {tuple(logp_train.shape)} vs rollout {tuple(logp_rollout.shape)}"
        )
    lt, lr = logp_train.detach().double(), logp_rollout.detach().double()
    if mask is not None:
        lt, lr = lt[mask.bool()], lr[mask.bool()]
    if lt.numel() == 0:
        raise ValueError("no tokens to compare")
    delta = lt - lr  # log r
    absd = delta.abs()
    k3 = (delta.exp() - 1.0 - delta).mean()
    return LogprobDiscrepancy(
        mean_abs=float(absd.mean()),
        max_abs=float(absd.max()),
        k3_kl=float(k3),
        exp_mean_abs=float(absd.mean().exp()),
        num_tokens=int(lt.numel()),
    )


def rollout_reference(
    records: Sequence[SampleRecords], dtype: torch.dtype = torch.float32
) -> tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor]]:
    """(values, grid values) the rollout produced at each (layer, site) of *full* records,
    concatenated sample-major like `TrainForwardOutput.site_values`; values are cast to the
    model's dtype, as the rollout used them."""
    values, codes = {}, {}
    for key, rec in batch_guidance(list(records)).items():
        values[key] = record_values(rec).to(dtype)
        codes[key] = e2m1_to_f32(unpack_uint4(rec.payload)).reshape(rec.shape)
    return values, codes


@dataclass(frozen=True, slots=True)
class SiteDiscrepancy:
    d_act: float
    flip_rate: float


def activation_discrepancy(
    train_values: Mapping[Key, torch.Tensor],
    train_codes: Mapping[Key, torch.Tensor],
    rollout_values: Mapping[Key, torch.Tensor],
    rollout_codes: Mapping[Key, torch.Tensor],
) -> dict[Key, SiteDiscrepancy]:
    """{(layer, site): D_act and code flip rate} for every key present on both sides."""
    return {
        k: SiteDiscrepancy(
            d_act(train_values[k], rollout_values[k]),
            code_flip_rate(train_codes[k], rollout_codes[k]),
        )
        for k in sorted(set(train_values) & set(rollout_values))
    }


def routing_mismatch(own: torch.Tensor, recorded: torch.Tensor) -> float:
    """Fraction of tokens whose own top-k expert set differs from the recorded one ([N, k])."""
    if own.shape != recorded.shape:
        raise ValueError(f"shapes differ: {tuple(own.shape)} vs {tuple(recorded.shape)}")
    if own.numel() == 0:
        return 0.0
    a, _ = own.sort(dim=-1)
    b, _ = recorded.to(own).sort(dim=-1)
    return float((a != b).any(dim=-1).float().mean())
