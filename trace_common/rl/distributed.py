"""The learner as N ranks: FSDP2 (`fully_shard`) over the decoder layers, each rank training a
slice of every minibatch, and the FP4 export streamed one gathered layer at a time.

Launch: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT;
`init_distributed` reads them (NCCL on CUDA, gloo on the CPU). Every rank builds the same
model, `ShardedLearner` shards it, and all ranks call `train_step` with the same sample list
(rank 0 broadcasts it, see `broadcast_samples`): rank r trains `rank_chunks(...)[r]`, a
contiguous slice of each minibatch, and pulls the records of those samples itself. Before
the step rank 0 asks (`check_records`): the ranks pull their slices then, keep them for the
step, and report the groups some rank lacks, which rank 0 regenerates as one process does.

Numerics: the minibatch loss is a token mean over the whole minibatch, so each rank weights
its loss by its share of the minibatch's tokens (times the world size, since FSDP2 averages
gradients over ranks): the gradients, the loss and the weights match one process's up to
float summation order. Mixed precision on CUDA: parameters all-gathered and computed in bf16
(`MixedPrecisionPolicy(param_dtype=bf16)`, with the learner's autocast as on one GPU),
gradients reduce-scattered in fp32 into fp32 master shards, AdamW on the fp32 shards. On
the CPU (gloo) everything is fp32.

Export (`export_weights`): for each decoder layer in turn, every rank all-gathers that layer's
parameters (`FSDPModule.unshard`), quantizes it (each rank needs the layer's dequantized codes
for its QAT forward), rank 0 copies the layer's FP4 codes, scales and high-precision tensors
to the CPU, and the layer is resharded; then the root's own parameters (embedding, final norm,
LM head) the same way. At no point does a device hold more than one layer's full parameters
beyond its shard; rank 0's host memory receives the FP4 payload (what weight-sync gets anyway).
The bits are those of the single-process export: same weights, same quantization code.

The dequantized FP4 weights the QAT forward multiplies with exist only while their unit
runs (`_dequant_per_forward`): FSDP2 shards parameters, not buffers, so keeping them would put
a full master-dtype copy of the model on every rank. What every rank does keep whole is the
FP4 codes and scales (about 0.56 bytes per parameter with NVFP4); sharding those too is the
next step for the largest models.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    QuantConfig,
    export_quantized_state_dict,
    quantize_policy,
)
from trace_common.model.model import FP4Weights
from trace_common.rl.checkpoint import STATE_FILE, capture_rng, read_state, restore_rng
from trace_common.rl.core import RecordStore, expected_generations
from trace_common.rl.policy import OPTIM_IMPL_KEYS, LearnerConfig, ModelLearner, cast_hp_weight
from trace_common.rl.types import TrainSample
from trace_common.rollout.meta import PolicyMeta

# Not the single-process CHECKPOINT_FORMAT (an int): each loader names the other in its error.
SHARDED_FORMAT = "dcp-1"  # bump when the sharded checkpoint layout changes
SHARDED_LATEST_FILE = "latest"
_GLOBAL_KEYS = ("loss", "clip_frac", "tis_mean", "grad_norm")  # already reduced in _train


@dataclass(frozen=True, slots=True)
class DistEnv:
    """Where this process stands in the job (torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> DistEnv:
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except KeyError as e:
            raise ValueError(f"{e.args[0]} is not set: launch the ranks with torchrun") from e
        local = int(os.environ.get("LOCAL_RANK", rank))
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return cls(rank=rank, world_size=world, local_rank=local)


def init_distributed(device_type: str, timeout_s: float = 600.0) -> tuple[DistEnv, torch.device]:
    """Join the process group from torchrun's environment: NCCL with one GPU per rank
    (LOCAL_RANK) on CUDA, gloo on the CPU. Returns (env, this rank's device)."""
    env = DistEnv.from_env()
    if device_type == "cuda":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device_type == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return env, device


def shard_model(model: MoECausalLM, device: torch.device) -> MoECausalLM:
    """`fully_shard` each decoder layer, then the root (embedding, final norm, LM head).

    One FSDP unit per decoder layer: its parameters are gathered just before its forward and
    freed after (again in the backward), the unit of prefetch and of the streamed export.
    Expert parallelism would add a second mesh dimension here (docs/design.md).
    """
    mp = None
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def rank_chunks(n: int, minibatches: int, world_size: int) -> list[list[list[int]]]:
    """[rank][minibatch] -> sample indices: minibatch i is chunk i of `0..n-1` (as one process
    splits it), and rank r trains the r-th contiguous slice of it."""
    if n < 1:
        raise ValueError(f"no samples to train on (n={n})")
    order = torch.arange(n)
    mbs = order.chunk(min(minibatches, n))
    if any(len(mb) < world_size for mb in mbs):
        raise ValueError(
            f"{n} samples in {len(mbs)} minibatches leave some of the {world_size} ranks "
            "without a sample; train on more samples or fewer minibatches"
        )
    return [[mb.tensor_split(world_size)[r].tolist() for mb in mbs] for r in range(world_size)]


def broadcast_samples(samples: Sequence[TrainSample] | None, src: int = 0) -> list[TrainSample]:
    """Rank `src`'s sample list on every rank (without record blobs: each rank pulls its own)."""
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        if samples is None:
            raise ValueError("the source rank must pass the samples")
        payload = [[_without_records(ts) for ts in samples]]
    dist.broadcast_object_list(payload, src=src)
    return list(payload[0])


def _without_records(ts: TrainSample) -> TrainSample:
    return TrainSample(
        rollout=ts.rollout,
        reward=ts.reward,
        advantage=ts.advantage,
        staleness=ts.staleness,
        records=None,
    )


class ShardedLearner(ModelLearner):
    """`ModelLearner` over an FSDP2-sharded model; call every method on every rank."""

    def __init__(
        self,
        model: MoECausalLM,
        config: LearnerConfig,
        *,
        quant: QuantConfig,
        guidance: GuidanceConfig | None,
        eos_id: int,
        pad_id: int,
        device: torch.device | str = "cpu",
        records: RecordStore | None = None,
        run_id: str = "run",
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedLearner needs a process group: call init_distributed()")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.records = records  # where this rank pulls its samples' records (quant-cache)
        self._pulled: dict[str, bytes] = {}  # records check_records pulled for the next step
        self.run_id = run_id
        super().__init__(model, config, quant=quant, guidance=guidance, eos_id=eos_id,
                         pad_id=pad_id, device=device)  # fmt: skip

    def _place(self, model: MoECausalLM) -> MoECausalLM:
        return shard_model(model, self.device)

    def _quantize_master(self) -> None:
        self._dequant_per_forward()
        self._quantize_streamed(keep=False)

    # ------------------------------------------------------------------ collectives

    def _sum_across_ranks(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def _reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Discrepancy metrics are measured on each rank's samples: means are averaged over
        ranks, `*_max` and per-layer maxima take the maximum (loss, clip_frac, tis_mean and
        grad_norm are already the whole batch's)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, metrics)
        out = dict(metrics)
        for key, value in metrics.items():
            if key in _GLOBAL_KEYS:
                continue
            values = [g[key] for g in gathered if key in g]
            if isinstance(value, dict):
                out[key] = {k: max(v[k] for v in values if k in v) for k in value}
            elif key.endswith("_max"):
                out[key] = max(values)
            elif isinstance(value, (int, float)):
                out[key] = sum(values) / len(values)
        return out

    # ------------------------------------------------------------------ train

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One RL update; `samples` is the whole batch, the same list on every rank. This
        rank trains its slice of each minibatch and pulls those samples' records itself
        (when they are not attached and a record store was given). A group with a record
        missing on any rank is dropped whole on every rank (its advantages were normalized
        together) and the batch is split again: `samples_dropped_records` counts them."""
        samples, dropped = list(samples), 0
        try:
            while True:
                if not samples:
                    return {"samples_dropped_records": dropped}
                local, per_rank = self._local(samples)
                drop = self._lacking_anywhere(local)
                if not drop:
                    break
                kept = [ts for ts in samples if ts.rollout.prompt_id not in drop]
                dropped += len(samples) - len(kept)
                samples = kept
        finally:
            self._pulled.clear()
        chunks, start = [], 0
        for chunk in per_rank[self.rank]:
            chunks.append(list(range(start, start + len(chunk))))
            start += len(chunk)
        metrics = self._train(local, chunks)
        metrics["samples_dropped_records"] = dropped
        return metrics

    def check_records(self, samples: Sequence[TrainSample]) -> set[int]:
        """Before a train step: pull the records of this rank's slice of `samples` (kept for
        the step, so it fetches them once) and return the prompt ids of the groups whose
        record is missing on any rank, for rank 0 to regenerate or drop. Every rank calls it
        with the same list."""
        local, _ = self._local(list(samples))
        return self._lacking_anywhere(local)

    def _local(self, samples: list[TrainSample]) -> tuple[list[TrainSample], list[list[list[int]]]]:
        """This rank's samples of `samples` (its slice of each minibatch), and every rank's."""
        per_rank = rank_chunks(len(samples), self.config.minibatches, self.world_size)
        return [samples[i] for chunk in per_rank[self.rank] for i in chunk], per_rank

    def _lacking_anywhere(self, local: list[TrainSample]) -> set[int]:
        lacking: list[Any] = [None] * self.world_size
        dist.all_gather_object(lacking, self._pull_records(local))
        return set().union(*lacking)

    def _pull_records(self, local: list[TrainSample]) -> set[int]:
        """Attach the records of this rank's samples that lack them (pulled by
        `check_records` already, or one fetch per policy version); returns the prompt ids of
        groups whose record the store does not have."""
        todo = [ts for ts in local if ts.records is None]
        if self.records is None or not todo:
            return set()
        for ts in todo:
            ts.records = self._pulled.get(ts.rollout.sample_id)
        by_version: dict[int, list[TrainSample]] = {}
        for ts in todo:
            if ts.records is None:
                by_version.setdefault(ts.rollout.policy_version, []).append(ts)
        lacking = set()
        for version, group in sorted(by_version.items()):
            blobs = self.records.fetch(
                self.run_id,
                version,
                [ts.rollout.sample_id for ts in group],
                generations=expected_generations(group),
            )
            for ts in group:
                ts.records = blobs.get(ts.rollout.sample_id)
                if ts.records is None:
                    lacking.add(ts.rollout.prompt_id)
                else:
                    self._pulled[ts.rollout.sample_id] = ts.records
        return lacking

    # ------------------------------------------------------------------ weights

    def _layer_units(self) -> list[tuple[FSDPModule, Any]]:
        """(FSDP unit, which module names it owns): each decoder layer, then the root."""
        units: list[tuple[FSDPModule, Any]] = []
        for i, layer in enumerate(self.model.model.layers):
            prefix = f"model.layers.{i}"
            units.append((layer, lambda name, p=prefix: name == p or name.startswith(p + ".")))
        in_layers = "model.layers."
        units.append((self.model, lambda name: not name.startswith(in_layers)))  # type: ignore[arg-type]
        return units

    @torch.no_grad()
    def _quantize_streamed(self, *, keep: bool) -> dict[str, torch.Tensor]:
        """Quantize the policy one gathered FSDP unit at a time; with `keep`, rank 0 returns
        the export's tensors on the CPU (other ranks an empty dict)."""
        tensors: dict[str, torch.Tensor] = {}
        for unit, owns in self._layer_units():
            unit.unshard()
            try:
                quantize_policy(self.model, self.quant, only=owns)
                if keep and self.rank == 0:
                    part, _ = export_quantized_state_dict(self.model, only=owns)
                    hp = self.export_hp_dtype
                    tensors.update({k: (v if hp is None else cast_hp_weight(k, v, hp)).to("cpu")
                                    for k, v in part.items()})  # fmt: skip
            finally:
                _drop_dequant(self._fp4_of[id(unit)])  # rebuilt from the codes per forward
                unit.reshard()
        return tensors

    def _dequant_per_forward(self) -> None:
        """The dequantized FP4 weights the QAT forward multiplies with live only while their
        FSDP unit runs: built from the (replicated, FP4-sized) codes after the unit's
        parameters are gathered, dropped after its forward (activation checkpointing
        rebuilds them in its recompute). A full-size copy per rank would not be sharded:
        FSDP2 shards parameters, not buffers."""
        self._fp4_of: dict[int, list[FP4Weights]] = {}
        for unit, owns in self._layer_units():
            mods = [
                m
                for name, m in self.model.named_modules()
                if isinstance(m, FP4Weights) and owns(name)
            ]
            self._fp4_of[id(unit)] = mods
            # After FSDP's own pre-forward hook (registered first): the parameters are gathered.
            unit.register_forward_pre_hook(lambda _m, _a, mods=mods: _build_dequant(mods))
            unit.register_forward_hook(lambda _m, _a, _o, mods=mods: _drop_dequant(mods))

    def export_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The quantized policy, streamed layer by layer (module docstring). Rank 0 gets the
        tensors, the other ranks an empty dict; the metadata is the same everywhere."""
        tensors = self._quantize_streamed(keep=True)
        meta: dict[str, Any] = dict(_export_metadata(self.model))
        meta.update(
            PolicyMeta(guidance=self.guidance, eos_id=self.eos_id, pad_id=self.pad_id).to_metadata()
        )
        return tensors, meta

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights gathered on rank 0's CPU (tests, conversion; not the hot
        path): an empty dict on the other ranks."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.model, options=opts)
        # At world size 1 on the CPU these are the live parameters: copy, not alias.
        return {k: v.detach().clone() for k, v in full.items()}

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        raise NotImplementedError("a sharded learner checkpoints with save_sharded_checkpoint")

    def load_state(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        raise NotImplementedError("a sharded learner resumes with load_sharded_checkpoint")


class LeaderLearner:
    """Rank 0's face of a `ShardedLearner`, the `Learner` that TrainerCore drives: each call
    is broadcast to the other ranks (which run `follow`) and then run here, so all ranks
    enter the same collectives in the same order. Samples go out without record blobs: each
    rank pulls its own slice's records (`pulls_records`: TrainerCore then leaves them)."""

    def __init__(self, learner: ShardedLearner) -> None:
        if learner.rank != 0:
            raise ValueError(f"LeaderLearner runs on rank 0, this is rank {learner.rank}")
        self.learner = learner
        self.pulls_records = learner.records is not None
        self.device, self.world_size = learner.device, learner.world_size

    def _order(self, *command: Any) -> None:
        dist.broadcast_object_list([command], src=0)

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        samples = [_without_records(ts) if self.pulls_records else ts for ts in samples]
        self._order("train", samples)
        return self.learner.train_step(samples)

    def check_records(self, samples: Sequence[TrainSample]) -> set[int]:
        """The prompt ids of the groups whose record some rank lacks (`pulls_records`: the
        ranks pull their slices now and keep them for the train step)."""
        samples = [_without_records(ts) for ts in samples]
        self._order("check", samples)
        return self.learner.check_records(samples)

    def export_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        self._order("export")
        return self.learner.export_weights()

    def save(self, root: str | pathlib.Path, **state: Any) -> pathlib.Path:
        self._order("save", str(root), state)
        return save_sharded_checkpoint(root, self.learner, **state)

    def load(self, path: str | pathlib.Path) -> dict[str, Any]:
        self._order("load", str(path))
        return load_sharded_checkpoint(path, self.learner)

    def stop(self) -> None:
        """Release the followers (their `follow` returns)."""
        self._order("stop")


def follow(learner: ShardedLearner) -> int:
    """Ranks 1..N-1: run what rank 0's `LeaderLearner` orders until it says stop; returns
    the number of train steps run."""
    steps = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command, *args = box[0]
        if command == "train":
            learner.train_step(args[0])
            steps += 1
        elif command == "check":
            learner.check_records(args[0])
        elif command == "export":
            learner.export_weights()
        elif command == "save":
            save_sharded_checkpoint(args[0], learner, **args[1])
        elif command == "load":
            load_sharded_checkpoint(args[0], learner)
        elif command == "stop":
            return steps
        else:
            raise RuntimeError(f"unknown command from rank 0: {command!r}")


def _build_dequant(mods: list[FP4Weights]) -> None:
    for m in mods:
        m.refresh_dequant()


def _drop_dequant(mods: list[FP4Weights]) -> None:
    for m in mods:
        for name in m.fp4_weight_names:
            m.set_dequant(name, None)


def _export_metadata(model: MoECausalLM) -> dict[str, str]:
    """The export's metadata (model and quant configs, format version) without its tensors."""
    _, meta = export_quantized_state_dict(model, only=lambda _name: False)
    return meta


# ---------------------------------------------------------------------- checkpoints


def save_sharded_checkpoint(
    root: str | pathlib.Path,
    learner: ShardedLearner,
    *,
    step: int,
    version: int,
    prompt_state: dict[str, int] | None = None,
    extra: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write ``root/step-<step>`` with torch.distributed.checkpoint: every rank writes its
    own shards of the master weights and AdamW state (no gather), its RNG state, and rank 0
    the trainer state; written to a temp dir, renamed by rank 0 once all ranks are done, and
    ``root/latest`` names it. Call on every rank."""
    root = pathlib.Path(root)
    name = f"step-{step:06d}"
    final, tmp = root / name, root / f".{name}.tmp"
    if learner.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save(capture_rng(), tmp / f"rng-{learner.rank}.pt")
    if learner.rank == 0:
        state = {
            "format": SHARDED_FORMAT,
            "step": step,
            "version": version,
            "world_size": learner.world_size,
            "prompt_state": prompt_state or {},
            "extra": extra or {},
        }
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    dist.barrier()
    if learner.rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f".{SHARDED_LATEST_FILE}.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / SHARDED_LATEST_FILE)
    dist.barrier()
    return final


def load_sharded_checkpoint(path: str | pathlib.Path, learner: ShardedLearner) -> dict[str, Any]:
    """Resume `learner` from a checkpoint written at any world size (DCP reshards on load);
    returns the trainer state (step, version, prompt_state, extra, world_size). RNG: this
    rank's saved stream when the checkpoint has one, else rank 0's."""
    path = pathlib.Path(path)
    state = read_state(path, SHARDED_FORMAT, "a sharded checkpoint")
    model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(path / "dcp"))
    # Keep this device's optimizer implementation (fused on CUDA), not the writer's.
    for group, ours in zip(
        loaded["optim"]["param_groups"], learner.optimizer.param_groups, strict=True
    ):
        group.update({k: ours[k] for k in OPTIM_IMPL_KEYS if k in ours})
    set_state_dict(
        learner.model,
        learner.optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optim"],
    )
    rng = path / f"rng-{learner.rank}.pt"
    restore_rng(torch.load(rng if rng.is_file() else path / "rng-0.pt", weights_only=False))
    learner._quantize_streamed(keep=False)
    return state
