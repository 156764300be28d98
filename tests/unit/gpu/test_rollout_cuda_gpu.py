"""The CUDA rollout engine against the PyTorch engine on the same pushed weights (CUDA GPU).

- greedy tokens equal wherever the logit margin allows, and the per-token log-probs agree;
- sampled first tokens follow the PyTorch engine's truncated distribution;
- the batched prefill writes the FP4 cache bit for bit as the decode append does;
- a group's members, which copy the prompt one of them prefilled, decode and record as a
  sequence that prefilled it alone;
- records from the engine replayed by the trainer's guided forward reproduce the rollout's
  K/V codes (D_act and flip rate reported for guided vs RTN);
- a weight swap during generation never mixes versions inside a sample.
"""

from __future__ import annotations

import threading

import pytest
import torch

from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig, SampleRecords
from trace_common.model.config import ModelConfig
from trace_common.model.discrepancy import code_flip_rate, d_act
from trace_common.model.train_forward import forward_logprobs
from trace_common.rl.policy import LearnerConfig, ModelLearner
from trace_common.rollout.cuda import CudaEngine
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.types import SamplingConfig

pytestmark = pytest.mark.gpu

DEV = "cuda"
EOS, PAD = 2, 0
CFG = ModelConfig(vocab_size=512, hidden_size=512, num_layers=4, num_heads=16, num_kv_heads=2,
                  head_dim=128, num_experts=32, top_k=8, moe_intermediate_size=256,
                  max_position_embeddings=1024)  # fmt: skip


def export(seed: int, mode: str = "trace", scale: float = 4.0):
    """A pushed version of a random policy (weights scaled up so logits have margins),
    quantized by a learner on the GPU as the trainer's is (the CPU reference quantizer takes
    minutes on a busy machine)."""
    model = MoECausalLM(CFG).init_weights(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    learner = ModelLearner(model, LearnerConfig(mode=mode), quant=QuantConfig(),
                           guidance=GuidanceConfig(), eos_id=EOS, pad_id=PAD,
                           device=DEV)  # fmt: skip
    return learner.export_weights(), learner


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(3, CFG.vocab_size, (m,), generator=g).tolist() for m in lens]


@pytest.fixture(scope="module")
def engines():
    (tensors, meta), learner = export(1)
    native = NativeEngine.from_weights(tensors, meta, dtype=torch.bfloat16, device=DEV)
    cuda = CudaEngine(tensors, meta, 0, device=DEV, max_batch=16, max_context=256,
                      prefill_tokens=64)  # fmt: skip
    yield native, cuda, learner, tensors, meta
    cuda.close()


@torch.no_grad()
def test_greedy_tokens_and_logprobs_match_the_pytorch_engine(engines) -> None:
    """Greedy tokens equal the bf16 PyTorch engine's wherever its top-2 margin exceeds 0.5;
    the CUDA engine's log-probs are as close to the fp32 trainer's as the bf16 PyTorch
    engine's are (both bf16 rollouts of the same FP4 policy)."""
    native, cuda, learner, *_ = engines
    trainer = learner.model.to(DEV)
    ps = prompts(12, 0)
    sp = SamplingConfig(temperature=0.0, max_new_tokens=24)
    got = cuda.generate(ps, 1, sp, with_records=False)
    d_cuda, d_native, clear_total, clear_diff = [], [], 0, 0
    for s in got:
        seq = ps[s.prompt_index] + s.completion_tokens
        ref = forward_logprobs(native.model, [seq], qat_mode="rtn", return_logits=True)
        fp32 = forward_logprobs(trainer, [seq], qat_mode="rtn").logprobs[0]
        logits = ref.logits[0].float()  # [L-1, V]
        p = len(ps[s.prompt_index])
        for j, tok in enumerate(s.completion_tokens):
            row = logits[p - 1 + j]
            top2 = row.topk(2).values
            if float(top2[0] - top2[1]) > 0.5:
                clear_total += 1
                clear_diff += int(row.argmax()) != tok
            if int(row.argmax()) != tok:
                break  # past a divergence the two engines decode different prefixes
            lp_native = float(torch.log_softmax(row, -1)[tok])
            d_cuda.append(abs(s.logprobs[j] - float(fp32[p - 1 + j])))
            d_native.append(abs(lp_native - float(fp32[p - 1 + j])))
    assert clear_total > 50, f"too few clear-margin tokens ({clear_total}) to test"
    assert clear_diff == 0, f"{clear_diff}/{clear_total} tokens differ where the margin is > 0.5"
    mc, mn = sum(d_cuda) / len(d_cuda), sum(d_native) / len(d_native)
    print(f"greedy: {clear_total} clear-margin tokens equal; mean |dlogp| vs the fp32 trainer: "
          f"CUDA engine {mc:.4f} (max {max(d_cuda):.3f}), PyTorch bf16 engine {mn:.4f} "
          f"(max {max(d_native):.3f}) over {len(d_cuda)} tokens")  # fmt: skip
    assert mc < 2 * mn + 0.01, f"CUDA engine |dlogp| {mc:.4f} vs PyTorch bf16 engine {mn:.4f}"


@torch.no_grad()
def test_sampled_first_tokens_follow_the_truncated_distribution(engines) -> None:
    native, cuda, *_ = engines
    prompt = prompts(1, 3)[0]
    n = 4096
    sp = SamplingConfig(temperature=0.8, top_k=12, top_p=0.95, max_new_tokens=1, seed=9)
    got = cuda.generate([prompt], n, sp, with_records=False)
    ref = forward_logprobs(native.model, [[*prompt, 0]], qat_mode="rtn", return_logits=True)
    x = ref.logits[0, -1].double() / sp.temperature
    kth = torch.topk(x, sp.top_k).values[-1]
    x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0) - probs[order]
    probs[order[cum >= sp.top_p]] = 0
    probs /= probs.sum()
    counts = torch.bincount(torch.tensor([s.completion_tokens[0] for s in got]),
                            minlength=CFG.vocab_size).double() / n  # fmt: skip
    tv = float((counts - probs.cpu()).abs().sum()) / 2
    outside = float(counts[probs.cpu() == 0].sum())
    print(f"sampling: TV distance {tv:.4f} over {int((probs > 0).sum())} tokens, "
          f"{outside:.4f} of the mass outside the support")  # fmt: skip
    assert tv < 0.06, f"total variation {tv:.4f} between CUDA samples and the distribution"
    assert outside < 0.01


def test_prefill_writes_the_cache_as_the_decode_append() -> None:
    """The same prompt through the batched prefill and through decode steps only: the FP4
    cache codes, scales and row scales of every layer agree bit for bit where the layers'
    inputs agree (layer 0: always, since its K/V depend on the embedding alone)."""
    (tensors, meta), _ = export(2)
    sp = SamplingConfig(temperature=0.0, max_new_tokens=1)
    prompt = prompts(1, 5)[0]
    a = CudaEngine(tensors, meta, 0, device=DEV, max_batch=2, max_context=128, prefill_tokens=64)
    b = CudaEngine(tensors, meta, 0, device=DEV, max_batch=2, max_context=128, prefill_tokens=0)
    try:
        a.generate([prompt], 1, sp, with_records=False)
        b.generate([prompt], 1, sp, with_records=False)
        n = len(prompt)
        ca, cb = a.backend.engine.caches[0], b.backend.engine.caches[0]
        for name in ("codes", "scales"):  # [2, B, Hkv, S, .]
            x, y = getattr(ca, name)[:, 0, :, :n], getattr(cb, name)[:, 0, :, :n]
            assert torch.equal(x, y), f"layer 0 cache {name} differs between prefill and append"
        x, y = ca.row_scales[:, 0, :n], cb.row_scales[:, 0, :n]  # [2, B, S]
        assert torch.equal(x, y), "layer 0 cache row scales differ between prefill and append"
    finally:
        a.close()
        b.close()


@torch.no_grad()
def test_group_members_share_the_prompt_and_decode_as_if_alone(engines) -> None:
    """Groups of 4 (greedy, records): one member per prompt prefills it and 3 copy its K/V
    and record rows. Against the prompt generated alone (group of 1: nothing to copy), every
    member has the prompt's record rows bit for bit, the first token and its log-prob
    exactly, and the same greedy completion (later log-probs as close as decoding beside
    other sequences leaves them)."""
    _, cuda, *_ = engines
    ps = prompts(3, 21)
    sp = SamplingConfig(temperature=0.0, max_new_tokens=16)
    alone = cuda.generate(ps, 1, sp, with_records=True)
    before = cuda.stats()
    got = cuda.generate(ps, 4, sp, with_records=True)
    after = cuda.stats()
    copied = after["shared_prompt_tokens_total"] - before["shared_prompt_tokens_total"]
    prefilled = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    assert (prefilled, copied) == (sum(map(len, ps)), 3 * sum(map(len, ps)))
    for s in got:
        ref, who = alone[s.prompt_index], (s.prompt_index, s.group_index)
        assert s.completion_tokens == ref.completion_tokens, who
        assert s.logprobs[0] == ref.logprobs[0], who
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref.logprobs, strict=True)) < 1e-2, who
        n = len(ps[s.prompt_index])  # record rows of the prompt's tokens
        rec, want = SampleRecords.from_bytes(s.records), SampleRecords.from_bytes(ref.records)
        assert torch.equal(rec.routing[:n], want.routing[:n]), who
        assert rec.guidance.keys() == want.guidance.keys()
        for key, g in rec.guidance.items():
            a, b = g.rows(0, n), want.guidance[key].rows(0, n)
            assert torch.equal(a.payload, b.payload), (who, key)
            assert torch.equal(a.block_scales, b.block_scales), (who, key)
            assert torch.equal(a.row_scales, b.row_scales), (who, key)


@torch.no_grad()
def test_records_replayed_by_the_trainer_reproduce_the_rollout_codes(engines) -> None:
    _, cuda, learner, *_ = engines
    ps = prompts(6, 7)
    got = cuda.generate(ps, 1, SamplingConfig(temperature=1.0, max_new_tokens=20, seed=4),
                        with_records=True)  # fmt: skip
    model = learner.model.to(DEV)
    report = {}
    for mode in ("trace", "rtn"):
        dacts, flips = [], []
        for i, s in enumerate(got):
            rec = SampleRecords.from_bytes(s.records)
            seq = ps[s.prompt_index] + s.completion_tokens
            assert rec.tokens.tolist() == seq and rec.num_rows == len(seq) - 1
            out = forward_logprobs(model, [seq], qat_mode=mode, records=[rec], collect=True,
                                   routing_replay=True)  # fmt: skip
            n = len(seq) - 1
            for (li, site), train_vals in out.site_values.items():
                if site not in ("k", "v") or (li, site) not in rec.guidance:
                    continue
                vals, grid = cuda.cached_kv(li, i, n, site)
                dacts.append(d_act(train_vals.float(), vals))
                flips.append(code_flip_rate(out.site_codes[(li, site)].float(), grid))
        report[mode] = (sum(dacts) / len(dacts), sum(flips) / len(flips), len(dacts))
    print("guided k/v sites, trainer fp32 vs CUDA rollout: "
          + "; ".join(f"{m}: D_act {d:.2e}, flip rate {f:.2e} ({n} site-samples)"
                      for m, (d, f, n) in report.items()))  # fmt: skip
    (d_tr, f_tr, n_tr), (d_rtn, f_rtn, _) = report["trace"], report["rtn"]
    assert n_tr > 0
    # compact guidance fixes every code within one grid step of the trainer's value; what is
    # left is where bf16 rollout and fp32 trainer differ by more
    assert f_tr < 0.2 * f_rtn, f"guided flips {f_tr:.2e} not 5x below RTN's {f_rtn:.2e}"
    assert d_tr < d_rtn, f"guided D_act {d_tr:.2e} not below RTN's {d_rtn:.2e}"


def test_weight_swap_never_mixes_versions_inside_a_sample() -> None:
    (t1, m1), _ = export(11)
    (t2, m2), _ = export(12)
    eng = CudaEngine(t1, m1, 1, device=DEV, max_batch=4, max_context=256, prefill_tokens=64)
    ps = prompts(8, 13)
    sp = SamplingConfig(temperature=0.0, max_new_tokens=48)
    try:
        alone1 = eng.generate(ps, 1, sp, with_records=False)
        out: dict[str, list] = {}
        first = threading.Thread(target=lambda: out.setdefault("a", eng.generate(
            ps, 1, sp, with_records=False)))  # fmt: skip
        first.start()
        while eng.scheduler.active_slots == 0:
            pass
        eng.load_version(t2, m2, 2)  # returns once the in-flight request is done
        first.join()
        after = eng.generate(ps, 1, sp, with_records=False)
        eng2 = CudaEngine(t2, m2, 2, device=DEV, max_batch=4, max_context=256, prefill_tokens=64)
        alone2 = eng2.generate(ps, 1, sp, with_records=False)
        eng2.close()
    finally:
        eng.close()
    key = lambda ss: [(s.prompt_index, s.completion_tokens) for s in ss]  # noqa: E731
    assert all(s.policy_version == 1 for s in out["a"])
    assert key(out["a"]) == key(alone1), "the in-flight request must finish on version 1"
    assert all(s.policy_version == 2 for s in after)
    assert key(after) == key(alone2), "after the swap the engine must decode version 2"
    assert key(alone1) != key(alone2)
