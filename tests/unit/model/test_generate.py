"""Rollout path: KV-cache decode equals a full forward; padding; sampling; stop tokens."""

from __future__ import annotations

import math

import pytest
import torch

from trace_common.model import (
    MoECausalLM,
    QuantConfig,
    SamplingConfig,
    forward_logprobs,
    generate,
    get_config,
    quantize_policy,
)
from trace_common.model.kv_cache import KVCache

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2, 11], [6], [3, 3, 12, 40, 2]]
# FP4 KV: decode and full forward quantize the same K/V rows with RTN; they may still differ
# where fp32 accumulation-order noise moves a value across a rounding boundary. Measured max
# |dlogp| on this case is ~1e-6; the test holds 1e-4.
FP4_KV_LOGP_ATOL = 1e-4
HP_LOGITS_ATOL = 1e-5


def completion_logprobs(model, out, qat_mode: str = "none") -> torch.Tensor:
    seqs = [p + t for p, t in zip(out.prompts, out.tokens, strict=True)]
    res = forward_logprobs(model, seqs, qat_mode=qat_mode)
    return torch.cat(
        [
            res.logprobs[i, len(p) - 1 : len(s) - 1]
            for i, (s, p) in enumerate(zip(seqs, out.prompts, strict=True))
        ]
    )


def test_kv_cache_decode_logits_equal_full_forward(hp_model: MoECausalLM) -> None:
    cfg = hp_model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        full = hp_model(ids, pos, torch.ones(2, 10, dtype=torch.bool))  # [2, 10, V]
        cache = KVCache(
            num_layers=cfg.num_layers,
            batch=2,
            max_len=10,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=torch.float32,
        )
        steps = [
            hp_model(
                ids[:, :4],
                pos[:, :4],
                cache.key_valid(torch.ones(2, 4, dtype=torch.bool)),
                cache=cache,
            )
        ]
        for t in range(4, 10):
            steps.append(
                hp_model(
                    ids[:, t : t + 1],
                    pos[:, t : t + 1],
                    cache.key_valid(torch.ones(2, 1, dtype=torch.bool)),
                    cache=cache,
                )
            )
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=HP_LOGITS_ATOL)


def test_generate_logprobs_equal_full_forward_high_precision(hp_model: MoECausalLM) -> None:
    out = generate(hp_model, PROMPTS, SamplingConfig(max_new_tokens=12, temperature=0))
    assert [len(t) for t in out.tokens] == [12] * 4
    got = torch.tensor([lp for row in out.logprobs for lp in row])
    torch.testing.assert_close(completion_logprobs(hp_model, out), got, rtol=0, atol=HP_LOGITS_ATOL)


def test_generate_fp4_kv_matches_full_forward_within_tolerance(hp_model: MoECausalLM) -> None:
    model = MoECausalLM(hp_model.cfg).eval()
    model.load_state_dict(hp_model.state_dict())
    quantize_policy(model, QuantConfig(sites=frozenset({"kv"})))
    out = generate(model, PROMPTS, SamplingConfig(max_new_tokens=12, temperature=0))
    got = torch.tensor([lp for row in out.logprobs for lp in row])
    train = completion_logprobs(model, out, qat_mode="rtn")
    assert (train - got).abs().max() <= FP4_KV_LOGP_ATOL
    # ...and FP4 KV really changes the numbers (the tolerance is not hiding a no-op).
    assert (completion_logprobs(model, out, qat_mode="none") - got).abs().max() > 1e-3


def test_padding_side_and_batch_composition_do_not_change_results(debug_model) -> None:
    sp = SamplingConfig(max_new_tokens=6, temperature=0)
    ref = generate(debug_model, PROMPTS, sp)
    width = max(map(len, PROMPTS))
    left = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    right = torch.zeros_like(left)
    lmask, rmask = torch.zeros_like(left), torch.zeros_like(left)
    for i, p in enumerate(PROMPTS):
        left[i, width - len(p) :], lmask[i, width - len(p) :] = torch.tensor(p), 1
        right[i, : len(p)], rmask[i, : len(p)] = torch.tensor(p), 1
    for ids, mask in ((left, lmask), (right, rmask)):
        out = generate(debug_model, ids, sp, attention_mask=mask)
        assert out.tokens == ref.tokens and out.logprobs == ref.logprobs
    alone = generate(debug_model, [PROMPTS[1]], sp)
    assert alone.tokens[0] == ref.tokens[1]
    assert alone.logprobs[0] == pytest.approx(ref.logprobs[1], abs=1e-5)


def test_sampling_seed_stop_tokens_and_truncation(debug_model) -> None:
    a = generate(debug_model, PROMPTS, SamplingConfig(max_new_tokens=8, seed=7))
    b = generate(debug_model, PROMPTS, SamplingConfig(max_new_tokens=8, seed=7))
    c = generate(debug_model, PROMPTS, SamplingConfig(max_new_tokens=8, seed=8))
    assert a.tokens == b.tokens and a.tokens != c.tokens
    # top_k=1 is greedy, and the sampling distribution puts all mass on the chosen token.
    g = generate(debug_model, PROMPTS, SamplingConfig(max_new_tokens=8, temperature=0))
    k1 = generate(debug_model, PROMPTS, SamplingConfig(max_new_tokens=8, top_k=1, seed=3))
    assert k1.tokens == g.tokens and all(lp == 0.0 for row in k1.logprobs for lp in row)
    # Stop on the first token sampled by sample 0: it ends there with reason "stop".
    stop_tok = a.tokens[0][2]
    s = generate(
        debug_model, PROMPTS, SamplingConfig(max_new_tokens=8, seed=7, stop_token_ids=(stop_tok,))
    )
    first = a.tokens[0].index(stop_tok)
    assert s.tokens[0] == a.tokens[0][: first + 1] and s.finish_reasons[0] == "stop"
    assert all(r in ("stop", "length") for r in s.finish_reasons)


def test_generate_rejects_bad_input(debug_model) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(debug_model, [[1], []])
    with pytest.raises(ValueError, match=r"token ids \[99\]"):
        generate(debug_model, [[1, 99]])
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="not contiguous"):
        generate(
            debug_model,
            torch.ones(1, 3, dtype=torch.long),
            attention_mask=torch.tensor([[1, 0, 1]]),
        )
    cfg = get_config("debug")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(debug_model, [[1]], SamplingConfig(max_new_tokens=cfg.max_position_embeddings))


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-3])
def test_a_temperature_whose_logits_would_overflow_is_refused(temperature: float) -> None:
    # logits / 1e-45 is inf in float32: sampling would draw from NaN probabilities
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or >= 0.01"):
        SamplingConfig(temperature=temperature)


def test_the_smallest_temperature_samples_finite_logprobs(debug_model) -> None:
    out = generate(debug_model, PROMPTS, SamplingConfig(max_new_tokens=4, temperature=1e-2))
    assert all(math.isfinite(lp) for row in out.logprobs for lp in row)
