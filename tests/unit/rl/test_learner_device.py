"""The learner's device-independent parts, on the CPU: bf16 autocast compute over fp32 master
weights, activation checkpointing (same gradients), the optimizer implementation per device,
and checkpoints that move across devices (map_location, the saved optimizer's fused flag)."""

from __future__ import annotations

import copy

import pytest
import torch

from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig, get_config
from trace_common.model.records import SampleRecords
from trace_common.model.train_forward import forward_logprobs, pad_right
from trace_common.rl.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from trace_common.rl.policy import LearnerConfig, ModelLearner
from trace_common.rl.testing import engine_train_samples
from trace_common.rl.types import TrainSample
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.types import SamplingConfig
from trace_common.tasks import CharTokenizer

TOK = CharTokenizer()
ALL_LAYERS_FULL = GuidanceConfig(layers=(0, 1, 2, 3), mode="full")
PROMPTS = [[TOK.bos_id, *TOK.encode("12+34=")], [TOK.bos_id, *TOK.encode("5+6=")]]


def learner(mode: str = "trace", seed: int = 0, **cfg: object) -> ModelLearner:
    model = MoECausalLM(get_config("debug").replace(vocab_size=TOK.vocab_size)).init_weights(seed)
    return ModelLearner(
        model, LearnerConfig(mode=mode, lr=1e-3, **cfg), quant=QuantConfig(),  # type: ignore[arg-type]
        guidance=ALL_LAYERS_FULL, eos_id=TOK.eos_id, pad_id=TOK.pad_id,
    )  # fmt: skip


def samples_of(lrn: ModelLearner, dtype: torch.dtype = torch.float32) -> list[TrainSample]:
    """Two prompts x two completions from an engine on the learner's exported weights."""
    engine = NativeEngine.from_weights(*lrn.export_weights(), dtype=dtype)
    return engine_train_samples(engine, PROMPTS, 2, SamplingConfig(max_new_tokens=5, seed=3),
                                advantages=(-1.0, 1.0), rewards=(0.0, 1.0))  # fmt: skip


def test_compute_dtype_defaults_and_rejects_unknown() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert LearnerConfig().autocast_dtype(cpu) is None
    assert LearnerConfig().autocast_dtype(cuda) is torch.bfloat16
    assert LearnerConfig(compute_dtype="float32").autocast_dtype(cuda) is None
    assert LearnerConfig(compute_dtype="bfloat16").autocast_dtype(cpu) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown compute_dtype 'float16'"):
        LearnerConfig(compute_dtype="float16")


def test_bf16_autocast_step_keeps_fp32_master_weights_and_state() -> None:
    """bf16 compute on the CPU: the step runs under autocast (its log-probs differ from the
    fp32 step's), weights, gradients and Adam moments stay fp32, and a bf16 rollout with
    every layer guided is reproduced at the FP4 sites up to small D_act."""
    fp32, bf16 = learner(), learner(compute_dtype="bfloat16")
    samples = samples_of(fp32, dtype=torch.bfloat16)
    m32, m16 = fp32.train_step(samples), bf16.train_step(samples)
    assert m16["logp_abs_diff_mean"] != m32["logp_abs_diff_mean"]
    for p in bf16.model.parameters():
        assert p.dtype == torch.float32
        assert p.grad is None or p.grad.dtype == torch.float32
    state = bf16.optimizer.state_dict()["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    assert m16["d_act_mean"] < 0.05, m16["d_act_mean"]
    assert m16["routing_mismatch"] >= 0.0 and m16["train_tokens"] > 0
    assert m16["train_tokens_per_s"] > 0


def test_bf16_autocast_forward_runs_the_gemms_in_bf16() -> None:
    lrn = learner(compute_dtype="bfloat16")
    tokens, lengths = pad_right(PROMPTS, TOK.pad_id)
    with lrn.compute():
        out = forward_logprobs(lrn.model, tokens, lengths=lengths, return_logits=True)
    assert out.logits is not None and out.logits.dtype == torch.bfloat16
    with torch.no_grad():
        plain = forward_logprobs(lrn.model, tokens, lengths=lengths, return_logits=True)
    assert plain.logits is not None and plain.logits.dtype == torch.float32


@pytest.mark.parametrize("qat_mode,replay", [("trace", True), ("rtn", False)])
def test_activation_checkpointing_gives_the_same_gradients(qat_mode: str, replay: bool) -> None:
    """Recomputing each decoder layer in the backward gives bit-identical log-probs and
    gradients (guided QAT with routing replay, and plain RTN QAT)."""
    lrn = learner()
    samples = samples_of(lrn)
    seqs = [list(s.rollout.prompt_tokens) + s.rollout.completion_tokens for s in samples]
    tokens, lengths = pad_right(seqs, TOK.pad_id)
    records = [SampleRecords.from_bytes(s.records) for s in samples]  # type: ignore[arg-type]
    results = []
    for ckpt in (False, True):
        lrn.model.activation_checkpointing = ckpt
        lrn.model.zero_grad(set_to_none=True)
        out = forward_logprobs(
            lrn.model, tokens, lengths=lengths, qat_mode=qat_mode,
            records=records if qat_mode == "trace" or replay else None, routing_replay=replay,
        )  # fmt: skip
        (out.logprobs * torch.linspace(-1, 1, out.logprobs.shape[1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in lrn.model.named_parameters() if p.grad is not None}
        results.append((out.logprobs.detach(), grads))
    (lp0, g0), (lp1, g1) = results
    assert torch.equal(lp0, lp1)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_activation_checkpointing_is_off_without_autograd() -> None:
    """No-grad forwards (the reference pass, the rollout) never go through checkpoint."""
    lrn = learner(activation_checkpointing=True)
    assert lrn.model.activation_checkpointing
    calls = []
    import trace_common.model.model as model_mod

    real = model_mod.checkpoint
    model_mod.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)  # type: ignore[assignment]
    try:
        tokens, lengths = pad_right(PROMPTS, TOK.pad_id)
        with torch.no_grad():
            forward_logprobs(lrn.model, tokens, lengths=lengths)
        assert calls == []
        forward_logprobs(lrn.model, tokens, lengths=lengths).logprobs.sum().backward()
        assert len(calls) == lrn.model.cfg.num_layers
    finally:
        model_mod.checkpoint = real  # type: ignore[assignment]


def test_train_step_with_activation_checkpointing_matches_without() -> None:
    a, b = learner(), learner(activation_checkpointing=True)
    samples = samples_of(a)
    ma, mb = a.train_step(samples), b.train_step(samples)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), n


def _emulated_gpu_learner() -> ModelLearner:
    """A learner whose optimizer is the fused AdamW a CUDA learner builds (CPU fused AdamW
    exists, so the state-dict shape of a GPU checkpoint can be produced here)."""
    lrn = learner()
    lrn.optimizer = torch.optim.AdamW(lrn.model.parameters(), lr=1e-3, fused=True)
    return lrn


def _assert_same_state(a: ModelLearner, b: ModelLearner) -> None:
    """Bit-identical master weights and AdamW state (moments and step)."""
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][name], sb[k][name]), (k, name)
        assert float(sa[k]["step"]) == float(sb[k]["step"])


# Rounded fp32 operations on the path from (theta, m, v, g) to the new theta in AdamW: the
# decay, two moment updates, two bias corrections, the sqrt, +eps, the divide, the scale by
# lr and the subtraction. Each rounds with relative error <= 2^-24, in whatever order an
# implementation runs them, so two implementations differ by at most about twice that count.
ADAMW_ROUNDED_OPS = 10
FP32_UNIT_ROUNDOFF = 2.0**-24


def _adamw_step_bound(theta: torch.Tensor, state: dict, lr: float) -> torch.Tensor:
    """Per element: how far two correct fp32 AdamW implementations may end apart after one
    step from the same (theta, state, grad): 2 x ops x u x (|theta| + lr |m_hat / (sqrt(v_hat)
    + eps)|), the magnitudes the rounded terms carry (fp64 here)."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    t = float(state["step"])
    m_hat = state["exp_avg"].double() / (1 - beta1**t)
    v_hat = state["exp_avg_sq"].double() / (1 - beta2**t)
    update = lr * (m_hat / (v_hat.sqrt() + eps)).abs()
    return 2 * ADAMW_ROUNDED_OPS * FP32_UNIT_ROUNDOFF * (theta.double().abs() + update)


def test_checkpoint_from_a_fused_optimizer_resumes_unfused_and_back(tmp_path) -> None:
    """A checkpoint written by the fused (GPU) optimizer loads into the CPU learner with the
    CPU's implementation, and a CPU checkpoint into the fused one: weights, moments and step
    round-trip bit for bit. From the same state and gradients, the two implementations' next
    step agrees within the rounding bound of the AdamW arithmetic (they order their fp32
    operations differently, so equality is not theirs to give on every CPU)."""
    gpu = _emulated_gpu_learner()
    samples = samples_of(gpu)
    gpu.train_step(samples)
    model_state, optim_state = gpu.state()
    assert optim_state["param_groups"][0]["fused"] is True
    path = save_checkpoint(
        tmp_path,
        Checkpoint(step=1, version=1, model=model_state, optimizer=optim_state,
                   prompt_state={}, extra={}),
    )  # fmt: skip
    ckpt = load_checkpoint(path, map_location="cpu")
    assert all(t.device.type == "cpu" for t in ckpt.model.values())
    cpu = learner(seed=1)  # other initial weights: everything must come from the checkpoint
    cpu.load_state(ckpt.model, ckpt.optimizer)
    assert not cpu.optimizer.param_groups[0]["fused"]
    _assert_same_state(cpu, gpu)
    assert float(next(iter(cpu.optimizer.state.values()))["step"]) == 2.0  # 2 minibatches
    # ... and back: the CPU learner's state into a fused one
    back = _emulated_gpu_learner()
    back.load_state(*copy.deepcopy(cpu.state()))  # a copy, as a file would give
    assert back.optimizer.param_groups[0]["fused"] is True
    step = next(iter(back.optimizer.state.values()))["step"]
    assert step.dtype == torch.float32 and float(step) == 2.0
    _assert_same_state(back, cpu)
    # One step of each implementation from that state, with the same gradients.
    gen = torch.Generator().manual_seed(0)
    before = {n: p.detach().clone() for n, p in cpu.model.named_parameters()}
    for pa, pb in zip(cpu.model.parameters(), back.model.parameters(), strict=True):
        g = torch.randn(pa.shape, generator=gen) * 1e-2
        pa.grad, pb.grad = g.clone(), g.clone()
    cpu.optimizer.step()
    back.optimizer.step()
    lr = cpu.optimizer.param_groups[0]["lr"]
    state = cpu.optimizer.state
    for (n, pa), pb in zip(cpu.model.named_parameters(), back.model.parameters(), strict=True):
        bound = _adamw_step_bound(before[n], state[pa], lr)
        gap = (pa.detach().double() - pb.detach().double()).abs()
        worst = float((gap - bound).max())
        assert worst <= 0, f"{n}: fused and for-loop AdamW differ by {worst:.3g} over the bound"
        moved = (pa.detach().double() - before[n].double()).abs()
        assert float(moved.mean()) > 100 * float(bound.mean()), f"{n}: the step hardly moved"
        assert float(state[pa]["step"]) == float(back.optimizer.state[pb]["step"]) == 3.0


def test_load_state_rejects_other_param_groups() -> None:
    lrn = learner()
    _, optim_state = lrn.state()
    bad = {**optim_state, "param_groups": optim_state["param_groups"] * 2}
    with pytest.raises(ValueError, match="2 parameter groups, this learner 1"):
        lrn.load_state(lrn.state()[0], bad)


def test_export_and_checkpoint_tensors_are_on_the_cpu(tmp_path) -> None:
    lrn = learner()
    lrn.train_step(samples_of(lrn))
    tensors, _ = lrn.export_weights()
    assert {t.device.type for t in tensors.values()} == {"cpu"}
    model_state, optim_state = lrn.state()
    path = save_checkpoint(
        tmp_path,
        Checkpoint(step=0, version=0, model=model_state, optimizer=optim_state,
                   prompt_state={}, extra={}),
    )  # fmt: skip
    got = load_checkpoint(path)
    assert {t.device.type for t in got.model.values()} == {"cpu"}
    moments = [s["exp_avg"] for s in got.optimizer["state"].values()]
    assert moments and {t.device.type for t in moments} == {"cpu"}
