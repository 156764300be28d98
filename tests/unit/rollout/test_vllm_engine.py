"""TRACE_ROLLOUT_ENGINE=vllm (trace_common/rollout/vllm_engine.py, vllm_quant.py). The engine
tests need vllm (`make test-vllm`) and are skipped with the reason without it; the selection
test runs anywhere. Each test that starts vLLM pays ~8 s of start-up on 2 CPU cores, so one
module-scoped engine serves the parity, records and reload tests, in that order.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    QuantConfig,
    SampleRecords,
    export_quantized_state_dict,
    forward_logprobs,
    get_config,
    load_quantized_state_dict,
    quantize_policy,
)
from trace_common.model.config import SITE_ATTN_WEIGHTS
from trace_common.model.discrepancy import (
    activation_discrepancy,
    rollout_reference,
    routing_mismatch,
)
from trace_common.rollout.engine import EngineHolder
from trace_common.rollout.meta import PolicyMeta
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.select import EngineSettings, make_engine_factory
from trace_common.rollout.types import SamplingConfig

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (make test-vllm)")
PROMPTS = [[1, 5, 9, 12, 3], [2, 7, 7, 30, 41, 8, 1], [3, 60, 22], [4, 4, 17]]
ALL_FULL = GuidanceConfig(layers=(0, 1, 2, 3), mode="full")  # full records: D_act measurable
GREEDY = SamplingConfig(temperature=0, max_new_tokens=8)


def pushed(
    quant: QuantConfig, guidance: GuidanceConfig | None = None, seed: int = 0, **shape: object
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A policy version as weight-sync hands it to a replica."""
    cfg = get_config("debug").replace(vocab_size=64, **shape)
    m = MoECausalLM(cfg).init_weights(seed, std=0.1)
    tensors, meta = export_quantized_state_dict(quantize_policy(m, quant))
    meta.update(PolicyMeta(eos_id=2, pad_id=0, guidance=guidance).to_metadata())
    return tensors, meta


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vllm is missing")
def test_selecting_vllm_without_vllm_names_the_install() -> None:
    factory = make_engine_factory(EngineSettings(engine="vllm"))
    with pytest.raises(ImportError, match="make test-vllm"):
        factory(*pushed(QuantConfig.none()), 1)


@pytest.fixture(scope="module")
def fp4_engine():
    """The default FP4 policy (routed experts W4A4 NVFP4 + FP4 K/V), every layer guided."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tensors, meta = pushed(QuantConfig(), ALL_FULL)
    factory = make_engine_factory(EngineSettings(engine="vllm"))
    engine = factory(tensors, meta, 7)
    yield factory, engine, tensors, meta


@needs_vllm
@pytest.mark.slow
def test_fp4_greedy_tokens_and_records_match_the_native_engine(fp4_engine) -> None:
    _, engine, tensors, meta = fp4_engine
    assert engine.name == "vllm"
    got = engine.generate(PROMPTS, 2, GREEDY, with_records=False)
    want = NativeEngine.from_weights(tensors, meta).generate(PROMPTS, 2, GREEDY, with_records=False)
    assert [(s.prompt_index, s.group_index) for s in got] == [
        (s.prompt_index, s.group_index) for s in want
    ]
    assert all(s.policy_version == 7 and s.records is None for s in got)
    # Both run fp32 with the same FP4 codes and per-token quantizer; only GEMM summation
    # order differs, so tokens agree unless a margin is below that noise.
    for g, w in zip(got, want, strict=True):
        n = agreeing_prefix(g.completion_tokens, w.completion_tokens)
        gaps = [abs(a - b) for a, b in zip(g.logprobs[:n], w.logprobs[:n], strict=True)]
        assert max(gaps, default=0.0) < 1e-3, f"|dlogp| {gaps} on the agreeing prefix"
    agree = sum(g.completion_tokens == w.completion_tokens for g, w in zip(got, want, strict=True))
    assert agree == len(got), f"{agree}/{len(got)} greedy completions equal"
    # Same tokens, so the records compare row for row with the native engine's: the same
    # codes, block scales and routing; per-token fp32 scales equal up to a few ulps (the
    # activations' amax differs in its last bits with the summation order).
    got = engine.generate(PROMPTS, 1, GREEDY, with_records=True)
    want = NativeEngine.from_weights(tensors, meta).generate(PROMPTS, 1, GREEDY, with_records=True)
    for g, w in zip(got, want, strict=True):
        a, b = SampleRecords.from_bytes(g.records), SampleRecords.from_bytes(w.records)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.routing, b.routing)
        assert a.guidance.keys() == b.guidance.keys()
        for key, ra in a.guidance.items():
            rb = b.guidance[key]
            assert torch.equal(ra.payload, rb.payload), f"codes differ at {key}"
            assert torch.equal(ra.block_scales, rb.block_scales), f"block scales differ at {key}"
            rel = ((ra.row_scales - rb.row_scales).abs() / rb.row_scales).max()
            assert rel < 1e-5, f"row scales at {key}: max relative difference {rel}"
    sampled = engine.generate(PROMPTS, 3, SamplingConfig(temperature=1.0, max_new_tokens=4),
                              with_records=False)  # fmt: skip
    assert len(sampled) == 12 and all(
        len(s.logprobs) == len(s.completion_tokens) and all(lp <= 0 for lp in s.logprobs)
        for s in sampled
    )


@needs_vllm
@pytest.mark.slow
def test_vllm_records_replayed_by_the_trainer_reproduce_the_codes(fp4_engine) -> None:
    _, engine, tensors, meta = fp4_engine
    sp = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=3)
    got = engine.generate(PROMPTS, 2, sp, with_records=True)
    recs = [SampleRecords.from_bytes(s.records) for s in got]
    for p, s, r in zip([p for p in PROMPTS for _ in range(2)], got, recs, strict=True):
        assert r.tokens.tolist() == p + s.completion_tokens and r.prompt_len == len(p)
        assert r.mode == "full" and {k[0] for k in r.guidance} == {0, 1, 2, 3}
        assert r.routing is not None and r.routing.shape == (
            len(p) + len(s.completion_tokens) - 1,
            4,
            2,
        )
    trainer = load_quantized_state_dict(tensors, meta)  # the trainer's fp32 QAT forward
    seqs = [r.tokens.tolist() for r in recs]
    rollout_values, rollout_codes = rollout_reference(recs)
    out = {}
    for name, mode, replay in (("guided", "trace", True), ("rtn", "rtn", False)):
        fwd = forward_logprobs(trainer, seqs, qat_mode=mode, records=recs, routing_replay=replay,
                               collect=True)  # fmt: skip
        sites = activation_discrepancy(
            fwd.site_values, fwd.site_codes, rollout_values, rollout_codes
        )
        out[name] = (
            max(d.d_act for d in sites.values()),
            max(d.flip_rate for d in sites.values()),
            max(routing_mismatch(fwd.own_routing[layer], torch.cat([r.routing[:, j] for r in recs]))
                for j, layer in enumerate(recs[0].moe_layers)),
            max(abs(float(fwd.logprobs[i, len(r.tokens) - len(s.completion_tokens) - 1 + t]) - lp)
                for i, (r, s) in enumerate(zip(recs, got, strict=True))
                for t, lp in enumerate(s.logprobs)),
        )  # fmt: skip
    print(f"vLLM records replayed (D_act, flip rate, routing mismatch, max |dlogp|): {out}")
    d_act, flips, _, dlogp = out["guided"]
    assert d_act == 0.0 and flips == 0.0, f"guided replay: D_act {d_act}, flip rate {flips}"
    assert dlogp < 1e-3, f"trainer vs vLLM max |dlogp| {dlogp}"


@needs_vllm
@pytest.mark.slow
def test_versions_load_in_place_and_reloading_the_same_weights_changes_nothing(fp4_engine) -> None:
    factory, engine, tensors, meta = fp4_engine
    before = engine.generate(PROMPTS, 1, GREEDY, with_records=True)
    again = factory(tensors, meta, 8)  # the same weights as version 8, through the selector
    assert again is engine and engine.version == 8
    after = engine.generate(PROMPTS, 1, GREEDY, with_records=True)
    for b, a in zip(before, after, strict=True):
        assert (a.completion_tokens, a.logprobs, a.records) == (
            b.completion_tokens,
            b.logprobs,
            b.records,
        )
        assert a.policy_version == 8
    new_tensors, new_meta = pushed(QuantConfig(), ALL_FULL, seed=1)
    assert factory(new_tensors, new_meta, 9) is engine
    got = engine.generate(PROMPTS, 1, GREEDY, with_records=False)
    want = NativeEngine.from_weights(new_tensors, new_meta).generate(PROMPTS, 1, GREEDY,
                                                                      with_records=False)  # fmt: skip
    assert [g.completion_tokens for g in got] == [w.completion_tokens for w in want]
    assert all(g.policy_version == 9 for g in got)
    assert max(abs(a - b) for g, w in zip(got, want, strict=True)
               for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-3  # fmt: skip
    print(f"in-place load: {engine.last_load_seconds:.3f} s")
    with pytest.raises(ValueError, match="changes the model or quant config"):
        engine.load_version(*pushed(QuantConfig.none()), 10)


@needs_vllm
@pytest.mark.slow
def test_high_precision_policy_serves_with_routing_records() -> None:
    """The bf16 mode's policy (no FP4 site) through the same method: plain GEMMs, TRACE
    routing, routing-only records."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tensors, meta = pushed(QuantConfig.none())
    engine = make_engine_factory(EngineSettings(engine="vllm"))(tensors, meta, 1)
    got = engine.generate(PROMPTS, 1, GREEDY, with_records=True)
    want = NativeEngine.from_weights(tensors, meta).generate(PROMPTS, 1, GREEDY, with_records=True)
    for g, w in zip(got, want, strict=True):
        assert g.completion_tokens == w.completion_tokens
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-3
        rec, ref = SampleRecords.from_bytes(g.records), SampleRecords.from_bytes(w.records)
        assert not rec.guidance and torch.equal(rec.routing, ref.routing)


@needs_vllm
@pytest.mark.parametrize(
    ("quant", "shape", "match"),
    [
        (
            QuantConfig(sites=frozenset({SITE_ATTN_WEIGHTS})),
            {},
            r"\['attn_weights'\] are not expressible",
        ),
        (QuantConfig(format="mxfp4"), {}, "runs nvfp4 only"),
        (QuantConfig(), {"shared_expert_intermediate_size": 64}, "no shared expert"),
    ],
)
def test_vllm_engine_refuses_sites_it_cannot_express(quant, shape, match) -> None:
    from trace_common.rollout.vllm_engine import VllmEngine

    with pytest.raises(ValueError, match=match):
        VllmEngine(*pushed(quant, **shape), 1)


@needs_vllm
@pytest.mark.slow
def test_rl_loop_on_the_vllm_engine_learns_with_versions_loaded_in_place() -> None:
    """GRPO in trace mode with one vLLM replica (the demo does not take a vllm engine yet):
    every step's new version loads into the same running engine, the trainer's guided forward
    reproduces the replica's codes on its records, and the rewarded token becomes likelier."""
    from trace_common.rl.core import TrainerConfig, TrainerCore
    from trace_common.rl.dispatch import DispatchConfig, Dispatcher, StaticDirectory
    from trace_common.rl.engine import LocalReplica
    from trace_common.rl.local import LocalPublisher, MemoryRecordStore
    from trace_common.rl.policy import LearnerConfig, ModelLearner
    from trace_common.tasks import CharTokenizer, PromptStream, make_task

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tok = CharTokenizer()
    target = tok.encode("7")[0]  # reward: the share of completion tokens that are "7"
    torch.manual_seed(0)
    model = MoECausalLM(get_config("debug").replace(vocab_size=tok.vocab_size)).init_weights(0)
    learner = ModelLearner(
        model, LearnerConfig(mode="trace", lr=1e-2), quant=QuantConfig(), guidance=ALL_FULL,
        eos_id=tok.eos_id, pad_id=tok.pad_id,
    )  # fmt: skip
    store, holder = MemoryRecordStore(), EngineHolder()
    factory = make_engine_factory(EngineSettings(engine="vllm"))
    core = TrainerCore(
        TrainerConfig(mode="trace", prompts_per_step=4, group_size=4,
                      sampling=SamplingConfig(max_new_tokens=4)),
        prompts=PromptStream(make_task("addition", 1), tok, 0),
        dispatcher=Dispatcher(StaticDirectory([LocalReplica("r0", holder, store.put)]),
                              DispatchConfig(prompts_per_unit=2)),
        scorer=lambda s, p: sum(t == target for t in s.completion_tokens) / len(s.completion_tokens),
        records=store, learner=learner, publisher=LocalPublisher([holder], factory),
    )  # fmt: skip

    @torch.no_grad()
    def logp_target() -> float:  # mean log-prob of "7" as the first completion token
        prompts = [tok.encode(f"{a}+{b}=") for a in range(3) for b in range(3)]
        seqs = [[*p, target] for p in prompts]
        out = forward_logprobs(learner.model, seqs)
        return float(
            torch.stack([out.logprobs[i, len(p) - 1] for i, p in enumerate(prompts)]).mean()
        )

    core.publish()
    engine, _ = holder.snapshot()
    before, steps = logp_target(), []
    for _ in range(4):
        steps.append(core.step())
    after = logp_target()
    print("vLLM RL loop:", [(m["policy_version"], round(m["reward_mean"], 3), m["d_act_max"],
                              m["code_flip_rate"], round(m["step_time_s"], 2)) for m in steps],
          f"logp('7') {before:.3f} -> {after:.3f}")  # fmt: skip
    assert holder.snapshot() == (engine, 4) and engine.version == 4  # one engine, 4 in-place loads
    for m in steps:
        assert m["samples_trained"] == 16 and m["staleness_max"] == 0
        assert m["d_act_max"] == 0.0 and m["code_flip_rate"] == 0.0, m
        assert m["routing_mismatch"] == 0.0 and m["logp_abs_diff_max"] < 1e-3, m
    assert after > before + 0.5, f"logp of the rewarded token {before:.3f} -> {after:.3f}"


@needs_vllm
def test_a_vllm_without_the_needed_api_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM release whose MoE method API moved: an ImportError naming it, not a traceback."""
    import sys

    import trace_common.rollout
    from trace_common.rollout import vllm_engine

    monkeypatch.delattr(trace_common.rollout, "vllm_quant", raising=False)
    monkeypatch.delitem(sys.modules, "trace_common.rollout.vllm_quant", raising=False)
    moved = "vllm.model_executor.layers.fused_moe.fused_moe_method_base"
    monkeypatch.setitem(sys.modules, moved, None)  # the import of this module now fails
    with pytest.raises(ImportError, match=r"vllm \S+ lacks an API the trace_fp4 method needs"):
        vllm_engine._import_vllm()
