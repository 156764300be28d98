"""The MoE policy's learner (master weights + optimizer): the train step in one of the four
modes, and the export of the quantized policy the rollout engines load.

Modes (docs/design.md, "Training modes"; rl.types.MODES):
  bf16   rollout in high precision, trainer high precision: the no-quantization baseline
  fp4    FP4 rollout (W4A4 + FP4 KV), trainer high precision without QAT
  rtn    FP4 rollout, trainer vanilla QAT (its own round-to-nearest fake quant)
  trace  FP4 rollout with guidance + routing records, trainer rollout-guided QAT + routing replay

Precision and device: the master weights, their gradients and the AdamW state are fp32 on the
learner's device; the forward and backward run under autocast in `compute_dtype` (bf16 on
CUDA by default). Autocast rather than a bf16 copy of the weights: one set of parameters, no
copy to keep in sync after each optimizer step, fp32 gradient accumulation, and the matmuls
(where the time goes) still run on bf16 tensor cores. The FP4 sites compute their codes and
scales in fp32 whatever the input dtype, so guided rounding is the same on either path.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trace_common.device import pack_on_device, to_host
from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    QuantConfig,
    SampleRecords,
    export_quantized_state_dict,
    forward_logprobs,
    quantize_policy,
)
from trace_common.model.discrepancy import (
    code_flip_rate,
    d_act,
    logprob_discrepancy,
    rollout_reference,
    routing_mismatch,
)
from trace_common.model.train_forward import TrainForwardOutput, pad_right
from trace_common.rl.objective import DEFAULT_CLIP_EPS, DEFAULT_TIS_CAP, clipped_policy_loss
from trace_common.rl.types import MODES, ModeSpec, TrainSample, mode_spec
from trace_common.rollout.meta import PolicyMeta

COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
# Optimizer param-group keys that pick an implementation for this device, not a training
# hyperparameter: a checkpoint written elsewhere must not carry them over.
OPTIM_IMPL_KEYS = ("fused", "foreach", "capturable")


@dataclass(kw_only=True, slots=True)
class LearnerConfig:
    """The train step's knobs."""

    mode: str = "trace"
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    minibatches: int = 2  # optimizer steps per RL step (each on a slice of the batch)
    clip_eps: float = DEFAULT_CLIP_EPS  # PPO ratio clip
    tis_cap: float = DEFAULT_TIS_CAP  # truncated importance-sampling weight cap
    routing_replay: bool = True  # trace mode: replay the rollout's expert choices
    temperature: float = 1.0  # the rollout's sampling temperature (log-probs are tempered)
    measure_records: bool = False  # non-trace FP4 modes: have the rollout record guidance too,
    # used only to measure D_act / flip rate, never to steer training
    compute_dtype: str = "auto"  # autocast dtype of forward/backward: auto = bfloat16 on CUDA,
    # float32 (no autocast) elsewhere; master weights and optimizer state stay fp32 either way
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward
    # instead of keeping its activations (less memory, about one more forward of time)

    def __post_init__(self) -> None:
        mode_spec(self.mode)  # ValueError for an unknown mode
        if self.minibatches < 1:
            raise ValueError(f"minibatches must be >= 1, got {self.minibatches}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"unknown compute_dtype {self.compute_dtype!r}; expected one of {COMPUTE_DTYPES}"
            )

    @property
    def spec(self) -> ModeSpec:
        return MODES[self.mode]

    def autocast_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype on `device`, or None for plain fp32."""
        return autocast_dtype_of(self.compute_dtype, device)


def autocast_dtype_of(compute_dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype a `compute_dtype` setting means on `device` (None: plain fp32)."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"unknown compute_dtype {compute_dtype!r}; expected one of {COMPUTE_DTYPES}"
        )
    if compute_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return torch.bfloat16 if compute_dtype == "bfloat16" else None


def compute_context(device: torch.device, dtype: torch.dtype | None) -> Any:
    """Autocast to `dtype` on `device`, or a no-op context when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def cast_hp_weight(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An exported tensor in `dtype` if it is a high-precision weight (fp32 `*.weight`), else
    as it is: FP4 codes, block scales and the fp32 per-tensor scale_2 keep their dtype."""
    return t.to(dtype) if t.dtype == torch.float32 and name.endswith(".weight") else t


class ModelLearner:
    """Master weights + AdamW on ``device``; ``train_step`` is one RL update,
    ``export_weights`` the quantized policy pushed to the replicas (on the CPU)."""

    export_on_device = False  # export_weights keeps the copies on the GPU (CUDA IPC offers)
    # The dtype export_weights gives the high-precision weights (None: fp32, as trained).
    # A CUDA rollout engine runs them in bf16, so a bf16 export serves it the same bits in
    # half the bytes, and a small step leaves most of them unchanged (cheap deltas).
    export_hp_dtype: torch.dtype | None = None

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
    ) -> None:
        self.device = torch.device(device)
        model = model.to(device=self.device, dtype=torch.float32)  # fp32 master weights
        model.activation_checkpointing = config.activation_checkpointing
        self.model = self._place(model)
        self.config = config
        self.autocast_dtype = config.autocast_dtype(self.device)
        spec = config.spec  # bf16: everything high precision, on both sides
        self.quant = quant if spec.fp4_policy else QuantConfig.none()
        self.guidance = guidance if spec.wants_records(config.measure_records) else None
        self.eos_id = eos_id
        self.pad_id = pad_id
        # Fused AdamW on CUDA: one kernel over all parameters instead of a launch per tensor.
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=config.lr,
            weight_decay=config.weight_decay,
            fused=True if self.device.type == "cuda" else None,
        )
        self._quantize_master()

    def _place(self, model: MoECausalLM) -> MoECausalLM:
        """The model as this learner trains it (here: as it is; a sharded learner shards it)."""
        return model

    def _quantize_master(self) -> None:
        """Quantize the master weights for the first forward."""
        quantize_policy(self.model, self.quant)

    def compute(self) -> Any:
        """The forward/backward precision: autocast to `autocast_dtype` when it is set."""
        return compute_context(self.device, self.autocast_dtype)

    # ------------------------------------------------------------------ weights

    def export_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Quantize the master weights once and export them (ModelOpt layout + HP tensors):
        copies on the host, or with `export_on_device` packed into one new buffer on this
        learner's GPU (trace_common/clients/cuda_ipc.py: what a CUDA IPC offer shares)."""
        quantize_policy(self.model, self.quant)
        tensors, meta = export_quantized_state_dict(self.model)
        if self.export_hp_dtype is not None:
            tensors = {k: cast_hp_weight(k, t, self.export_hp_dtype) for k, t in tensors.items()}
        if self.device.type != "cpu":  # copies: training goes on while they are pushed
            tensors = pack_on_device(tensors) if self.export_on_device else to_host(tensors)
        meta = dict(meta)
        meta.update(
            PolicyMeta(guidance=self.guidance, eos_id=self.eos_id, pad_id=self.pad_id).to_metadata()
        )
        return tensors, meta

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.model.state_dict(), self.optimizer.state_dict()

    def load_state(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        """Load a checkpoint's state, wherever it was written: tensors are copied onto this
        learner's device, and the optimizer keeps this device's implementation (fused on
        CUDA) instead of the one recorded in the checkpoint."""
        self.model.load_state_dict(model_state)
        saved = optim_state.get("param_groups", [])
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved)} parameter groups, this learner "
                f"{len(self.optimizer.param_groups)}"
            )
        groups = [
            {**g, **{k: ours[k] for k in OPTIM_IMPL_KEYS if k in ours}}
            for g, ours in zip(saved, self.optimizer.param_groups, strict=True)
        ]
        self.optimizer.load_state_dict({**optim_state, "param_groups": groups})
        quantize_policy(self.model, self.quant)

    # ------------------------------------------------------------------ train

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One RL update on `samples`: a reference forward (the old log-probs and the
        discrepancy metrics), then `minibatches` optimizer steps, each on a slice."""
        order = torch.arange(len(samples))
        chunks = [mb.tolist() for mb in order.chunk(min(self.config.minibatches, len(samples)))]
        return self._train(samples, chunks)

    # A sharded learner (trace_common.rl.distributed) trains a slice of each minibatch per
    # rank; these three are where its ranks meet. One process: identities.
    world_size = 1

    def _sum_across_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks that train one batch (here just this one)."""
        return x

    def _reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The batch's metrics from this rank's (here: the whole batch's)."""
        return metrics

    def _train(self, samples: Sequence[TrainSample], chunks: list[list[int]]) -> dict[str, float]:
        """Train on `samples` (this rank's), minibatch i being `samples[chunks[i]]`; every
        minibatch's loss is a token mean over the whole minibatch, across ranks."""
        cfg = self.config
        spec = cfg.spec
        seqs = [
            list(ts.rollout.prompt_tokens) + list(ts.rollout.completion_tokens) for ts in samples
        ]
        t_start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        tokens, lengths = pad_right(seqs, self.pad_id)  # [B, T], [B]
        b, t = tokens.shape
        logp_rollout = torch.zeros(b, t - 1)
        comp_mask = torch.zeros(b, t - 1, dtype=torch.bool)
        for i, ts in enumerate(samples):
            p = len(ts.rollout.prompt_tokens)
            n = len(ts.rollout.completion_tokens)
            logp_rollout[i, p - 1 : p - 1 + n] = torch.tensor(ts.rollout.logprobs)
            comp_mask[i, p - 1 : p - 1 + n] = True
        adv = torch.tensor([ts.advantage for ts in samples])  # [B]
        dev = self.device
        tokens, lengths = tokens.to(dev), lengths.to(dev)
        logp_rollout, comp_mask, adv = logp_rollout.to(dev), comp_mask.to(dev), adv.to(dev)
        if spec.guided and any(ts.records is None and not ts.unguided for ts in samples):
            raise ValueError(
                f"{spec.name} mode needs every sample's records (or the sample unguided)"
            )
        measured = None  # records for the discrepancy metrics (any mode, when present)
        if all(ts.records is not None for ts in samples):
            measured = [SampleRecords.from_bytes(ts.records) for ts in samples]  # type: ignore[arg-type]
        records = None  # records that steer training
        unguided: list[int] = []  # guided: samples whose records were lost, trained rtn
        if spec.guided:
            unguided = [i for i, ts in enumerate(samples) if ts.records is None]
            records = measured or [
                None if ts.records is None else SampleRecords.from_bytes(ts.records)
                for ts in samples
            ]
        replay = spec.replays_routing and cfg.routing_replay
        kw = dict(qat_mode=spec.qat, routing_replay=replay, temperature=cfg.temperature)

        self.model.train()
        with torch.no_grad(), self.compute():
            ref = self._forward(tokens, lengths, records, unguided, collect=True, **kw)
        # The mismatch is measured on the fresh samples only (generated by the weights being
        # trained): a stale sample's gap includes the policy's drift since its version, which
        # is not a rollout/trainer mismatch. A step without fresh samples reports none.
        fresh = [i for i, ts in enumerate(samples) if ts.staleness == 0]
        metrics = (
            self._discrepancy(ref, logp_rollout, comp_mask, measured, fresh, lengths)
            if fresh
            else {}
        )
        stale = [i for i, ts in enumerate(samples) if ts.staleness > 0]
        metrics["fresh_fraction"] = len(fresh) / b
        if stale:
            st = logprob_discrepancy(ref.logprobs[stale], logp_rollout[stale], comp_mask[stale])
            metrics["logp_abs_diff_mean_stale"] = st.mean_abs
        logp_old = ref.logprobs.detach()

        losses, clip_fracs, tis_means = [], [], []
        for chunk in chunks:
            mb = torch.tensor(chunk, dtype=torch.long, device=dev)
            sub_records = [records[i] for i in chunk] if records is not None else None
            sub_unguided = [j for j, i in enumerate(chunk) if i in unguided]
            with self.compute():
                out = self._forward(tokens[mb], lengths[mb], sub_records, sub_unguided, **kw)
            res = clipped_policy_loss(
                out.logprobs,
                logp_old[mb],
                logp_rollout[mb],
                adv[mb],
                comp_mask[mb],
                clip_eps=cfg.clip_eps,
                tis_cap=cfg.tis_cap,
            )
            # This rank's share of the minibatch's tokens: the loss is a token mean over the
            # whole minibatch, and a sharded learner's gradients are averaged over ranks.
            n_here = comp_mask[mb].sum().float()
            share = n_here / self._sum_across_ranks(n_here.clone()).clamp_min(1.0)
            self.optimizer.zero_grad(set_to_none=True)
            (res.loss * (share * self.world_size)).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            parts = torch.stack(
                [res.loss.detach() * share, res.clip_frac * share, res.tis_mean * share]
            )
            loss, clip_frac, tis_mean = self._sum_across_ranks(parts).tolist()
            losses.append(loss)
            clip_fracs.append(clip_frac)
            tis_means.append(tis_mean)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor: the norm over every rank's shard
            grad_norm = grad_norm.full_tensor()
        metrics.update(
            loss=sum(losses) / len(losses),
            clip_frac=sum(clip_fracs) / len(clip_fracs),
            tis_mean=sum(tis_means) / len(tis_means),
            grad_norm=float(grad_norm),
        )
        metrics = self._reduce_metrics(metrics)
        n_tokens = int(self._sum_across_ranks((lengths - 1).sum()))
        seconds = time.perf_counter() - t_start  # float(loss) above synchronized the device
        metrics["train_tokens"] = n_tokens
        metrics["train_tokens_per_s"] = n_tokens / max(seconds, 1e-9)
        if dev.type == "cuda":
            metrics["train_peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
        return metrics

    def _forward(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        records: list[SampleRecords | None] | None,
        unguided: list[int],
        *,
        collect: bool = False,
        **kw: Any,
    ) -> Any:
        """``forward_logprobs`` of the batch; the rows in ``unguided`` (trace mode, records
        lost) run apart, with round-to-nearest QAT and the model's own routing. Such a batch
        reports log-probs only (no site values: its discrepancy is measured on log-probs)."""
        if not unguided:
            return forward_logprobs(
                self.model, tokens, lengths=lengths, records=records, collect=collect, **kw
            )
        assert records is not None
        b, t = tokens.shape
        logprobs = torch.zeros(b, t - 1, device=tokens.device)  # [B, T-1], fp32 like the parts
        mask = torch.zeros(b, t - 1, dtype=torch.bool, device=tokens.device)
        u = torch.tensor(unguided, device=tokens.device)
        guided = [i for i in range(b) if i not in set(unguided)]
        parts = [(u, None, {**kw, "qat_mode": "rtn", "routing_replay": False})]
        if guided:
            g = torch.tensor(guided, device=tokens.device)
            parts.append((g, [records[i] for i in guided], kw))
        for rows, part_records, part_kw in parts:
            out = forward_logprobs(
                self.model, tokens[rows], lengths=lengths[rows], records=part_records, **part_kw
            )
            logprobs[rows] = out.logprobs
            mask[rows] = out.mask
        return TrainForwardOutput(logprobs=logprobs, mask=mask)

    def _discrepancy(
        self,
        ref: Any,
        logp_rollout: torch.Tensor,
        mask: torch.Tensor,
        records: list[SampleRecords] | None,
        idx: list[int],
        lengths: torch.Tensor,
    ) -> dict[str, float]:
        """Train-vs-rollout measures before the update, on the samples ``idx`` (the fresh
        ones: generated by the weights being trained)."""
        rows_per = (lengths - 1).tolist()
        starts = [sum(rows_per[:i]) for i in range(len(rows_per))]
        rows = torch.cat([torch.arange(starts[i], starts[i] + rows_per[i]) for i in idx])
        rows = rows.to(self.device)
        lp = logprob_discrepancy(ref.logprobs[idx], logp_rollout[idx], mask[idx])
        if records is not None:
            records = [records[i] for i in idx]
        out = {
            "logp_abs_diff_mean": lp.mean_abs,
            "logp_abs_diff_max": lp.max_abs,
            "k3_kl": lp.k3_kl,
            "exp_mean_abs_dlogp": lp.exp_mean_abs,
        }
        if not records:
            return out
        dacts, flips = [], []
        per_layer: dict[str, list[float]] = {}
        # Compact records hold 1 bit: the rollout's value is not recoverable, so only full
        # records are measured. Values are compared in the model's dtype (as the rollout used
        # them) and flips on E2M1 grid values, so a per-token scale difference (rtn) is D_act,
        # not a flipped code.
        full = {k for k, g in records[0].guidance.items() if g.mode == "full"}
        if full:
            # Values are compared in the dtype the next GEMM reads them in: the autocast dtype
            # when there is one (autocast casts the quantized activations to it), else the
            # master weights' (the rollout's values are cast to it as the rollout used them).
            dtype = self.autocast_dtype or next(self.model.parameters()).dtype
            roll_values, roll_codes = rollout_reference(records, dtype)
            train_values = {k: v[rows].to(dtype) for k, v in ref.site_values.items()}
            train_codes = {k: v[rows] for k, v in ref.site_codes.items()}
            for key in sorted(full & set(train_values) & set(train_codes)):
                dacts.append(d_act(train_values[key], roll_values[key].to(self.device)))
                flips.append(code_flip_rate(train_codes[key], roll_codes[key].to(self.device)))
                per_layer.setdefault(str(key[0]), []).append(dacts[-1])
        if dacts:
            out["d_act_mean"] = sum(dacts) / len(dacts)
            out["d_act_max"] = max(dacts)
            out["code_flip_rate"] = sum(flips) / len(flips)
            out["d_act_per_layer"] = {k: max(v) for k, v in per_layer.items()}  # type: ignore[assignment]
        if records[0].routing is not None and ref.own_routing:
            routed = torch.cat([r.routing for r in records]).to(self.device)  # [N, n_moe, k]
            mism = [
                routing_mismatch(ref.own_routing[layer][rows], routed[:, j])
                for j, layer in enumerate(records[0].moe_layers)
            ]
            out["routing_mismatch"] = sum(mism) / len(mism)
        return {
            k: (v if not isinstance(v, float) or math.isfinite(v) else float("nan"))
            for k, v in out.items()
        }
