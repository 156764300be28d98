"""The FP4 rollout path: batched prefill, incremental decode with a KV cache, sampling, and
per-sample guidance and routing records.

Prompts of different lengths are left-padded into one batch (every sample's last prompt token
in the same column), RoPE positions count real tokens only,
padding keys are masked. Each decode step appends one column for every sample; a finished
sample keeps occupying its column (masked, its outputs ignored) until the batch ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trace_common.fp4.record import GuidanceRecord, concat_records
from trace_common.model.config import GuidanceConfig
from trace_common.model.kv_cache import KVCache
from trace_common.model.model import MoECausalLM
from trace_common.model.quant import quant_config_of
from trace_common.model.records import SampleRecords
from trace_common.model.runtime import RolloutHooks

FINISH_STOP = "stop"  # sampled a stop token (included in the output)
FINISH_LENGTH = "length"  # hit max_new_tokens


MAX_STOP_TOKENS = 64  # stop token ids one sampling config may name
# Smallest sampling temperature above 0 (greedy): logits / temperature must stay finite in
# float32 (max ~3.4e38), and a temperature near 0 is greedy in all but its overflow. vLLM
# holds the same floor.
MIN_TEMPERATURE = 1e-2
DEFAULT_MAX_NEW_TOKENS = 64  # what generate() decodes when given no sampling config


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingConfig:
    """How completions are sampled, from the trainer's settings through the rollout proto to
    every engine: temperature 0 = greedy; top_k 0 and top_p 1 = no truncation; `seed` is the
    base seed (engines derive one per sequence); `stop_token_ids` end a completion besides
    the policy's EOS (an engine adds its EOS)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}"
            )
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        stops = tuple(int(t) for t in self.stop_token_ids)
        if len(stops) > MAX_STOP_TOKENS:
            raise ValueError(f"{len(stops)} stop_token_ids > max {MAX_STOP_TOKENS}")
        bad = [t for t in stops if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad[:5]}")
        object.__setattr__(self, "stop_token_ids", stops)


@dataclass(kw_only=True, slots=True)
class GenerateOutput:
    """Per sample i: completion tokens[i], their log-probs[i] under the sampling distribution
    (greedy: under the untempered model distribution), finish_reasons[i] ("stop"|"length"),
    the prompt it came from (prompts[i]) and its records[i] (None if not requested)."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    records: list[SampleRecords] | None = None
    num_forward_steps: int = 0
    extra: dict[str, object] = field(default_factory=dict)


def prompts_to_lists(
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> list[list[int]]:
    """Accept lists of ids, or a [B, T] tensor with an optional left- or right-padding mask."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompt tensor must be [B, T], got shape {tuple(prompts.shape)}")
        if attention_mask is None:
            return [row.tolist() for row in prompts]
        if attention_mask.shape != prompts.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != prompts "
                f"shape {tuple(prompts.shape)}"
            )
        out = []
        for i, (row, m) in enumerate(zip(prompts, attention_mask.bool(), strict=True)):
            idx = torch.nonzero(m).flatten()
            if idx.numel() and idx[-1] - idx[0] + 1 != idx.numel():
                raise ValueError(
                    f"attention_mask row {i} is not contiguous (holes inside the prompt)"
                )
            out.append(row[idx].tolist())
        return out
    if attention_mask is not None:
        raise ValueError("attention_mask is only accepted with a prompt tensor")
    return [list(map(int, p)) for p in prompts]


def sample_next(
    logits: torch.Tensor, sp: SamplingConfig, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token [B], log-prob [B] under the sampling distribution)."""
    logits = logits.float()
    if sp.temperature == 0:
        tok = logits.argmax(dim=-1)
        return tok, torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
    logits = logits / sp.temperature
    if sp.top_k:
        kth = torch.topk(logits, min(sp.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_l, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_l, -1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_l, -1)) >= sp.top_p  # keep the token crossing p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
    return tok, logp.gather(1, tok[:, None])[:, 0]


@torch.inference_mode()
def generate(
    model: MoECausalLM,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    sampling: SamplingConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    guidance: GuidanceConfig | None = None,
    record_routing: bool = True,
    pad_token_id: int = 0,
) -> GenerateOutput:
    """Generate completions with the policy's quantization config (`quantize_policy`).

    guidance=None records no guidance; record_routing adds top-k ids of every MoE layer.
    Records (if any) are returned per sample, covering prompt and generated tokens.
    """
    sp = sampling or SamplingConfig(max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    cfg = model.cfg
    plist = prompts_to_lists(prompts, attention_mask)
    if not plist:
        raise ValueError("generate needs at least one prompt")
    for i, p in enumerate(plist):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, {cfg.vocab_size})")
    b, p_max = len(plist), max(map(len, plist))
    if p_max + sp.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"longest prompt {p_max} + max_new_tokens {sp.max_new_tokens} exceeds "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    quant = quant_config_of(model)
    guided = frozenset(guidance.resolve(cfg, quant)) if guidance is not None else frozenset()
    hooks = RolloutHooks(quant, guided, guidance.mode if guidance else "compact")
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype

    # Left-padded prompt batch.
    ids = torch.full((b, p_max), pad_token_id, dtype=torch.long, device=dev)
    valid = torch.zeros(b, p_max, dtype=torch.bool, device=dev)
    plen = torch.tensor([len(p) for p in plist], device=dev)
    for i, p in enumerate(plist):
        ids[i, p_max - len(p) :] = torch.tensor(p, device=dev)
        valid[i, p_max - len(p) :] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    cache = KVCache(
        num_layers=cfg.num_layers,
        batch=b,
        max_len=p_max + sp.max_new_tokens,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
        device=dev,
    )
    gen = torch.Generator(device=dev).manual_seed(sp.seed)
    want_records = bool(guided) or record_routing
    # Per step: (hooks.captured, hooks.routing, [(sample, first row, last row)]).
    steps: list[tuple[dict, dict, list[tuple[int, int, int]]]] = []

    hooks.reset()
    logits = model(ids, positions, cache.key_valid(valid), hooks, cache)[:, -1]  # [B, V]
    if want_records:
        steps.append(
            (
                hooks.captured,
                hooks.routing,
                [(i, i * p_max + p_max - len(p), (i + 1) * p_max) for i, p in enumerate(plist)],
            )
        )
    out_tok: list[list[int]] = [[] for _ in range(b)]
    out_lp: list[list[float]] = [[] for _ in range(b)]
    reasons: list[str | None] = [None] * b
    stop = set(sp.stop_token_ids)
    n_steps = 1
    for step in range(sp.max_new_tokens):
        tok, lp = sample_next(logits, sp, gen)
        active_before = [i for i in range(b) if reasons[i] is None]
        for i in active_before:
            t = int(tok[i])
            out_tok[i].append(t)
            out_lp[i].append(float(lp[i]))
            if t in stop:
                reasons[i] = FINISH_STOP
            elif step + 1 == sp.max_new_tokens:
                reasons[i] = FINISH_LENGTH
        active = [i for i in range(b) if reasons[i] is None]
        if not active:
            break
        new_valid = torch.zeros(b, 1, dtype=torch.bool, device=dev)
        new_valid[active] = True
        pos = (plen + step)[:, None]  # [B, 1]: this token's position in its own sequence
        hooks.reset()
        logits = model(tok[:, None], pos, cache.key_valid(new_valid), hooks, cache)[:, -1]
        n_steps += 1
        if want_records:
            steps.append((hooks.captured, hooks.routing, [(i, i, i + 1) for i in active]))

    records = None
    if want_records:
        records = _assemble(
            model,
            plist,
            out_tok,
            steps,
            guided,
            quant.format,
            guidance.mode if guidance else "",
            record_routing,
        )
    return GenerateOutput(
        prompts=plist,
        tokens=out_tok,
        logprobs=out_lp,
        finish_reasons=[r or FINISH_LENGTH for r in reasons],
        records=records,
        num_forward_steps=n_steps,
    )


def _assemble(
    model: MoECausalLM,
    plist: list[list[int]],
    out_tok: list[list[int]],
    steps: list[tuple[dict, dict, list[tuple[int, int, int]]]],
    guided: frozenset[tuple[int, str]],
    fmt: str,
    mode: str,
    record_routing: bool,
) -> list[SampleRecords]:
    """Per-sample records from the per-forward batch records.

    Every forward's records are concatenated along rows once per (layer, site); each sample's
    rows are then gathered with one index per sample, so the cost is O(sites x samples)
    tensor ops rather than O(sites x samples x steps).
    """
    b = len(plist)
    dev = next(model.parameters()).device
    rows: list[list[torch.Tensor]] = [[] for _ in range(b)]  # global row ids per sample
    offset = 0
    for captured, routing, spans in steps:
        for i, start, stop in spans:
            rows[i].append(torch.arange(offset + start, offset + stop, device=dev))
        some = next(iter(captured.values()), None) if captured else None
        n = some.num_rows if some is not None else next(iter(routing.values())).shape[0]
        offset += n
    index = [torch.cat(r) for r in rows]
    cat = {key: concat_records([c[key] for c, _, _ in steps]) for key in sorted(guided)}
    moe_layers = model.cfg.moe_layers
    routes = None
    if record_routing:
        routes = torch.stack(
            [torch.cat([r[layer] for _, r, _ in steps]) for layer in moe_layers], 1
        )  # [total rows, n_moe, k]
    out = []
    for i in range(b):
        rec = SampleRecords(
            tokens=torch.tensor(plist[i] + out_tok[i], dtype=torch.long),
            prompt_len=len(plist[i]),
            fmt=fmt,
            mode=mode if guided else "",
            guidance={key: _take_rows(g, index[i]) for key, g in cat.items()},
            moe_layers=moe_layers,
            routing=routes[index[i]].cpu() if routes is not None else None,
        )
        rec.validate(model.cfg)
        out.append(rec)
    return out


def _take_rows(rec: GuidanceRecord, idx: torch.Tensor) -> GuidanceRecord:
    """Rows `idx` of a 2-D record (records are row-separable: every section is per row)."""
    return GuidanceRecord(
        rec.fmt,
        rec.mode,
        (int(idx.numel()), rec.k),
        rec.payload[idx],
        rec.block_scales[idx],
        None if rec.row_scales is None else rec.row_scales[idx],
    )
