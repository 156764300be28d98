"""`Experts.forward` (rows sorted by expert, one `down_in` site call per layer) against the
per-expert loop kept here as the reference: the same forward values and the same gradients
(input rows, routing weights, expert weights) bit for bit on the CPU, in fp32 and bf16, for
every kind of hooks (plain, the trainer's none/rtn/trace QAT, the FP4 rollout, calibration),
with experts that get no tokens, and for the whole model (QAT forward/backward with records
and routing replay, rollout with records). The `torch._grouped_mm` path, forced on the CPU,
agrees with the reference within bf16 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import trace_common.model.model as model_module
from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    SamplingConfig,
    forward_logprobs,
    generate,
)
from trace_common.model.config import ASITE_DOWN_IN
from trace_common.model.export import calibrate_act_amax
from trace_common.model.model import Experts, Hooks, PlainHooks
from trace_common.model.quant import quant_config_of
from trace_common.model.runtime import RolloutHooks, TrainHooks

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2, 11], [6], [3, 3, 12, 40, 2, 17, 21]]
ALL_LAYERS = (0, 1, 2, 3)
USED_EXPERTS = (1, 2, 4, 6, 7)  # of the debug shape's 8: experts 0, 3 and 5 get no tokens


def reference_forward(
    self: Experts,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    hooks: Hooks,
    layer: int,
) -> torch.Tensor:
    """The per-expert loop: select each expert's rows, one site call per expert, scatter each
    expert's output into a full fp32 [N*k, H] buffer."""
    mode = hooks.weight_mode(self.weight_site)
    wg = self.effective_weight("gate_proj", mode)
    wu = self.effective_weight("up_proj", mode)
    wd = self.effective_weight("down_proj", mode)
    n, k = ids.shape
    slots = x.new_zeros(n * k, x.shape[1], dtype=torch.float32)  # [N*k, H]
    flat_ids = ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        rows = torch.nonzero(flat_ids == e).flatten()
        xe = x[rows // k]  # [n_e, H]
        he = F.silu(xe @ wg[e].T) * (xe @ wu[e].T)
        he = hooks.act(layer, ASITE_DOWN_IN, he)
        ye = he @ wd[e].T
        slots = slots.index_copy(0, rows, ye.float())
    w = weights.reshape(n * k, 1).float()
    return (slots * w).view(n, k, -1).sum(dim=1).to(x.dtype)


class CalibrationHooks(RolloutHooks):
    """The rollout's hooks that also keep the largest |x| per (layer, site) (as export's)."""

    def __init__(self, quant) -> None:
        super().__init__(quant)
        self.amax: dict[tuple[int, str], float] = {}

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        a = float(x.detach().abs().amax())
        self.amax[(layer, site)] = max(a, self.amax.get((layer, site), 0.0))
        return super().act(layer, site, x)


def make_hooks(kind: str, model: MoECausalLM, n: int) -> Hooks:
    quant = quant_config_of(model)
    rows = torch.arange(n)
    if kind == "plain":
        return PlainHooks()
    if kind in ("none", "rtn", "trace"):
        return TrainHooks(quant, kind, rows, collect=True)
    if kind == "rollout":
        return RolloutHooks(quant, guided=frozenset({(0, "moe_in")}))
    if kind == "calibration":
        return CalibrationHooks(quant)
    raise AssertionError(kind)


def routed(n: int, k: int, dtype: torch.dtype, seed: int):
    """x [N, H], distinct ids [N, k] from USED_EXPERTS, routing weights [N, k], grad [N, H]."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor(USED_EXPERTS)
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(n)])
    x = (torch.randn(n, 64, generator=g) * 2).to(dtype)
    w = torch.rand(n, k, generator=g).to(dtype)
    grad = torch.randn(n, 64, generator=g).to(dtype)
    return x, ids, w, grad


def run_experts(experts: Experts, forward, x, ids, w, grad, hooks: Hooks):
    """Output, grads of x / routing weights / gate, up, down weights, and the hooks."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    out = forward(experts, x, ids, w, hooks, 0)
    out.backward(grad)
    params = [experts.gate_proj.grad, experts.up_proj.grad, experts.down_proj.grad]
    return out.detach(), x.grad, w.grad, params


def assert_same(got, want, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got is not None, what
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got, want), f"{what}: max |diff| {(got - want).abs().max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "none", "rtn", "trace", "rollout", "calibration"])
def test_experts_equal_the_per_expert_loop(debug_model, dtype, k, kind) -> None:
    """Bit-identical outputs and gradients; k=4 checks that each token's k input gradients
    are added in the loop's order (fp addition of three or more terms depends on it)."""
    experts = copy.deepcopy(debug_model.model.layers[0].mlp.experts).to(dtype)
    x, ids, w, grad = routed(37, k, dtype, seed=k)
    hooks_new = make_hooks(kind, debug_model, len(x))
    hooks_ref = make_hooks(kind, debug_model, len(x))
    new = run_experts(experts, Experts.forward, x, ids, w, grad, hooks_new)
    ref = run_experts(experts, reference_forward, x, ids, w, grad, hooks_ref)
    for what, got, want in zip(("out", "x.grad", "weights.grad"), new[:3], ref[:3], strict=True):
        assert_same(got, want, what)
    for name, got, want in zip(("gate_proj", "up_proj", "down_proj"), new[3], ref[3], strict=True):
        assert_same(got, want, f"{name}.grad")
        if want is not None:  # experts without tokens: exactly zero
            unused = [e for e in range(experts.num_experts) if e not in USED_EXPERTS]
            assert not got[unused].any(), name
    if kind == "calibration":  # the down_in amax over one call = the max over per-expert calls
        assert hooks_new.amax == hooks_ref.amax  # type: ignore[attr-defined]


def test_experts_with_no_tokens(debug_model) -> None:
    experts = debug_model.model.layers[0].mlp.experts
    x = torch.randn(0, 64)
    out = experts(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), PlainHooks(), 0)
    assert out.shape == (0, 64) and out.dtype == x.dtype


def test_experts_call_the_down_in_site_once(debug_model) -> None:
    """One `hooks.act` call over all N*k rows (the site's fake quant is per row)."""
    calls: list[tuple[str, int]] = []

    class Recording(PlainHooks):
        def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
            calls.append((site, x.shape[0]))
            return x

    x, ids, w, _ = routed(37, 2, torch.float32, seed=0)
    debug_model.model.layers[0].mlp.experts(x, ids, w, Recording(), 0)
    assert calls == [(ASITE_DOWN_IN, 37 * 2)]


def model_grads(model: MoECausalLM, seqs, records, qat_mode: str, replay: bool):
    model.zero_grad(set_to_none=True)
    out = forward_logprobs(model, seqs, qat_mode=qat_mode, records=records, routing_replay=replay)
    (out.logprobs * torch.linspace(-1, 1, out.logprobs.shape[1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), grads


@pytest.fixture(scope="module")
def rollout(debug_model: MoECausalLM):
    guidance = GuidanceConfig(layers=ALL_LAYERS, mode="full")
    return generate(
        debug_model, PROMPTS, SamplingConfig(max_new_tokens=8, seed=11), guidance=guidance
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("qat_mode", "replay"), [("none", False), ("rtn", False), ("rtn", True), ("trace", True)]
)
def test_forward_logprobs_equal_the_per_expert_loop(
    debug_model, rollout, monkeypatch, dtype, qat_mode, replay
) -> None:
    """The trainer's QAT forward/backward on the debug shape: same log-probs and same
    gradients of every parameter, bit for bit."""
    model = copy.deepcopy(debug_model).to(dtype).train()
    seqs = [p + t for p, t in zip(rollout.prompts, rollout.tokens, strict=True)]
    records = rollout.records if qat_mode == "trace" or replay else None
    lp_new, g_new = model_grads(model, seqs, records, qat_mode, replay)
    monkeypatch.setattr(Experts, "forward", reference_forward)
    lp_ref, g_ref = model_grads(model, seqs, records, qat_mode, replay)
    assert_same(lp_new, lp_ref, "logprobs")
    assert g_new.keys() == g_ref.keys() and any("experts" in n for n in g_ref)
    for name in g_ref:
        assert_same(g_new[name], g_ref[name], name)


def test_rollout_and_calibration_equal_the_per_expert_loop(debug_model, monkeypatch) -> None:
    """The FP4 rollout (guidance and routing records) and export's activation calibration."""
    guidance = GuidanceConfig(layers=ALL_LAYERS, mode="full")
    sampling = SamplingConfig(max_new_tokens=8, seed=5)
    batches = [torch.tensor([p[:3] for p in PROMPTS if len(p) >= 3])]
    new = generate(debug_model, PROMPTS, sampling, guidance=guidance)
    amax_new = calibrate_act_amax(debug_model, batches)
    monkeypatch.setattr(Experts, "forward", reference_forward)
    ref = generate(debug_model, PROMPTS, sampling, guidance=guidance)
    amax_ref = calibrate_act_amax(debug_model, batches)
    assert new.tokens == ref.tokens and new.logprobs == ref.logprobs
    assert [r.to_bytes() for r in new.records] == [r.to_bytes() for r in ref.records]
    assert amax_new == amax_ref


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("kind", ["plain", "rtn"])
def test_grouped_mm_path_on_cpu_matches_the_loop(debug_model, monkeypatch, kind) -> None:
    """The bf16 `torch._grouped_mm` path (chosen on CUDA only; forced here) against the
    reference: three grouped GEMMs per call; outputs and gradients within bf16 rounding."""
    experts = copy.deepcopy(debug_model.model.layers[0].mlp.experts).to(torch.bfloat16)
    x, ids, w, grad = routed(37, 4, torch.bfloat16, seed=3)
    ref = run_experts(
        experts, reference_forward, x, ids, w, grad, make_hooks(kind, debug_model, 37)
    )
    calls = []
    grouped_mm = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    monkeypatch.setattr(model_module, "use_grouped_mm", lambda x, w: True)
    new = run_experts(experts, Experts.forward, x, ids, w, grad, make_hooks(kind, debug_model, 37))
    assert len(calls) == 3  # gate, up, down (their backward runs inside autograd)
    names = ("out", "x.grad", "weights.grad", "gate_proj.grad", "up_proj.grad", "down_proj.grad")
    for name, got, want in zip(names, [*new[:3], *new[3]], [*ref[:3], *ref[3]], strict=True):
        err = float((got.float() - want.float()).norm() / want.float().norm())
        assert err < 1e-2, f"{name}: relative error {err:.2e} (bf16 rounding: < 1e-2)"
