"""The training path: one full-sequence forward with autograd and a QAT mode.

qat_mode:
  "none"  high precision activations, KV and weights (master weights);
  "rtn"   vanilla QAT: the trainer's own round-to-nearest FP4 fake quantization at every site
          the policy quantizes, weights of every quantized weight site = dequantized codes
          of the policy (STE);
  "trace" rollout-guided QAT: like "rtn", but at every (layer, site) the records guide, the
          rollout's scales and codes steer the rounding (`fp4.guided.guided_quantize`, STE).
routing_replay forces the experts the rollout chose; the router still gets gradients through
the softmax probabilities gathered at those ids (renormalized when the model normalizes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trace_common.model.config import ACT_SITE_TO_QUANT_SITE
from trace_common.model.model import MoECausalLM
from trace_common.model.quant import quant_config_of
from trace_common.model.records import SampleRecords, batch_guidance, batch_routing
from trace_common.model.runtime import QAT_MODES, Key, TrainHooks


@dataclass(kw_only=True, slots=True)
class TrainForwardOutput:
    """logprobs[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]); mask marks real targets.

    site_values / site_codes / own_routing (with collect=True): the values used at each
    quantized measured (layer, site), their E2M1 grid values (fp32; for qat_mode "none" the
    ones RTN would pick) and the model's own top-k ids per MoE layer, over real input rows
    sample-major ([N_valid, W] / [N_valid, k]), aligned with records' rows.
    """

    logprobs: torch.Tensor  # [B, T-1] (zero where mask is False)
    mask: torch.Tensor  # [B, T-1] bool
    logits: torch.Tensor | None = None  # [B, T-1, V] if return_logits
    site_values: dict[Key, torch.Tensor] = field(default_factory=dict)
    site_codes: dict[Key, torch.Tensor] = field(default_factory=dict)
    own_routing: dict[int, torch.Tensor] = field(default_factory=dict)


def pad_right(seqs: Sequence[Sequence[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, T_max], lengths [B]) from lists of ids."""
    if not seqs:
        raise ValueError("no sequences given")
    t_max = max(len(s) for s in seqs)
    out = torch.full((len(seqs), t_max), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out, torch.tensor([len(s) for s in seqs])


def forward_logprobs(
    model: MoECausalLM,
    tokens: torch.Tensor | Sequence[Sequence[int]],
    *,
    lengths: torch.Tensor | None = None,
    qat_mode: str = "none",
    records: Sequence[SampleRecords] | None = None,
    routing_replay: bool = False,
    temperature: float = 1.0,
    collect: bool = False,
    return_logits: bool = False,
) -> TrainForwardOutput:
    """Token log-probs of right-padded sequences (tokens [B, T], lengths [B]; or id lists).

    records[b] must describe sequence b (same tokens) for qat_mode="trace" or routing_replay.
    """
    if qat_mode not in QAT_MODES:
        raise ValueError(f"unknown qat_mode {qat_mode!r}; expected one of {QAT_MODES}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not isinstance(tokens, torch.Tensor):
        tokens, lengths = pad_right(tokens)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
    b, t = tokens.shape
    dev = next(model.parameters()).device
    # Checked on the host, where the record checks below read them too: one copy each, not a
    # wait for the device per check and per sequence.
    tokens_host = tokens.cpu()
    lengths_host = torch.full((b,), t) if lengths is None else torch.as_tensor(lengths).cpu()
    if (lengths_host.shape != (b,) or bool((lengths_host < 2).any())
            or bool((lengths_host > t).any())):  # fmt: skip
        raise ValueError(
            f"lengths must be [B] with 2 <= length <= T={t}, got {lengths_host.tolist()}"
        )
    cfg = model.cfg
    if bool(((tokens_host < 0) | (tokens_host >= cfg.vocab_size)).any()):
        raise ValueError(f"tokens contain ids outside [0, {cfg.vocab_size})")
    tokens, lengths = tokens.to(dev), lengths_host.to(dev)
    if t - 1 > cfg.max_position_embeddings:
        raise ValueError(f"sequence length {t} exceeds max_position_embeddings")
    needs_records = qat_mode == "trace" or routing_replay
    if needs_records and records is None:
        raise ValueError(f"qat_mode={qat_mode!r} routing_replay={routing_replay} needs records")
    quant = quant_config_of(model)

    inputs = tokens[:, :-1]  # [B, T-1]
    n_in = lengths - 1  # real input rows per sample
    cols = torch.arange(t - 1, device=dev)
    in_valid = cols[None, :] < n_in[:, None]  # [B, T-1]
    valid_rows = torch.nonzero(in_valid.flatten()).flatten()  # sample-major flat indices
    guidance, replay = {}, {}
    if records is not None:
        records = list(records)
        if len(records) != b:
            raise ValueError(f"got {len(records)} records for a batch of {b} sequences")
        for i, (rec, n) in enumerate(zip(records, lengths_host.tolist(), strict=True)):
            rec.validate(cfg)
            seq = tokens_host[i, :n]
            if rec.tokens.shape != seq.shape or not torch.equal(rec.tokens, seq):
                raise ValueError(
                    f"records[{i}] were recorded for a different token sequence "
                    f"({rec.tokens.numel()} tokens vs {seq.numel()})"
                )
            if rec.guidance and rec.fmt != quant.format:
                raise ValueError(
                    f"records[{i}] are {rec.fmt!r}, the policy quantizes to {quant.format!r}"
                )
        if qat_mode == "trace":
            guidance = {k: g.to(dev) for k, g in batch_guidance(records).items()}
            for layer, site in guidance:
                if not quant.has(ACT_SITE_TO_QUANT_SITE[site]):
                    raise ValueError(
                        f"records guide ({layer}, {site!r}) but the policy does not quantize "
                        f"{ACT_SITE_TO_QUANT_SITE[site]!r} (sites={sorted(quant.sites)})"
                    )
        if routing_replay:
            replay = {k: v.to(dev) for k, v in batch_routing(records).items()}
    hooks = TrainHooks(quant, qat_mode, valid_rows, guidance, replay, collect)
    positions = cols[None, :].expand(b, -1)
    logits = model(inputs, positions, in_valid, hooks)  # [B, T-1, V]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    targets = tokens[:, 1:]
    logprobs = logp_all.gather(-1, targets[..., None])[..., 0] * in_valid
    return TrainForwardOutput(
        logprobs=logprobs,
        mask=in_valid,
        logits=logits if return_logits else None,
        site_values=hooks.site_values,
        site_codes=hooks.site_codes,
        own_routing=hooks.own_routing,
    )
