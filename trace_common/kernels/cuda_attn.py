"""CUDA C++ split-KV decode attention over the FP4 KV cache (mma.sync, Hopper).

`attn_fp4_ring` in `cuda/attn_fp4.cu` (a per-warp cp.async shared-memory ring, swapped MMAs;
launch shapes per `kernel_name`) reads the cache in the layout the append kernel writes
(`attention.KVCacheGPU`: NVFP4 codes + e4m3 block scales + per-token fp32 scale, contiguous)
and writes the same split partials as the Triton split kernel, so `attention.decode_attention`
combines them with the Triton reduce kernel. It handles head_dim 128 and 8 query
heads per kv head (the Qwen3-MoE shape); `supports` says whether a shape fits. Compiled by
NVRTC through CuPy on first use and launched on PyTorch's current stream (CUDA-graph safe).

Fused attention (`decode_attention` with a plan made `fused`): one launch
per layer, no reduce kernel: the CTA that finishes a (sequence, kv head) last combines its
splits (`cuda/attn_common.cuh`). For the FP4 cache that is the ring kernel compiled with FUSED;
for the BF16 cache `attn_bf16_fused` (`cuda/attn_small.cu`, registers, swapped MMAs, loads its
first tile's older tokens before `griddepcontrol.wait`). Both may be launched as programmatic
dependent launches (`pdl=True`). The engine runs them (`fused_enabled`) in the small-batch
step, and in the standard step for the BF16 cache from FUSED_BF16_MIN_CONTEXT tokens.

The ring kernel can also append the newest token to the FP4 cache itself (`kv_new` of
`decode_attn_split_cuda`, `attention.decode_attention`): the small-batch FP4 step's default
(`cuda_small` fuse part "kv_attn"), one quantize launch fewer per layer.

Importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

import torch

from trace_common.kernels import cupy_available
from trace_common.kernels.cuda_launch import compiled_function, launch_on_torch_stream, pointers

if TYPE_CHECKING:
    from trace_common.kernels.quant import CompactRecordBuffers

SOURCE = pathlib.Path(__file__).with_name("cuda") / "attn_fp4.cu"
SMALL_SOURCE = pathlib.Path(__file__).with_name("cuda") / "attn_small.cu"
HEAD_DIM = 128
GROUP = 8  # query heads per kv head
TILE = 16  # tokens per warp step
# Launch configuration ("ring", warps per CTA, CTAs per SM asked of the register allocator,
# shared-memory stages per warp) of `attn_fp4_ring`: ("ring", 4, 4, 4) fits 115 registers
# without spills (nvcc -Xptxas -v, sm_90a); bench/experiments/rollout_gpu_kernels.py
# --attention-only --attn-sweep times others. `KernelSettings.attn_config` replaces it (`set_default_config`).
DEFAULT_CONFIG: tuple = ("ring", 4, 4, 4)
_CONFIG: list[tuple] = [DEFAULT_CONFIG]  # the configuration in force


# The standard step's BF16 attention, fused (attn_bf16_fused) instead of split + reduce
# (Triton), from this context on: the saved reduce launch pays once the splits are long. The
# FP4 cache's fused ring kernel stays off in the standard step: there it is slower than split
# + reduce.
FUSED_BF16_MIN_CONTEXT = 8192
# attn_bf16_fused: warps per CTA at most (fewer when a split has fewer 16-token tiles), and
# CTAs per SM its 202 registers x 128 threads allow (nvcc -Xptxas -v, sm_90a, no spills); the
# plan sizes its splits for that many resident CTAs (attention.fused_chunk)
FUSED_BF16_MAX_WARPS = 4
FUSED_BF16_CTAS_PER_SM = 2


# The fused kernels' last CTA reads the splits' partials a batch of 8 at a time: cheap for a
# few splits, slower than the reduce kernel's (B x HQ programs) for many
# So split + reduce beyond this many splits at the context hint.
FUSED_MAX_SPLITS = 16
# ... and at least this many keys per split: fewer splits for the last CTA to combine where the
# wave rule would cut a short context finer.
FUSED_MIN_CHUNK = 128


def fused_enabled(*, small_batch: bool = True, fp4: bool = False, context: int = 0) -> bool:
    """Whether a step runs the fused (one-launch) attention: the small-batch step, and the
    standard step (`small_batch=False`) for a BF16 cache (`fp4` False) at `context` >=
    FUSED_BF16_MIN_CONTEXT tokens; both need CuPy."""
    standard = not fp4 and context >= FUSED_BF16_MIN_CONTEXT
    return (small_batch or standard) and cupy_available()


def kernel_name(config: tuple, fused: bool = False, append: bool = False) -> tuple[str, int]:
    """(template instance to compile, warps per CTA) of a launch configuration; `fused`: the
    ring kernel's one-launch variant (combine in the last CTA); `append`: the ring kernel that
    also appends the newest token to the cache (`decode_attn_split_cuda`'s kv_new)."""
    kind, *p = config
    if kind == "ring" and len(p) == 3 and p[2] >= 2:
        flags = f", {str(fused).lower()}, true" if append else (", true" if fused else "")
        return f"attn_fp4_ring<{p[0]}, {p[1]}, {p[2]}{flags}>", p[0]
    raise ValueError(f"CUDA FP4 attention config {config!r}: expected ('ring', warps, "
                     "CTAs per SM, stages >= 2)")  # fmt: skip


def parse_config(text: str) -> tuple:
    """A launch configuration from its comma-separated form ("ring,4,4,5"), checked by
    `kernel_name`; a bad one raises ValueError naming the text."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    try:
        config = (parts[0], *(int(x) for x in parts[1:]))
        kernel_name(config)
    except (IndexError, ValueError) as err:
        raise ValueError(f"attention launch config {text!r}: {err}") from None
    return config


def default_config() -> tuple:
    """The launch configuration used where none is given: DEFAULT_CONFIG, or the one
    `set_default_config` set."""
    return _CONFIG[0]


def set_default_config(config: tuple | None) -> None:
    """Use launch configuration `config` (checked by `kernel_name`; None: DEFAULT_CONFIG) where
    none is given from now on."""
    config = DEFAULT_CONFIG if config is None else tuple(config)
    kernel_name(config)
    _CONFIG[0] = config


def ring_ctas_per_sm(config: tuple | None = None) -> int:
    """CTAs per SM the ring kernel's config asks for."""
    config = config or default_config()
    kernel_name(config)
    return config[2]


def supports(q_heads: int, kv_heads: int, head_dim: int, chunk: int) -> bool:
    """Whether the CUDA kernel handles this attention shape and split size."""
    return head_dim == HEAD_DIM and q_heads == GROUP * kv_heads and chunk % TILE == 0


def decode_attn_split_cuda(
    q: torch.Tensor,  # bf16 [B, HQ, 128]
    codes: torch.Tensor,  # uint8 [2, B, HKV, S, 64]
    scales: torch.Tensor,  # uint8 [2, B, HKV, S, 8]
    row_scales: torch.Tensor,  # fp32 [2, B, S]
    lens: torch.Tensor,  # int32 [B]
    part_o: torch.Tensor,  # fp32 [B, HQ, NSPLIT, 128]
    part_ml: torch.Tensor,  # fp32 [B, HQ, NSPLIT, 2]
    *,
    chunk: int,
    qk_scale: float,  # head_dim ** -0.5 * log2(e)
    config: tuple | None = None,  # default: default_config()
    counters: torch.Tensor | None = None,  # int32 [B * HKV], zero: the fused variant
    out: torch.Tensor | None = None,  # bf16 [B, HQ * 128]: its output
    pdl: bool = False,
    kv_new: torch.Tensor | None = None,  # bf16 [2, B, HKV * 128]: append the newest token
    kv_capture: CompactRecordBuffers | None = None,  # with kv_new: its record, rows [2 B, ...]
) -> None:
    """Split kernel of FP4 decode attention: writes part_o / part_ml for splits of `chunk`
    tokens (splits starting at or past lens[b] are left untouched, as the reduce skips them).
    With `counters` and `out`: the fused variant, which also combines the
    splits into `out`; `pdl`: launched as a programmatic dependent launch. With `kv_new` (HKV <=
    its warps): the CTAs of the split holding position lens[b] - 1 first append
    that token's K/V rows there, as quant.kv_append_fp4(kv_new, ..., pos=lens - 1, kv_capture)
    bit for bit, instead of an append launch before."""
    import numpy as np

    b, hq, d = q.shape
    _, _, hkv, s, half = codes.shape
    nsplit = part_o.shape[2]
    if not supports(hq, hkv, d, chunk) or half * 2 != d:
        raise ValueError(f"CUDA FP4 attention needs head_dim {HEAD_DIM}, {GROUP} q heads per kv "
                         f"head, chunk % {TILE} == 0; got D={d}, HQ={hq}, HKV={hkv}, "
                         f"chunk={chunk}")  # fmt: skip
    if q.dtype != torch.bfloat16 or not q.is_contiguous() or lens.dtype != torch.int32:
        raise ValueError(f"q must be contiguous bf16 and lens int32; got {q.dtype}, {lens.dtype}")
    for name, t in (("codes", codes), ("scales", scales), ("row_scales", row_scales)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    fused = counters is not None
    if fused:
        _check_fused(counters, out, b, hq, hkv)
    config = config or default_config()
    name, warps = kernel_name(config, fused, kv_new is not None)
    if kv_new is not None:
        _check_append(kv_new, kv_capture, b, hkv, warps)
    fn = compiled_function(SOURCE, name)
    ptr = np.uint64
    args = (
        ptr(q.data_ptr()), ptr(codes.data_ptr()), ptr(scales.data_ptr()),
        ptr(row_scales.data_ptr()), ptr(lens.data_ptr()), ptr(part_o.data_ptr()),
        ptr(part_ml.data_ptr()), np.int32(b), np.int32(hkv), np.int32(s), np.int32(chunk),
        np.int32(nsplit), np.float32(qk_scale),
    )  # fmt: skip
    rec = kv_capture  # the FUSED and KVQ arguments (unused, null, when off)
    args += pointers(counters, out if fused else None, kv_new,
                     *((None,) * 3 if rec is None else (rec.mbits, rec.block_scales,
                                                        rec.row_scales)))  # fmt: skip
    launch_on_torch_stream(fn, (nsplit, hkv, b), (warps * 32,), args, q.device, pdl=pdl)


def append_supported(hkv: int, config: tuple | None = None) -> bool:
    """Whether the FP4 attention kernel of `config` (default: default_config()) can append the
    newest token itself: one warp per kv head at least."""
    config = config or default_config()
    return hkv <= config[1]


def _check_append(kv_new: torch.Tensor, rec: CompactRecordBuffers | None, b: int, hkv: int,
                  warps: int) -> None:  # fmt: skip
    if hkv > warps:
        raise ValueError(f"appending in the attention kernel needs a warp per kv head: "
                         f"HKV={hkv} > {warps} warps")  # fmt: skip
    width = hkv * HEAD_DIM
    if (kv_new.dtype != torch.bfloat16 or tuple(kv_new.shape) != (2, b, width)
            or not kv_new.is_contiguous()):  # fmt: skip
        raise ValueError(f"kv_new must be contiguous bf16 [2, {b}, {width}]; got {kv_new.dtype} "
                         f"{tuple(kv_new.shape)}")  # fmt: skip
    if rec is not None:
        rec.check(2 * b, width, "kv_capture")


def _check_fused(counters: torch.Tensor, out: torch.Tensor | None, b: int, hq: int,
                 hkv: int) -> None:  # fmt: skip
    if counters.dtype != torch.int32 or counters.numel() != b * hkv or not counters.is_contiguous():
        raise ValueError(f"counters must be contiguous int32 [{b * hkv}]; got {counters.dtype} "
                         f"{tuple(counters.shape)}")  # fmt: skip
    if (out is None or out.dtype != torch.bfloat16 or tuple(out.shape) != (b, hq * HEAD_DIM)
            or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"out must be contiguous bf16 [{b}, {hq * HEAD_DIM}]; got "
                         f"{None if out is None else (out.dtype, tuple(out.shape))}")  # fmt: skip


def fused_bf16_warps(chunk: int) -> int:
    """Warps per CTA of attn_bf16_fused for splits of `chunk` tokens (one per 16-token tile,
    at most FUSED_BF16_MAX_WARPS)."""
    return max(1, min(FUSED_BF16_MAX_WARPS, chunk // TILE))


def decode_attn_fused_bf16(
    q: torch.Tensor,  # bf16 [B, HQ, 128]
    values: torch.Tensor,  # bf16 [2, B, HKV, S, 128]
    lens: torch.Tensor,  # int32 [B], >= 1
    part_o: torch.Tensor,  # fp32 [B, HQ, NSPLIT, 128] scratch
    part_ml: torch.Tensor,  # fp32 [B, HQ, NSPLIT, 2] scratch
    counters: torch.Tensor,  # int32 [B * HKV], zero (zero again after the launch)
    out: torch.Tensor,  # bf16 [B, HQ * 128]
    *,
    chunk: int,
    qk_scale: float,  # head_dim ** -0.5 * log2(e)
    pdl: bool = False,
) -> None:
    """Decode attention over the BF16 cache in one launch (`cuda/attn_small.cu`): splits of
    `chunk` tokens, combined by the last CTA of each (sequence, kv head) into `out`. `pdl`: a
    programmatic dependent launch, which reads the older cache rows before it waits for the
    kernel before it (that kernel may write only position lens[b] - 1 and q)."""
    import numpy as np

    b, hq, d = q.shape
    _, _, hkv, s, dv = values.shape
    nsplit = part_o.shape[2]
    if not supports(hq, hkv, d, chunk) or dv != d:
        raise ValueError(f"fused BF16 attention needs head_dim {HEAD_DIM}, {GROUP} q heads per "
                         f"kv head, chunk % {TILE} == 0; got D={d}, HQ={hq}, HKV={hkv}, "
                         f"chunk={chunk}")  # fmt: skip
    if q.dtype != torch.bfloat16 or not q.is_contiguous() or lens.dtype != torch.int32:
        raise ValueError(f"q must be contiguous bf16 and lens int32; got {q.dtype}, {lens.dtype}")
    if values.dtype != torch.bfloat16 or not values.is_contiguous():
        raise ValueError(f"values must be contiguous bf16; got {values.dtype}")
    _check_fused(counters, out, b, hq, hkv)
    warps = fused_bf16_warps(chunk)
    fn = compiled_function(SMALL_SOURCE, f"attn_bf16_fused<{warps}>")
    args = (
        *pointers(q, values, lens, part_o, part_ml, counters, out), np.int32(b), np.int32(hkv),
        np.int32(s), np.int32(chunk), np.int32(nsplit), np.float32(qk_scale),
    )  # fmt: skip
    launch_on_torch_stream(fn, (nsplit, hkv, b), (warps * 32,), args, q.device, pdl=pdl)


__all__ = [
    "DEFAULT_CONFIG",
    "append_supported",
    "decode_attn_fused_bf16",
    "decode_attn_split_cuda",
    "default_config",
    "fused_bf16_warps",
    "fused_enabled",
    "kernel_name",
    "parse_config",
    "ring_ctas_per_sm",
    "set_default_config",
    "supports",
]
