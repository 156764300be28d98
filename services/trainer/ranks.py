"""The trainer as N ranks under torchrun: rank 0 is the trainer service (RL loop, gRPC, HTTP),
ranks 1..N-1 hold their shards of the learner and run what rank 0 orders
(`trace_common.rl.distributed`). Started without torchrun the trainer is one process, as
before. Each rank pulls the records of the samples it trains from quant-cache itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from services.trainer.config import TrainerSettings
from trace_common.device import resolve_device
from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig
from trace_common.rl.core import RecordStore
from trace_common.rl.distributed import (
    LeaderLearner,
    ShardedLearner,
    follow,
    init_distributed,
)
from trace_common.rl.policy import ModelLearner

log = logging.getLogger(__name__)


def under_torchrun() -> bool:
    """Started by torchrun (RANK and WORLD_SIZE set): the learner is sharded, even at world
    size 1 (FSDP2's code path; it resumes a sharded checkpoint written at any rank count)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def build_learner(
    s: TrainerSettings,
    model: MoECausalLM,
    *,
    quant: QuantConfig,
    guidance: GuidanceConfig,
    eos_id: int,
    pad_id: int,
    records: RecordStore,
) -> ModelLearner | LeaderLearner | ShardedLearner:
    """Without torchrun: a ModelLearner on TRACE_DEVICE. Under torchrun (any WORLD_SIZE):
    join the process group (NCCL, one GPU per rank by LOCAL_RANK; gloo on the CPU) and
    shard; rank 0 gets the LeaderLearner that TrainerCore drives, the others their
    ShardedLearner."""
    device = resolve_device(s.device)
    kw: dict[str, Any] = dict(quant=quant, guidance=guidance, eos_id=eos_id, pad_id=pad_id)
    if not under_torchrun():
        return ModelLearner(model, s.run.objective, device=device, **kw)
    if s.run.stores.lost_records == "unguided":
        # an unguided group runs its own forward pass, on the ranks that train it only: the
        # ranks' FSDP collectives would no longer pair up
        raise ValueError(
            "stores.lost_records = 'unguided' is not supported under torchrun (a sharded "
            "learner); use 'regenerate' or 'drop'"
        )
    if s.run.checkpoint.export:
        raise ValueError(
            "checkpoint.export is not supported under torchrun (the export reads a "
            "single-file checkpoint; a sharded trainer writes torch.distributed.checkpoint)"
        )
    env, device = init_distributed(torch.device(device).type)
    sharded = ShardedLearner(
        model, s.run.objective, device=device, records=records, run_id=s.run.run_id, **kw
    )
    log.info("rank joined", extra={"rank": env.rank, "world_size": env.world_size})
    return LeaderLearner(sharded) if env.rank == 0 else sharded


def run_follower(s: TrainerSettings) -> None:
    """Ranks 1..N-1: build the same model and learner as rank 0, then follow its orders."""
    from services.trainer.app import build_model
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
