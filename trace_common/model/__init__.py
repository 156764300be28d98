"""The MoE policy both sides of TRACE run (docs/design.md, "FP4 formats" to "Routing replay").

Public API:
  config:        ModelConfig, get_config(name), QuantConfig, GuidanceConfig
  model:         MoECausalLM
  hf:            load_hf_checkpoint(path, expected=...)
  quant:         quantize_policy(model, quant), export_quantized_state_dict(model),
                 load_quantized_state_dict(tensors, metadata)
  generate:      generate(model, prompts, SamplingConfig, guidance=..., record_routing=...)
  train_forward: forward_logprobs(model, tokens, qat_mode=..., records=..., routing_replay=...)
  records:       SampleRecords (to_bytes/from_bytes: the quant-cache blob)
  export:        save_hf_checkpoint, save_nvfp4_checkpoint (ModelOpt NVFP4 directory),
                 load_nvfp4_checkpoint, calibrate_act_amax (docs/export.md)
  discrepancy:   d_act, code_flip_rate, logprob_discrepancy, routing_mismatch
"""

from __future__ import annotations

from trace_common.model.config import (
    GuidanceConfig,
    ModelConfig,
    QuantConfig,
    get_config,
)
from trace_common.model.generate import GenerateOutput, SamplingConfig, generate
from trace_common.model.hf import load_hf_checkpoint
from trace_common.model.model import MoECausalLM
from trace_common.model.quant import (
    export_quantized_state_dict,
    load_quantized_state_dict,
    quantize_policy,
)
from trace_common.model.records import SampleRecords
from trace_common.model.train_forward import TrainForwardOutput, forward_logprobs

__all__ = [
    "GenerateOutput",
    "GuidanceConfig",
    "MoECausalLM",
    "ModelConfig",
    "QuantConfig",
    "SampleRecords",
    "SamplingConfig",
    "TrainForwardOutput",
    "export_quantized_state_dict",
    "forward_logprobs",
    "generate",
    "get_config",
    "load_hf_checkpoint",
    "load_quantized_state_dict",
    "quantize_policy",
]
