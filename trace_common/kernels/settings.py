"""Launch tuning of the CUDA decode kernels, the part a user may set.

The built-in launch shapes are tuned for the Qwen3-30B-A3B shape on an H200. Another GPU or
model shape may run faster with others: bench/experiments/small_batch_sweep.py searches the
small-batch kernels' shapes, `bench/experiments/rollout_gpu_kernels.py --cuda-sweep` the expert
GEMM's and `--attn-sweep` the FP4 attention's. Every choice of kernel per op and size class is fixed in
the kernel modules; these settings change launch shapes only (and with them, at most, the
order in which a GEMM's fp32 partial sums are added).

The engine applies its settings when it is built (`DecodeEngine(settings=...)`); they hold
for the whole process (the kernel modules keep them as module state), so engines of one
process share one `KernelSettings`.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True, frozen=True)
class KernelSettings:
    """Launch shapes of the CUDA decode kernels; the defaults are the built-in tables."""

    # Small-batch kernels (`cuda_small.configure`): warps per CTA of a call site ("qkv", "o",
    # "router", "lm_head", "gate_up"), "RING_STAGES", "RING_STAGE_CHUNKS", or
    # "<site>_stages" of "qkv", "router", "gate_up", "down"; positive integers.
    small_launch: dict[str, int] = field(default_factory=dict)
    # FP4 expert GEMM launch configurations, a JSON file {"K,block_m,gated": [numbers]}
    # (`cuda_moe.load_overrides`): 4 numbers run the mma kernel with them for that shape, 5 the
    # stream kernel, 3 the wg kernel. None: the built-in tables.
    expert_gemm_configs: pathlib.Path | None = None
    # CUDA FP4 attention launch configuration (`cuda_attn.kernel_name`), e.g. ("ring", 4, 4, 4):
    # warps per CTA, CTAs per SM, ring stages. None: cuda_attn.DEFAULT_CONFIG.
    attn_config: tuple | None = None

    def __post_init__(self) -> None:
        from trace_common.kernels import cuda_attn, cuda_small

        cuda_small.check_config(self.small_launch)
        if self.attn_config is not None:
            cuda_attn.kernel_name(tuple(self.attn_config))
        if (
            self.expert_gemm_configs is not None
            and not pathlib.Path(self.expert_gemm_configs).is_file()
        ):
            raise ValueError(f"expert_gemm_configs={str(self.expert_gemm_configs)!r}: no such file")

    def apply(self) -> None:
        """Make these the launch shapes of every kernel launched from now on."""
        from trace_common.kernels import cuda_attn, cuda_moe, cuda_small

        path = self.expert_gemm_configs
        cuda_moe.set_overrides({} if path is None else cuda_moe.load_overrides(path))
        cuda_small.configure(self.small_launch)
        cuda_attn.set_default_config(self.attn_config)


__all__ = ["KernelSettings"]
