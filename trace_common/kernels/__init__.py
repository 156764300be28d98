"""GPU fast path (Triton) for the FP4 rollout on Hopper: quantize + guidance capture, grouped
routed-expert matmuls with packed NVFP4 weights, an FP4 KV cache with decode attention, and a
CUDA-graph decode engine (served by the rollout's CUDA engine, `trace_common.rollout.cuda`;
benchmarked alone by `bench/rollout_gpu.py`).

Importing this package (and its API modules) needs no Triton and no GPU; the kernels are
imported on first use, and a missing Triton raises ImportError with the install command.
The plain-PyTorch reference in `trace_common.fp4` defines the numerics; every kernel here is
tested against it (tests/unit/gpu/, marked `gpu`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

torch_device_like = Any  # torch.device | str (torch is not imported here)

TRITON_INSTALL_HINT = "pip install 'triton>=3.2' (it ships with CUDA builds of PyTorch)"


def require_module(name: str, needed_by: str, hint: str) -> ModuleType:
    """Import and return module `name`, or raise ImportError saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"{needed_by} need {name}, which is not installed: {hint}") from exc


def require_triton() -> ModuleType:
    """Import and return `triton`, or raise ImportError saying how to install it."""
    return require_module("triton", "the TRACE GPU kernels", TRITON_INSTALL_HINT)


def env_choice(env: str, value: str | None, choices: tuple[str, ...], default: str) -> str:
    """A setting: `value`, else the environment variable `env`, else `default`; a value not
    in `choices` raises ValueError naming `env` and the value."""
    value = value or os.environ.get(env, default)
    if value not in choices:
        raise ValueError(f"{env}={value!r}; expected one of {choices}")
    return value


def env_parts(env: str, value: str | None, parts: tuple[str, ...], default: str) -> frozenset[str]:
    """A set of named parts: `value`, else $env, else `default`; "all", "none" or a comma
    list of `parts` (anything else raises ValueError naming `env` and the value)."""
    value = value or os.environ.get(env, default)
    if value == "all":
        return frozenset(parts)
    chosen = frozenset() if value == "none" else frozenset(
        p.strip() for p in value.split(",") if p.strip())  # fmt: skip
    if not chosen <= set(parts):
        raise ValueError(f"{env}={value!r}; expected all, none or a comma list of {parts}")
    return chosen


def cupy_available() -> bool:
    """Whether CuPy (which compiles and launches the CUDA C++ kernels) is importable."""
    return importlib.util.find_spec("cupy") is not None


# How FP4 codes are decoded in the GEMM/attention kernels: "ptx" (int32 words, inline PTX,
# ~3 instructions per element; CUDA only) or "bits" (uint8 codes, plain Triton integer ops;
# also runs under TRITON_INTERPRET=1). Override with TRACE_FP4_DECODE.
FP4_DECODE_MODES = ("ptx", "bits")


def fp4_decode_words(device: torch_device_like, mode: str | None = None) -> bool:
    """True when the FP4 kernels should read codes as int32 words (the "ptx" decode)."""
    mode = env_choice("TRACE_FP4_DECODE", mode, FP4_DECODE_MODES, "ptx")
    on_cuda = str(device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1"
    return mode == "ptx" and on_cuda


# Which FP4 expert GEMM runs: "cuda" (the CUDA C++ mma.sync kernel,
# trace_common/kernels/cuda/moe_fp4.cu, compiled through CuPy; the default where CuPy is
# installed: faster at every measured size, docs/benchmarks.md) or "triton". Override with
# TRACE_FP4_GEMM.
FP4_GEMM_IMPLS = ("cuda", "triton")
DEFAULT_FP4_GEMM = "cuda"


def _cuda_or_triton(impl: str | None, env: str, default: str) -> str:
    """`impl`, else $env, else `default` where CuPy is importable and "triton" where not."""
    if impl is None and env not in os.environ:
        return default if cupy_available() else "triton"
    return env_choice(env, impl, FP4_GEMM_IMPLS, default)


def fp4_gemm_impl(impl: str | None = None) -> str:
    """The FP4 expert GEMM implementation to use: `impl`, else TRACE_FP4_GEMM, else "cuda"
    where CuPy is importable and "triton" where it is not."""
    return _cuda_or_triton(impl, "TRACE_FP4_GEMM", DEFAULT_FP4_GEMM)


# Which FP4 decode attention runs: "cuda" (trace_common/kernels/cuda/attn_fp4.cu through CuPy;
# the default where CuPy is installed: faster at every measured size, docs/benchmarks.md) or
# "triton". Override with TRACE_FP4_ATTN. Shapes the CUDA kernel does not handle use Triton.
DEFAULT_FP4_ATTN = "cuda"


def fp4_attn_impl(impl: str | None = None) -> str:
    """The FP4 decode attention to use: `impl`, else TRACE_FP4_ATTN, else "cuda" where CuPy is
    importable and "triton" where it is not."""
    return _cuda_or_triton(impl, "TRACE_FP4_ATTN", DEFAULT_FP4_ATTN)


def load_kernels(name: str) -> ModuleType:
    """Import the Triton kernel module `trace_common.kernels.<name>` (needs Triton)."""
    require_triton()
    return importlib.import_module(f"trace_common.kernels.{name}")


__all__ = [
    "DEFAULT_FP4_ATTN",
    "DEFAULT_FP4_GEMM",
    "FP4_DECODE_MODES",
    "FP4_GEMM_IMPLS",
    "TRITON_INSTALL_HINT",
    "cupy_available",
    "env_choice",
    "env_parts",
    "fp4_attn_impl",
    "fp4_decode_words",
    "fp4_gemm_impl",
    "load_kernels",
    "require_module",
    "require_triton",
]
