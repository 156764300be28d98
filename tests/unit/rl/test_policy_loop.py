"""The RL loop in-process on the tiny MoE: native engine, learner modes, warm start."""

from __future__ import annotations

import math

import pytest
import torch

from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig, SampleRecords, get_config
from trace_common.rl.core import TrainerConfig, TrainerCore
from trace_common.rl.dispatch import DispatchConfig, Dispatcher, StaticDirectory
from trace_common.rl.engine import LocalReplica
from trace_common.rl.local import LocalPublisher, MemoryRecordStore
from trace_common.rl.policy import LearnerConfig, ModelLearner
from trace_common.rl.warmstart import WarmStartConfig, greedy_accuracy, warm_start
from trace_common.rollout.engine import EngineHolder
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.types import SamplingConfig
from trace_common.tasks import CharTokenizer, PromptStream, exact_match_reward, make_task

TOK = CharTokenizer()
ALL_LAYERS_FULL = GuidanceConfig(layers=(0, 1, 2, 3), mode="full")


def tiny_model(seed: int = 0) -> MoECausalLM:
    return MoECausalLM(get_config("debug").replace(vocab_size=TOK.vocab_size)).init_weights(seed)


def build_loop(mode: str, guidance: GuidanceConfig, *, replicas: int = 2):
    torch.manual_seed(0)
    learner = ModelLearner(
        tiny_model(), LearnerConfig(mode=mode, lr=1e-3), quant=QuantConfig(), guidance=guidance,
        eos_id=TOK.eos_id, pad_id=TOK.pad_id,
    )  # fmt: skip
    store = MemoryRecordStore()
    holders = [EngineHolder() for _ in range(replicas)]
    reps = [LocalReplica(f"r{i}", h, store.put) for i, h in enumerate(holders)]
    task = make_task("addition", 1)
    fetched: list[dict[str, bytes]] = []

    class SpyStore:
        def fetch(self, run_id, version, sample_ids, *, generations=None):
            got = store.fetch(run_id, version, sample_ids, generations=generations)
            fetched.append(got)
            return got

    core = TrainerCore(
        TrainerConfig(mode=mode, prompts_per_step=4, group_size=4,
                      sampling=SamplingConfig(max_new_tokens=3)),
        prompts=PromptStream(task, TOK, 0),
        dispatcher=Dispatcher(StaticDirectory(reps), DispatchConfig(prompts_per_unit=1)),
        scorer=lambda s, p: exact_match_reward(s.completion_tokens, p.answer, TOK),
        records=SpyStore(),
        learner=learner,
        publisher=LocalPublisher(holders, NativeEngine.from_weights),
    )  # fmt: skip
    return core, holders, store, fetched


def test_a_step_without_fresh_samples_reports_no_rollout_mismatch() -> None:
    """Samples one version old differ from the trainer by the policy's drift as well: the
    step reports their gap apart (`*_stale`) and no mismatch, instead of passing the drift
    off as a rollout/trainer mismatch."""
    core, _, _, _ = build_loop("trace", ALL_LAYERS_FULL)
    core.publish()
    core.publisher.holders = []  # the replicas stay on version 0 from here
    m1 = core.step()  # fresh: version 0 samples train version 0
    assert m1["fresh_fraction"] == 1.0 and m1["d_act_max"] == 0.0
    m2 = core.step()  # version 0 samples, trainer at version 1
    assert m2["fresh_fraction"] == 0.0 and m2["staleness_max"] == 1
    for key in ("logp_abs_diff_mean", "k3_kl", "d_act_mean", "code_flip_rate", "routing_mismatch"):
        assert key not in m2, key
    assert m2["logp_abs_diff_mean_stale"] > 0.0  # the drift, reported as such


def test_trace_loop_all_layers_guided_reproduces_rollout_exactly() -> None:
    core, holders, store, fetched = build_loop("trace", ALL_LAYERS_FULL)
    core.publish()
    for _ in range(2):
        m = core.step()
        assert m["d_act_mean"] == 0.0 and m["d_act_max"] == 0.0 and m["code_flip_rate"] == 0.0
        assert m["logp_abs_diff_max"] < 1e-4, m["logp_abs_diff_max"]
        assert m["routing_mismatch"] == 0.0
        assert m["record_bytes_per_token"] > 0
    assert [h.version for h in holders] == [2, 2]
    # the trainer used exactly the bytes the replicas wrote
    for batch in fetched:
        for sid, blob in batch.items():
            (key,) = [k for k in store.blobs if k[2] == sid]
            assert store.blobs[key] == blob
    assert len(set(m["rollout_tokens_per_s_per_replica"])) == 2


def test_engine_loads_pushed_codes_without_requantizing() -> None:
    core, holders, _, _ = build_loop("trace", GuidanceConfig())
    core.publish()
    engine, version = holders[0].snapshot()
    ex_train = core.learner.model.model.layers[1].mlp.experts
    ex_roll = engine.model.model.layers[1].mlp.experts
    assert version == 0
    assert torch.equal(
        ex_train.quantized["up_proj"][3].qdata, ex_roll.quantized["up_proj"][3].qdata
    )
    assert torch.equal(ex_train.dequant["down_proj"], ex_roll.dequant["down_proj"])
    samples = engine.generate([[1, 4, 13]], 2, SamplingConfig(max_new_tokens=3), with_records=True)
    rec = SampleRecords.from_bytes(samples[0].records)
    assert rec.tokens.tolist() == [1, 4, 13, *samples[0].completion_tokens]
    assert {layer for layer, _ in rec.guidance} == {2, 3}  # the deeper half by default


def test_unguided_samples_run_rtn_without_replay_beside_guided_ones() -> None:
    """Records lost, lost_records=unguided: those rows get the rtn forward with the model's
    own routing, the others the guided one with replay, in one batch."""
    from trace_common.model import forward_logprobs
    from trace_common.model.train_forward import pad_right
    from trace_common.rl.testing import engine_train_samples

    core, holders, _, _ = build_loop("trace", ALL_LAYERS_FULL)
    core.publish()
    engine, _ = holders[0].snapshot()
    samples = engine_train_samples(
        engine, [[1, 4, 13], [1, 5, 12]], 2, SamplingConfig(max_new_tokens=3),
        advantages=[1.0, -1.0],
    )  # fmt: skip
    for ts in samples[2:]:
        ts.records, ts.unguided = None, True
    learner = core.learner
    seqs = [list(ts.rollout.prompt_tokens) + ts.rollout.completion_tokens for ts in samples]
    tokens, lengths = pad_right(seqs, TOK.pad_id)
    recs = [SampleRecords.from_bytes(ts.records) for ts in samples[:2]]
    kw = dict(qat_mode="trace", routing_replay=True, temperature=1.0)
    with torch.no_grad():
        mixed = learner._forward(tokens, lengths, [*recs, None, None], [2, 3], **kw).logprobs
        guided = forward_logprobs(learner.model, tokens[:2], lengths=lengths[:2], records=recs,
                                  **kw).logprobs  # fmt: skip
        rtn = forward_logprobs(learner.model, tokens[2:], lengths=lengths[2:], qat_mode="rtn",
                               temperature=1.0).logprobs  # fmt: skip
    assert torch.equal(mixed[:2], guided) and torch.equal(mixed[2:], rtn)
    m = learner.train_step(samples)
    assert math.isfinite(m["loss"]) and "d_act_mean" not in m  # measured on log-probs only
    samples[0].records = None  # lost but not marked unguided: refused, never trained rtn
    with pytest.raises(ValueError, match="records"):
        learner.train_step(samples)


@pytest.mark.parametrize("mode", ["bf16", "fp4", "rtn"])
def test_other_modes_train_and_skip_records(mode: str) -> None:
    core, holders, store, fetched = build_loop(mode, ALL_LAYERS_FULL)
    core.publish()
    m = core.step()
    assert store.blobs == {} and fetched == []
    assert "d_act_mean" not in m and m["record_bytes_per_token"] == 0
    assert m["grad_norm"] >= 0 and holders[0].version == 1
    engine, _ = holders[0].snapshot()
    quantized = bool(engine.model.model.layers[0].mlp.experts.quantized)
    assert quantized == (mode != "bf16")


def test_warm_start_raises_accuracy() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    from trace_common.model.quant import quantize_policy

    quantize_policy(model, QuantConfig.none())
    stream = PromptStream(make_task("addition", 1), TOK, 0)
    before = greedy_accuracy(model, stream, 32, 3)
    res = warm_start(
        model, stream, WarmStartConfig(max_steps=80, eval_every=20, eval_prompts=32,
                                       target_accuracy=0.3), max_new_tokens=3,
    )  # fmt: skip
    assert before < 0.1 and res.accuracy >= 0.3, (before, res)
