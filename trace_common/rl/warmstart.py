"""Supervised warm start: a short cross-entropy fit on (prompt, answer) pairs of the task so
that RL starts from a policy with signal (GRPO learns nothing from groups that are all wrong).

It stops early, on purpose, once greedy accuracy reaches ``target_accuracy``: the demo wants
RL to have room to improve on the warm start.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trace_common.model import (
    ModelConfig,
    MoECausalLM,
    QuantConfig,
    SamplingConfig,
    forward_logprobs,
    generate,
)
from trace_common.model.quant import quantize_policy
from trace_common.model.train_forward import pad_right
from trace_common.rl.policy import autocast_dtype_of, compute_context
from trace_common.tasks.prompts import PromptStream
from trace_common.tasks.tasks import exact_match_reward

log = logging.getLogger(__name__)

WARMSTART_SEED_OFFSET = 1_000_003  # warm-start problems come from a different stream than RL's


@dataclass(kw_only=True, slots=True)
class WarmStartConfig:
    """Supervised fit knobs."""

    max_steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    eval_every: int = 25
    eval_prompts: int = 64
    target_accuracy: float = 0.5  # stop once greedy accuracy reaches this (1.0: never early)
    seed: int = 0
    compute_dtype: str = "auto"  # autocast dtype (auto: bf16 on CUDA), as the learner's


@dataclass(kw_only=True, slots=True)
class WarmStartResult:
    steps: int
    accuracy: float
    loss: float


def initial_model(cfg: ModelConfig, seed: int) -> MoECausalLM:
    """A freshly initialized policy of shape `cfg`, high precision everywhere (no FP4 site:
    the warm start fits the master weights), on the CPU."""
    model = MoECausalLM(cfg).init_weights(seed)
    quantize_policy(model, QuantConfig.none())
    return model


@torch.no_grad()
def greedy_accuracy(model: MoECausalLM, stream: PromptStream, n: int, max_new_tokens: int) -> float:
    """Exact-match accuracy of greedy decoding on the first ``n`` problems of ``stream``."""
    tok = stream.tokenizer
    problems = [stream.encode(i, stream.problem(i)) for i in range(n)]
    out = generate(
        model,
        [list(p.token_ids) for p in problems],
        SamplingConfig(
            max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tok.eos_id,)
        ),
        record_routing=False,
        pad_token_id=tok.pad_id,
    )
    hits = [
        exact_match_reward(c, p.problem.answer, tok)
        for c, p in zip(out.tokens, problems, strict=True)
    ]
    return sum(hits) / len(hits)


def warm_start(
    model: MoECausalLM,
    stream: PromptStream,
    config: WarmStartConfig,
    *,
    max_new_tokens: int,
    progress: Callable[[int, float, float], None] | None = None,
) -> WarmStartResult:
    """Fit ``model`` (in place, high precision, on its own device) on answers of ``stream``'s
    task.

    ``progress(step, loss, accuracy)`` is called every step (accuracy is the last evaluated).
    Evaluation uses a held-out stream (different seed) so it measures generalization.
    """
    tok = stream.tokenizer
    train = PromptStream(stream.task, tok, seed=stream.seed + WARMSTART_SEED_OFFSET)
    held_out = PromptStream(stream.task, tok, seed=stream.seed + 2 * WARMSTART_SEED_OFFSET)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    dev = next(model.parameters()).device
    dtype = autocast_dtype_of(config.compute_dtype, dev)
    opt = torch.optim.AdamW(
        model.parameters(), lr=config.lr, fused=True if dev.type == "cuda" else None
    )
    acc, loss_v, step = 0.0, float("nan"), 0
    for step in range(1, config.max_steps + 1):
        batch = train.next_batch(config.batch_size)
        seqs = [[*p.token_ids, *tok.encode(p.problem.answer), tok.eos_id] for p in batch]
        tokens, lengths = pad_right(seqs, tok.pad_id)  # [B, T], [B]
        mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.bool)
        for i, p in enumerate(batch):
            mask[i, len(p.token_ids) - 1 : int(lengths[i]) - 1] = True  # answer + EOS targets
        model.train()
        with compute_context(dev, dtype):
            out = forward_logprobs(model, tokens, lengths=lengths, qat_mode="none")
        mask = mask.to(dev)
        loss = -(out.logprobs * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_v = float(loss.detach())
        if step % config.eval_every == 0 or step == config.max_steps:
            model.eval()
            acc = greedy_accuracy(model, held_out, config.eval_prompts, max_new_tokens)
            log.info("warm start step %d loss %.3f accuracy %.3f", step, loss_v, acc)
        if progress is not None:
            progress(step, loss_v, acc)
        if acc >= config.target_accuracy:
            break
    return WarmStartResult(steps=step, accuracy=acc, loss=loss_v)
