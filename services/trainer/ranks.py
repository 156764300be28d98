"""The trainer as N ranks under torchrun: rank 0 is the trainer service (RL loop, gRPC, HTTP),
ranks 1..N-1 hold their shards of the learner and run what rank 0 orders
(`trace_common.rl.distributed`). Started without torchrun the trainer is one process. Each rank pulls the records of the samples it trains from quant-cache itself.
"""

from __future__ import annotations

import logging

import torch

from services.trainer.build import build_learner, build_model
from services.trainer.config import TrainerSettings
from trace_common.rl.distributed import ShardedLearner, follow

log = logging.getLogger(__name__)


def run_follower(s: TrainerSettings) -> None:
    """Ranks 1..N-1: build the same model and learner as rank 0, then follow its orders."""
    from services.trainer.remote import QuantCacheRecords
    from trace_common.clients import QuantCacheClient
    from trace_common.data.recipe import resolve_run_paths
    from trace_common.service import Backoff
    from trace_common.tasks import load_tokenizer

    torch.set_num_threads(s.torch_threads)
    run = resolve_run_paths(s.run, s.data_root)
    torch.manual_seed(run.seed)
    tok = load_tokenizer(run.task.tokenizer)
    model = build_model(run, tok.vocab_size)
    quant = run.quant.build(model.cfg)
    guidance = run.guidance.build(model.cfg.num_layers)
    guidance.resolve(model.cfg, quant)
    client = QuantCacheClient(s.quant_cache_address, s.token(), data_path=s.quant_cache_data_path)
    records = QuantCacheRecords(client, None, Backoff(budget_s=run.stores.retry_seconds))
    learner = build_learner(
        s, model, quant=quant, guidance=guidance, eos_id=tok.eos_id, pad_id=tok.pad_id,
        records=records,
    )  # fmt: skip
    assert isinstance(learner, ShardedLearner)
    steps = follow(learner)
    log.info("follower done", extra={"steps": steps})
