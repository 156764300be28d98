"""The PyTorch rollout engine: the policy's own model (`trace_common.model`) generating with
its FP4 sites, on any device. The reference for every other engine, and the engine for shapes
the CUDA kernels do not run."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    generate,
    load_quantized_state_dict,
)
from trace_common.rollout.meta import PolicyMeta
from trace_common.rollout.types import GeneratedSample, SamplingConfig


class NativeEngine:
    """Rollout engine on the plain-PyTorch model (FP4 per the model's QuantConfig)."""

    name = "native"

    def __init__(
        self,
        model: MoECausalLM,
        *,
        eos_id: int,
        pad_id: int,
        guidance: GuidanceConfig | None,
    ) -> None:
        self.model = model.eval()
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.guidance = guidance

    @classmethod
    def from_weights(
        cls,
        tensors: dict[str, torch.Tensor],
        metadata: dict[str, str],
        version: int = -1,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> NativeEngine:
        """Build from a pushed policy version: codes used as stored, never re-quantized.

        ``dtype`` is the engine's compute precision for everything that is not FP4 (a real
        rollout engine runs bf16 while the trainer keeps fp32 master weights). ``version`` is
        not needed: the holder that keeps this engine knows it."""
        del version
        meta = PolicyMeta.parse(metadata)
        model = load_quantized_state_dict(tensors, metadata, dtype=dtype).to(device)
        return cls(model, eos_id=meta.eos_id, pad_id=meta.pad_id, guidance=meta.guidance)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        *,
        with_records: bool,
    ) -> list[GeneratedSample]:
        flat = [list(p) for p in prompts for _ in range(group_size)]  # prompt-major
        sp = dataclasses.replace(sampling, stop_token_ids=(self.eos_id, *sampling.stop_token_ids))
        out = generate(
            self.model,
            flat,
            sp,
            guidance=self.guidance if with_records else None,
            record_routing=with_records,
            pad_token_id=self.pad_id,
        )
        samples = []
        for i in range(len(flat)):
            rec = out.records[i].to_bytes() if with_records and out.records else None
            samples.append(
                GeneratedSample(
                    prompt_index=i // group_size,
                    group_index=i % group_size,
                    completion_tokens=out.tokens[i],
                    logprobs=out.logprobs[i],
                    finish_reason=out.finish_reasons[i],  # type: ignore[arg-type]
                    records=rec,
                )
            )
        return samples
