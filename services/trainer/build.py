"""The trainer's components from its settings: the policy model (a named shape or a Hugging
Face checkpoint) and the learner (one process, or this rank's shard under torchrun). Rank 0
(`app.TrainerApp`) and the other ranks (`ranks.run_follower`) build theirs the same way.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any

import torch

from services.trainer.config import TrainerSettings
from trace_common.config import ConfigError, RunConfig
from trace_common.device import resolve_device
from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig
from trace_common.model.hf import load_native_state_dict
from trace_common.rl.core import RecordStore
from trace_common.rl.distributed import LeaderLearner, ShardedLearner, init_distributed
from trace_common.rl.policy import ModelLearner

log = logging.getLogger(__name__)


def build_model(run: RunConfig, vocab_size: int) -> MoECausalLM:
    """A named shape (vocab sized to the tokenizer) or a Hugging Face checkpoint directory."""
    if run.model.is_checkpoint():
        from trace_common.model import load_hf_checkpoint

        if not pathlib.Path(run.model.name).is_dir():
            raise ConfigError(f"model.name = {run.model.name!r}: no such checkpoint directory")

        model = load_hf_checkpoint(pathlib.Path(run.model.name))
        if vocab_size > model.cfg.vocab_size:
            raise ValueError(
                f"tokenizer {run.task.tokenizer!r} has {vocab_size} tokens but the checkpoint "
                f"{run.model.name!r} has vocab_size={model.cfg.vocab_size}"
            )
    else:
        model = MoECausalLM(run.model.config(vocab_size))
        model.init_weights(run.seed)
    if run.model.init_weights is not None:
        from safetensors.torch import load_file

        load_native_state_dict(
            model, load_file(run.model.init_weights), source=str(run.model.init_weights)
        )
    return model


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
        learner = ModelLearner(model, s.run.objective, device=device, **kw)
        learner.export_hp_dtype = export_hp_dtype(s, learner.device)
        return learner
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
    sharded.export_hp_dtype = export_hp_dtype(s, sharded.device)  # rank 0 holds the export
    log.info("rank joined", extra={"rank": env.rank, "world_size": env.world_size})
    return LeaderLearner(sharded) if env.rank == 0 else sharded


def export_hp_dtype(s: TrainerSettings, device: torch.device) -> torch.dtype | None:
    """TRACE_EXPORT_HP_DTYPE on `device`: the dtype of the exported high-precision weights
    (None: fp32, as trained). auto: bfloat16 on CUDA, where the rollout engines compute in
    it, float32 elsewhere."""
    hp = s.export_hp_dtype
    if hp == "auto":
        hp = "bfloat16" if device.type == "cuda" else "float32"
    return None if hp == "float32" else getattr(torch, hp)
