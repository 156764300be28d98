"""Guidance and routing records: trace mode reproduces the rollout exactly; rtn does not;
record sizes; serialization; bad records are clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trace_common.fp4.record import GuidanceRecord
from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    QuantConfig,
    SampleRecords,
    SamplingConfig,
    export_quantized_state_dict,
    forward_logprobs,
    generate,
    get_config,
    load_quantized_state_dict,
    quantize_policy,
)
from trace_common.model.discrepancy import activation_discrepancy, rollout_reference

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2, 11], [6], [3, 3, 12, 40, 2, 17, 21]]
ALL_LAYERS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def rollout(debug_model: MoECausalLM):
    """Sampled rollout with full guidance at every layer and site, plus routing."""
    guidance = GuidanceConfig(layers=ALL_LAYERS, mode="full")
    return generate(
        debug_model, PROMPTS, SamplingConfig(max_new_tokens=10, seed=11), guidance=guidance
    )


def seqs_of(out) -> list[list[int]]:
    return [p + t for p, t in zip(out.prompts, out.tokens, strict=True)]


def discrepancies(model, seqs, records, ref_records, qat_mode, replay):
    res = forward_logprobs(
        model, seqs, qat_mode=qat_mode, records=records, routing_replay=replay, collect=True
    )
    values, codes = rollout_reference(ref_records, next(model.parameters()).dtype)
    return activation_discrepancy(res.site_values, res.site_codes, values, codes)


@pytest.mark.parametrize("mode", ["full", "compact"])
def test_trace_all_layers_with_replay_reproduces_rollout_exactly(debug_model, rollout, mode):
    records = [r.select(mode=mode) for r in rollout.records]
    # Train on a different batch composition (reversed order) than the rollout used.
    order = list(reversed(range(len(PROMPTS))))
    disc = discrepancies(
        debug_model,
        [seqs_of(rollout)[i] for i in order],
        [records[i] for i in order],
        [rollout.records[i] for i in order],
        "trace",
        True,
    )
    assert set(disc) == {(layer, s) for layer in ALL_LAYERS for s in ("moe_in", "k", "v")}
    for key, d in disc.items():
        assert d.d_act == 0.0 and d.flip_rate == 0.0, f"{key}: {d}"


def test_rtn_differs_where_paths_differ(debug_model, rollout):
    """Decode vs full forward, other batch composition: RTN's own per-token scales and codes
    do not reproduce the rollout's (fp32 here, so the difference is small but real)."""
    order = [2, 0, 3, 1]
    disc = discrepancies(
        debug_model,
        [seqs_of(rollout)[i] for i in order],
        [rollout.records[i] for i in order],
        [rollout.records[i] for i in order],
        "rtn",
        True,
    )
    assert max(d.d_act for d in disc.values()) > 0.0


def test_mixed_precision_rollout_rtn_flips_codes_trace_does_not(debug_model):
    """A bf16 rollout engine (loaded from the exported FP4 policy) vs the fp32 trainer."""
    tensors, meta = export_quantized_state_dict(debug_model)
    engine = load_quantized_state_dict(tensors, meta, dtype=torch.bfloat16)
    out = generate(
        engine,
        PROMPTS[:2],
        SamplingConfig(max_new_tokens=6, seed=1),
        guidance=GuidanceConfig(layers=ALL_LAYERS, mode="full"),
    )
    seqs = seqs_of(out)
    rtn = discrepancies(debug_model, seqs, out.records, out.records, "rtn", True)
    trace = discrepancies(debug_model, seqs, out.records, out.records, "trace", True)
    assert max(d.flip_rate for d in rtn.values()) > 0.01
    assert max(d.flip_rate for d in trace.values()) == 0.0


def test_record_sizes_equal_the_formula(debug_model):
    cfg = debug_model.cfg
    out = generate(
        debug_model, PROMPTS, SamplingConfig(max_new_tokens=5, seed=2), guidance=GuidanceConfig()
    )  # default: deeper half, compact
    guided_layers = range(cfg.num_layers // 2, cfg.num_layers)
    h, kv = cfg.hidden_size, cfg.kv_width
    # compact nvfp4 per token per guided layer: hidden bits + hidden/16 scale bytes + 4 (fp32
    # per-token scale), plus the same for K and V.
    per_token = (h // 8 + h // 16 + 4) + 2 * (kv // 8 + kv // 16 + 4)
    for rec in out.records:
        assert rec.num_rows == len(rec.tokens) - 1
        assert set(rec.guidance) == {(la, s) for la in guided_layers for s in ("moe_in", "k", "v")}
        assert rec.guidance_nbytes == rec.num_rows * len(guided_layers) * per_token
        assert rec.routing.shape == (rec.num_rows, cfg.num_layers, cfg.top_k)
    full = generate(
        debug_model,
        PROMPTS[:1],
        SamplingConfig(max_new_tokens=5, seed=2),
        guidance=GuidanceConfig(mode="full"),
    ).records[0]
    per_token_full = (h // 2 + h // 16 + 4) + 2 * (kv // 2 + kv // 16 + 4)
    assert full.guidance_nbytes == full.num_rows * len(guided_layers) * per_token_full


def test_records_round_trip_losslessly(rollout):
    for rec in rollout.records + [r.select(mode="compact") for r in rollout.records]:
        blob = rec.to_bytes()
        back = SampleRecords.from_bytes(blob)
        assert back.to_bytes() == blob
        assert torch.equal(back.tokens, rec.tokens) and back.prompt_len == rec.prompt_len
        assert torch.equal(back.routing, rec.routing) and back.moe_layers == rec.moe_layers
        assert set(back.guidance) == set(rec.guidance)
        for key, g in rec.guidance.items():
            b = back.guidance[key]
            assert (b.fmt, b.mode, b.shape) == (g.fmt, g.mode, g.shape)
            assert torch.equal(b.payload, g.payload) and torch.equal(b.block_scales, g.block_scales)
            assert torch.equal(b.row_scales, g.row_scales)


def test_bad_record_blobs_are_clear_errors(rollout):
    blob = bytearray(rollout.records[0].to_bytes())
    wrong_version = bytes(blob[:4]) + (99).to_bytes(2, "little") + bytes(blob[6:])
    with pytest.raises(ValueError, match="version 99 is not supported"):
        SampleRecords.from_bytes(wrong_version)
    with pytest.raises(ValueError, match="magic"):
        SampleRecords.from_bytes(b"XXXX" + bytes(blob[4:]))
    with pytest.raises(ValueError, match="bytes, the header describes"):
        SampleRecords.from_bytes(bytes(blob[:-3]))


def test_mismatched_records_are_rejected(debug_model, rollout):
    seqs, recs = seqs_of(rollout), rollout.records
    with pytest.raises(ValueError, match="needs records"):
        forward_logprobs(debug_model, seqs, qat_mode="trace")
    with pytest.raises(ValueError, match="unknown qat_mode 'fp8'"):
        forward_logprobs(debug_model, seqs, qat_mode="fp8")
    with pytest.raises(ValueError, match=r"records\[0\] were recorded for a different token"):
        forward_logprobs(debug_model, [seqs[1], seqs[0], *seqs[2:]], qat_mode="trace", records=recs)
    with pytest.raises(ValueError, match="got 3 records for a batch of 4"):
        forward_logprobs(debug_model, seqs, qat_mode="trace", records=recs[:3])
    # A record with the wrong number of rows (wrong shape) for its sample.
    key = (3, "moe_in")
    bad = dataclasses.replace(
        recs[0], guidance={**recs[0].guidance, key: recs[0].guidance[key].rows(0, 2)}
    )
    with pytest.raises(ValueError, match=r"guidance record \(3, 'moe_in'\) has 2 rows"):
        forward_logprobs(debug_model, seqs, qat_mode="trace", records=[bad, *recs[1:]])
    # Records made for a model of another width (first 32 of 64 columns).
    g = recs[0].guidance[key]
    narrow = GuidanceRecord(
        g.fmt,
        g.mode,
        (g.num_rows, 32),
        g.payload[:, :16].contiguous(),
        g.block_scales[:, :2].contiguous(),
        g.row_scales,
    )
    bad = dataclasses.replace(recs[0], guidance={**recs[0].guidance, key: narrow})
    with pytest.raises(
        ValueError, match=r"\(3, 'moe_in'\) has width 32, the model's moe_in width is 64"
    ):
        forward_logprobs(debug_model, seqs, qat_mode="trace", records=[bad, *recs[1:]])
    # A sample whose guided sites differ from the rest of the batch.
    fewer = recs[0].select({(3, "moe_in")})
    with pytest.raises(ValueError, match="a batch needs the same guided sites"):
        forward_logprobs(debug_model, seqs, qat_mode="trace", records=[fewer, *recs[1:]])


def test_quant_and_guidance_config_errors():
    with pytest.raises(ValueError, match=r"unknown quantization site\(s\) \['attn_out'\]"):
        QuantConfig(sites=frozenset({"kv", "attn_out"}))
    with pytest.raises(ValueError, match="unknown FP4 format 'int4'"):
        QuantConfig(format="int4")
    with pytest.raises(ValueError, match=r"unknown guidance site\(s\) \['router'\]"):
        GuidanceConfig(sites=("router",))
    with pytest.raises(ValueError, match="needs quantization site 'kv'"):
        GuidanceConfig().resolve(get_config("debug"), QuantConfig(sites=frozenset({"expert_acts"})))
    with pytest.raises(ValueError, match=r"guided layer\(s\) \[7\]"):
        GuidanceConfig(layers=(7,)).resolve(get_config("debug"), QuantConfig())


def test_mxfp4_trace_reproduces_rollout_exactly(hp_model):
    model = MoECausalLM(hp_model.cfg).eval()
    model.load_state_dict(hp_model.state_dict())
    quantize_policy(model, QuantConfig(format="mxfp4"))
    out = generate(
        model,
        PROMPTS[:2],
        SamplingConfig(max_new_tokens=6, seed=5),
        guidance=GuidanceConfig(layers=ALL_LAYERS, mode="full"),
    )
    assert out.records[0].fmt == "mxfp4"
    # mxfp4 compact: hidden bits + hidden/32 E8M0 scale bytes, no per-token scale.
    h, kv = model.cfg.hidden_size, model.cfg.kv_width
    compact = [r.select(mode="compact") for r in out.records]
    per_token = (h // 8 + h // 32) + 2 * (kv // 8 + kv // 32)
    assert compact[0].guidance_nbytes == compact[0].num_rows * len(ALL_LAYERS) * per_token
    disc = discrepancies(model, seqs_of(out), compact, out.records, "trace", True)
    assert disc and all(d.d_act == 0.0 and d.flip_rate == 0.0 for d in disc.values())


def test_generate_without_records(debug_model):
    out = generate(debug_model, PROMPTS[:2], SamplingConfig(max_new_tokens=3), record_routing=False)
    assert out.records is None
    routing_only = generate(debug_model, PROMPTS[:2], SamplingConfig(max_new_tokens=3))
    assert all(r.guidance == {} and r.routing is not None for r in routing_only.records)
    assert SampleRecords.from_bytes(routing_only.records[0].to_bytes()).mode == ""
