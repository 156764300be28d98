"""Supervised warm start: a short cross-entropy fit on (prompt, answer) pairs of the task so
that RL starts from a policy with signal (GRPO learns nothing from groups that are all wrong).
On a dataset, the answer is the row's warm-start target (the recipe's dataset.target, e.g. a
worked solution), and accuracy is the run's reward of greedy completions.

It stops early, on purpose, once greedy accuracy reaches ``target_accuracy``: the demo wants
RL to have room to improve on the warm start.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
from trace_common.tasks.prompts import Prompt, PromptStream
from trace_common.tasks.tasks import Problem, completion_text, exact_match_reward

if TYPE_CHECKING:
    from trace_common.data.prompts import DatasetPrompts

# Score of one greedy completion: (problem, text before EOS or None when cut off) -> [0, 1].
GreedyScore = Callable[[Problem, "str | None"], float]

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
def greedy_accuracy(
    model: MoECausalLM, stream: PromptStream | DatasetPrompts, n: int, max_new_tokens: int,
    score: GreedyScore | None = None,
) -> float:  # fmt: skip
    """Mean score of greedy decoding on the first ``n`` prompts of ``stream`` (exact match
    with the answer unless `score` says otherwise)."""
    tok = stream.tokenizer
    problems: list[Prompt] = stream.with_seed(stream.seed).next_batch(n)
    out = generate(
        model,
        [list(p.token_ids) for p in problems],
        SamplingConfig(
            max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tok.eos_id,)
        ),
        record_routing=False,
        pad_token_id=tok.pad_id,
    )
    if score is None:
        hits = [
            exact_match_reward(c, p.problem.answer, tok)
            for c, p in zip(out.tokens, problems, strict=True)
        ]
    else:
        hits = [
            score(p.problem, completion_text(c, tok))
            for c, p in zip(out.tokens, problems, strict=True)
        ]
    return sum(hits) / len(hits)


def warm_start(
    model: MoECausalLM,
    stream: PromptStream | DatasetPrompts,
    config: WarmStartConfig,
    *,
    max_new_tokens: int,
    progress: Callable[[int, float, float], None] | None = None,
    held_out: PromptStream | DatasetPrompts | None = None,
    score: GreedyScore | None = None,
) -> WarmStartResult:
    """Fit ``model`` (in place, high precision, on its own device) on answers of ``stream``'s
    problems.

    ``progress(step, loss, accuracy)`` is called every step (accuracy is the last evaluated).
    Evaluation uses `held_out` (default: the stream under another seed) so it measures
    generalization; `score` scores a greedy completion (default: exact match).
    """
    tok = stream.tokenizer
    train = stream.with_seed(stream.seed + WARMSTART_SEED_OFFSET)
    if held_out is None:
        held_out = stream.with_seed(stream.seed + 2 * WARMSTART_SEED_OFFSET)
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
        if not all(p.problem.answer for p in batch):
            raise ValueError(
                "a warm start needs each problem's target text: set dataset.target to the "
                "column holding it"
            )
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
            acc = greedy_accuracy(model, held_out, config.eval_prompts, max_new_tokens, score)
            log.info("warm start step %d loss %.3f accuracy %.3f", step, loss_v, acc)
        if progress is not None:
            progress(step, loss_v, acc)
        if acc >= config.target_accuracy:
            break
    return WarmStartResult(steps=step, accuracy=acc, loss=loss_v)
