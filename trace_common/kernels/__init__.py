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


def triton_available() -> bool:
    """Whether Triton is importable (the GPU kernels' compiler)."""
    return importlib.util.find_spec("triton") is not None


def cupy_available() -> bool:
    """Whether CuPy (which compiles and launches the CUDA C++ kernels) is importable."""
    return importlib.util.find_spec("cupy") is not None


# How FP4 codes are decoded in the Triton GEMM/attention kernels: "ptx" (int32 words, inline
# PTX, ~3 instructions per element; CUDA only) or "bits" (uint8 codes, plain Triton integer ops;
# the one that also runs under TRITON_INTERPRET=1).
FP4_DECODE_MODES = ("ptx", "bits")


def fp4_decode_words(device: torch_device_like, mode: str | None = None) -> bool:
    """True when the Triton FP4 kernels read codes as int32 words (the "ptx" decode): on CUDA
    outside the Triton interpreter, unless `mode` is "bits"."""
    mode = _choice("decode", mode or "ptx", FP4_DECODE_MODES)
    on_cuda = str(device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1"
    return mode == "ptx" and on_cuda


# The FP4 expert GEMM and the FP4 decode attention: "cuda" (the CUDA C++ kernels in
# trace_common/kernels/cuda/, compiled through CuPy) where CuPy is installed, "triton" where it
# is not. The attention also uses Triton for shapes its CUDA kernel does not handle.
FP4_GEMM_IMPLS = ("cuda", "triton")


def _choice(what: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{what}={value!r}; expected one of {choices}")
    return value


def fp4_gemm_impl(impl: str | None = None) -> str:
    """The FP4 expert GEMM implementation: `impl`, else "cuda" where CuPy is importable and
    "triton" where it is not."""
    return _choice("impl", impl or ("cuda" if cupy_available() else "triton"), FP4_GEMM_IMPLS)


def fp4_attn_impl(impl: str | None = None) -> str:
    """The FP4 decode attention: `impl`, else "cuda" where CuPy is importable and "triton" where
    it is not."""
    return _choice("impl", impl or ("cuda" if cupy_available() else "triton"), FP4_GEMM_IMPLS)


def load_kernels(name: str) -> ModuleType:
    """Import the Triton kernel module `trace_common.kernels.<name>` (needs Triton)."""
    require_triton()
    return importlib.import_module(f"trace_common.kernels.{name}")


__all__ = [
    "FP4_DECODE_MODES",
    "FP4_GEMM_IMPLS",
    "TRITON_INSTALL_HINT",
    "cupy_available",
    "fp4_attn_impl",
    "fp4_decode_words",
    "fp4_gemm_impl",
    "load_kernels",
    "require_module",
    "require_triton",
    "triton_available",
]
