"""NVRTC compile (through CuPy) and launch on PyTorch's stream, shared by the CUDA C++ kernels
(`cuda_moe`, `cuda_attn`; sources in `cuda/`).

Importing this module needs neither CuPy nor a GPU: CuPy is imported on the first compile or
launch, and its absence raises ImportError naming the install command.
"""

from __future__ import annotations

import ctypes
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


_SMEM_ALLOWED: dict[tuple, int] = {}


def compiled_function(source: pathlib.Path, name: str, smem: int = 0, arch: str | None = None):
    """Kernel `name` (a template instance) of CUDA file `source`, compiled by NVRTC through
    CuPy and loaded now (never inside a graph capture); cached per (source, name). `smem`: its
    launches take that many bytes of dynamic shared memory: the kernel's limit is raised to it
    here (outside any capture), as a launch needs once static + dynamic pass 48 KB. `arch`
    (e.g. "sm_90a", which wgmma needs; CuPy compiles for the device's plain sm_XY): NVRTC is
    called directly with that target."""
    key = (source.name, name)
    fn = _MODULES.get(key)
    if fn is None:
        cp = require_cupy()
        t0 = time.perf_counter()
        if arch is None:
            mod = cp.RawModule(code=source.read_text(), name_expressions=[name],
                               options=("--std=c++17", f"-I{source.parent}"))  # fmt: skip
            fn = mod.get_function(name)
        else:
            fn = _compile_for_arch(cp, source, name, arch)
        fn.compile()
        COMPILE_SECONDS[key] = time.perf_counter() - t0
        _MODULES[key] = fn
    if smem > _SMEM_ALLOWED.get(key, 0):
        fn.max_dynamic_shared_size_bytes = smem  # type: ignore[attr-defined]
        _SMEM_ALLOWED[key] = smem
    return fn


_CUBIN_DIR: list[pathlib.Path] = []


def _compile_for_arch(cp: ModuleType, source: pathlib.Path, name: str, arch: str):
    """`name` of `source` compiled by NVRTC for `arch` into a cubin (kept in a directory of this
    process's) and loaded through CuPy; a compile error raises RuntimeError with NVRTC's log."""
    import tempfile

    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source.read_text(), source.name, [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, ["--std=c++17", f"-I{source.parent}", f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC -arch={arch}, {source.name}, {name}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc  # fmt: skip
        lowered = nvrtc.getLoweredName(prog, name)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if not _CUBIN_DIR:
        _CUBIN_DIR.append(pathlib.Path(tempfile.mkdtemp(prefix="trace-cubin-")))
    path = _CUBIN_DIR[0] / f"{source.stem}-{abs(hash(name)):x}-{arch}.cubin"
    path.write_bytes(cubin)
    return cp.RawModule(path=str(path)).get_function(lowered)


def sm_resources(device: torch.device | str) -> tuple[int, int, int, int]:
    """(SMs, shared memory bytes, registers, threads) per SM of CUDA `device`; for a CPU device
    an H200's (132, 228 KB, 65536, 2048), so launch plans can be built and tested on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return (132, 228 * 1024, 65536, 2048)
    p = torch.cuda.get_device_properties(device)
    return (p.multi_processor_count, getattr(p, "shared_memory_per_multiprocessor", 228 * 1024),
            getattr(p, "regs_per_multiprocessor", 65536),
            getattr(p, "max_threads_per_multi_processor", 2048))  # fmt: skip


def pointers(*ts: torch.Tensor | None) -> tuple:
    """Kernel arguments for tensors: each one's device address as uint64, 0 for None."""
    import numpy as np

    return tuple(np.uint64(0 if t is None else t.data_ptr()) for t in ts)


_STREAMS: dict[tuple[int, int | None], object] = {}  # (stream handle, device) -> CuPy stream


def launch_on_torch_stream(fn, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
                           device: torch.device, shared_mem: int = 0, pdl: bool = False,
                           cluster: int = 0) -> None:  # fmt: skip
    """Launch a CuPy kernel on PyTorch's current stream of `device` (so a CUDA graph that
    PyTorch is capturing records it), with `shared_mem` bytes of dynamic shared memory.
    `pdl`: as a programmatic dependent launch; `cluster` > 0: in thread-block clusters of that
    many CTAs along x (both through `launch_ex`)."""
    cp = require_cupy()
    stream = torch.cuda.current_stream(device)
    ptr = stream.cuda_stream
    if pdl or cluster:
        launch_ex(fn, grid, block, args, ptr, shared_mem, pdl=pdl, cluster=cluster)
        return
    key = (ptr, stream.device.index)  # the legacy default stream is handle 0 on every device
    s = _STREAMS.get(key)
    if s is None:
        # CuPy's wrapper of a stream it does not own, through the CUDA stream protocol (torch's
        # Stream.__cuda_stream__); it records the current device as the stream's
        with cp.cuda.Device(stream.device.index):
            s = _STREAMS[key] = cp.cuda.Stream.from_external(stream)
    with s:
        fn(grid, block, args, shared_mem=shared_mem)


# ---- programmatic dependent launch (PDL, sm_90+) ---------------------------------------------
# A kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start while
# the kernel before it on the stream still runs: as soon as every CTA of that one has executed
# `griddepcontrol.launch_dependents` (or exited). Until its own `griddepcontrol.wait`
# (fp4_common.cuh `pdl_wait`) returns -- the previous grid has completed and its writes are
# visible -- it may only read what no earlier kernel writes (the weights). Kernels launched
# normally still wait for everything before them. Stream capture keeps the programmatic edge
# (CUDA >= 12.3). CuPy's launch takes no launch attributes, so this calls the driver's
# cuLaunchKernelEx through ctypes (structures as in cuda.h, CUDA 12.0+).
# A kernel's weight prefetch then overlaps the previous kernel's tail; graph replay with PDL
# equals plain launches bit for bit (tests/unit/gpu/test_small_batch_gpu.py).
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
MAX_PORTABLE_CLUSTER = 8  # CTAs per cluster any sm_90 launch may ask for


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: id, pad to 8 bytes, a 64-byte value union (as 16 uints: the PDL flag is
    # the first, the cluster dimension x, y, z the first three)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint * 16)]  # fmt: skip


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]  # fmt: skip


_DRIVER: list = []
_CTYPE = {"uint64": ctypes.c_uint64, "int64": ctypes.c_int64, "int32": ctypes.c_int32,
          "uint32": ctypes.c_uint32, "float32": ctypes.c_float}  # fmt: skip


def _driver():
    if not _DRIVER:
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuLaunchKernelEx
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]  # fmt: skip
        _DRIVER.append(lib)
    return _DRIVER[0]


def pdl_enabled() -> bool:
    """Whether the small-batch kernels are launched as programmatic dependent launches by
    default: where the GPU has them (compute capability >= 9.0)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def cu_function(fn) -> int:
    """The CUfunction handle of a loaded CuPy RawKernel."""
    kernel = getattr(fn, "kernel", None)  # cupy.cuda.function.Function
    ptr = getattr(kernel, "ptr", None)
    if not ptr:
        raise RuntimeError(f"no CUfunction handle on {fn!r} (CuPy RawKernel.kernel.ptr)")
    return int(ptr)


def launch_ex(fn, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, stream: int,
              shared_mem: int = 0, *, pdl: bool = False, cluster: int = 0) -> None:  # fmt: skip
    """Launch CuPy kernel `fn` (compiled and loaded) on `stream` (a CUstream handle) through
    cuLaunchKernelEx, for the launch attributes CuPy's own launch cannot set: `pdl` the
    programmatic-stream-serialization attribute, `cluster` > 0 clusters of that many CTAs
    along x (dividing the grid's x, at most MAX_PORTABLE_CLUSTER). `args`: numpy scalars
    (pointers as uint64)."""
    if cluster and (cluster > MAX_PORTABLE_CLUSTER or grid[0] % cluster):
        raise ValueError(f"cluster={cluster}: needs 1..{MAX_PORTABLE_CLUSTER} CTAs dividing the "
                         f"grid's x ({grid[0]})")  # fmt: skip
    vals = []
    for a in args:
        ct = _CTYPE.get(getattr(getattr(a, "dtype", None), "name", ""))
        if ct is None:
            raise TypeError(f"launch_ex: kernel argument {a!r} is not a numpy scalar of "
                            f"{sorted(_CTYPE)}")  # fmt: skip
        vals.append(ct(a.item()))
    lib = _driver()
    params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
    attrs = (_LaunchAttribute * 2)()
    n = 0
    if pdl:
        attrs[n].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n].value[0] = 1
        n += 1
    if cluster:
        attrs[n].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[n].value[0], attrs[n].value[1], attrs[n].value[2] = cluster, 1, 1
        n += 1
    g = (*grid, 1, 1, 1)[:3]
    b = (*block, 1, 1, 1)[:3]
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem,
                        ctypes.c_void_p(stream), ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute)),
                        n)  # fmt: skip
    rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(cu_function(fn)), params, None)
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx (pdl={pdl}, cluster={cluster}) of "
                           f"{getattr(fn, 'name', fn)!r}: CUresult {rc} {name.value!r}, grid "
                           f"{grid}, block {block}, smem {shared_mem}")  # fmt: skip
