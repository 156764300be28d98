"""NVRTC compile (through CuPy) and launch on PyTorch's stream, shared by the CUDA C++ kernels
(`cuda_moe`, `cuda_attn`; sources in `cuda/`).

Importing this module needs neither CuPy nor a GPU: CuPy is imported on the first compile or
launch, and its absence raises ImportError naming the install command.
"""

from __future__ import annotations

import pathlib
import time
from types import ModuleType

import torch

CUPY_INSTALL_HINT = "pip install 'trace-rl[gpu]' (cupy-cuda13x; cupy-cuda12x for CUDA 12)"


def require_cupy() -> ModuleType:
    from trace_common.kernels import require_module

    return require_module("cupy", "the CUDA FP4 kernels' launches", CUPY_INSTALL_HINT)


_MODULES: dict[tuple, object] = {}
COMPILE_SECONDS: dict[tuple, float] = {}


def compiled_function(source: pathlib.Path, name: str):
    """Kernel `name` (a template instance) of CUDA file `source`, compiled by NVRTC through
    CuPy and loaded now (never inside a graph capture); cached per (source, name)."""
    key = (source.name, name)
    fn = _MODULES.get(key)
    if fn is None:
        cp = require_cupy()
        t0 = time.perf_counter()
        mod = cp.RawModule(code=source.read_text(), name_expressions=[name],
                           options=("--std=c++17", f"-I{source.parent}"))  # fmt: skip
        fn = mod.get_function(name)
        fn.compile()
        COMPILE_SECONDS[key] = time.perf_counter() - t0
        _MODULES[key] = fn
    return fn


_STREAMS: dict[int, object] = {}


def launch_on_torch_stream(fn, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
                           device: torch.device, shared_mem: int = 0) -> None:  # fmt: skip
    """Launch a CuPy kernel on PyTorch's current stream of `device` (so a CUDA graph that
    PyTorch is capturing records it), with `shared_mem` bytes of dynamic shared memory."""
    cp = require_cupy()
    ptr = torch.cuda.current_stream(device).cuda_stream
    s = _STREAMS.get(ptr)
    if s is None:
        s = _STREAMS[ptr] = cp.cuda.ExternalStream(ptr)
    with s:
        fn(grid, block, args, shared_mem=shared_mem)
