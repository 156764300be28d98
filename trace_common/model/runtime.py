"""The two sets of forward hooks: the FP4 rollout's and the trainer's QAT.

Both implement `model.Hooks`. The rollout quantizes every enabled site with round-to-nearest
(per-token second-level scale for activations and KV) and, at guided (layer, site) pairs,
records what it produced; it records the top-k expert ids of every MoE layer. The trainer
quantizes the same sites in one of three QAT modes and may replay the recorded routing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

# The hooks below run fp4's fake and guided quantization; importing the Triton kernels
# registers them as its fast path for CUDA tensors (`trace_common.fp4.fast_path`).
import trace_common.kernels.quant  # noqa: F401
from trace_common.fp4 import get_format
from trace_common.fp4.e2m1 import e2m1_to_f32
from trace_common.fp4.fake import fake_quantize
from trace_common.fp4.guided import guided_codes, guided_quantize
from trace_common.fp4.record import GuidanceRecord, capture
from trace_common.model.config import ACT_SITE_TO_QUANT_SITE, GUIDED_SITES, QuantConfig
from trace_common.model.model import WeightMode

QatMode = Literal["none", "rtn", "trace"]
QAT_MODES: tuple[str, ...] = ("none", "rtn", "trace")

# Sites whose per-token values are worth reporting for discrepancy metrics: the guidable ones.
MEASURED_SITES = frozenset(GUIDED_SITES)

Key = tuple[int, str]  # (layer, site)


def rtn(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round-to-nearest FP4 fake quantization with per-row (per-token) second-level scales."""
    return fake_quantize(x, fmt, scale_granularity="row")


def _as_grid(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> fp32 grid values (grid values pass through)."""
    return e2m1_to_f32(codes) if codes.dtype == torch.uint8 else codes.float()


@torch.no_grad()
def rtn_grid_values(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The E2M1 grid values (fp32, in [-6, 6]) RTN would pick for rows x [N, W]."""
    return e2m1_to_f32(get_format(fmt).quantize(x, scale_granularity="row").codes())


class RolloutHooks:
    """FP4 rollout: RTN at every enabled site, guidance capture at `guided`, routing records.

    After each forward, `captured[(layer, site)]` holds the record of all N rows of that
    forward and `routing[layer]` the chosen expert ids [N, k]; the caller slices per sample.
    """

    def __init__(
        self,
        quant: QuantConfig,
        guided: frozenset[Key] = frozenset(),
        mode: str = "compact",
    ) -> None:
        self.quant = quant
        self.fmt = get_format(quant.format).name
        self.guided = guided
        self.mode = mode
        self.captured: dict[Key, GuidanceRecord] = {}
        self.routing: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        self.captured = {}
        self.routing = {}

    def weight_mode(self, site: str) -> WeightMode:
        return "quantized" if self.quant.has(site) else "master"

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        if not self.quant.has(ACT_SITE_TO_QUANT_SITE[site]):
            return x
        if (layer, site) in self.guided:
            x_q, rec = capture(x, self.fmt, self.mode)
            self.captured[(layer, site)] = rec
            return x_q
        return rtn(x, self.fmt)

    def route(self, layer: int, probs: torch.Tensor, top_k: int) -> torch.Tensor:
        ids = torch.topk(probs, top_k, dim=-1).indices  # [N, k]
        self.routing[layer] = ids
        return ids


class TrainHooks:
    """The trainer's QAT forward over a right-padded batch flattened to N = B*T rows.

    valid_rows [N_valid] are the flat indices of real tokens, sample-major; `guidance` holds
    one record per guided (layer, site) covering exactly those rows in that order, and
    `replay[layer]` the recorded expert ids [N_valid, k]. Padding rows get plain RTN and the
    model's own routing (nothing reads them).
    """

    def __init__(
        self,
        quant: QuantConfig,
        qat_mode: str,
        valid_rows: torch.Tensor,
        guidance: Mapping[Key, GuidanceRecord] | None = None,
        replay: Mapping[int, torch.Tensor] | None = None,
        collect: bool = False,
    ) -> None:
        if qat_mode not in QAT_MODES:
            raise ValueError(f"unknown qat_mode {qat_mode!r}; expected one of {QAT_MODES}")
        self.quant = quant
        self.fmt = get_format(quant.format).name
        self.qat_mode = qat_mode
        self.valid_rows = valid_rows
        self.guidance = dict(guidance or {})
        self.replay = dict(replay or {})
        self.collect = collect
        self.site_values: dict[Key, torch.Tensor] = {}  # [N_valid, W] values used, detached
        # [N_valid, W] fp32 E2M1 grid values chosen (for "none": those RTN would choose)
        self.site_codes: dict[Key, torch.Tensor] = {}
        self.own_routing: dict[int, torch.Tensor] = {}  # [N_valid, k] the model's own top-k

    def weight_mode(self, site: str) -> WeightMode:
        """QAT modes read the policy's FP4 weights (STE to the master); "none" the master."""
        return "ste" if self.qat_mode != "none" and self.quant.has(site) else "master"

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        quantized = self.quant.has(ACT_SITE_TO_QUANT_SITE[site])
        rec = self.guidance.get((layer, site)) if self.qat_mode == "trace" else None
        if self.qat_mode == "none" or not quantized:
            out = x
        else:
            out = rtn(x, self.fmt)
            if rec is not None:
                guided = guided_quantize(x[self.valid_rows], rec)
                out = out.index_copy(0, self.valid_rows, guided)
        if self.collect and quantized and site in MEASURED_SITES:
            key, xv = (layer, site), x[self.valid_rows].detach()
            self.site_values[key] = out[self.valid_rows].detach()
            self.site_codes[key] = (
                _as_grid(guided_codes(xv, rec))
                if rec is not None
                else rtn_grid_values(xv, self.fmt)
            )
        return out

    def route(self, layer: int, probs: torch.Tensor, top_k: int) -> torch.Tensor:
        ids = torch.topk(probs, top_k, dim=-1).indices  # [N, k]
        self.own_routing[layer] = ids[self.valid_rows]
        if layer in self.replay:
            ids = ids.index_copy(0, self.valid_rows, self.replay[layer].to(ids))
        return ids
