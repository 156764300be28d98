"""Input validation shared by the FP4 quantizers: clear errors that name the bad value."""

from __future__ import annotations

import torch

# Input dtypes the quantizers accept. float64 and the float8 types are refused rather than
# silently converted: the bit-exact ModelOpt convention is defined on fp32/bf16/fp16 inputs.
SUPPORTED_INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(x: object, name: str = "x") -> torch.Tensor:
    """Raise TypeError unless `x` is a torch.Tensor of a supported floating dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_INPUT_DTYPES)
        raise TypeError(f"{name} has dtype {x.dtype}; FP4 quantization accepts {names}")
    return x


def check_last_dim(x: torch.Tensor, block_size: int, fmt: str, name: str = "x") -> int:
    """Return the last dim K, raising ValueError unless it is a positive multiple of block_size."""
    if x.ndim == 0:
        raise ValueError(
            f"{name} is a 0-d tensor; {fmt} needs at least 1 dim (blocks run along the last)"
        )
    k = x.shape[-1]
    if k == 0 or k % block_size != 0:
        raise ValueError(
            f"{name} has last dim {k} (shape {tuple(x.shape)}), which is not a positive multiple "
            f"of the {fmt} block size {block_size}"
        )
    return k


def check_finite(x: torch.Tensor, name: str = "x") -> None:
    """Raise ValueError naming the first NaN/Inf element and its index.

    E2M1 and the e4m3/e8m0 scales have no Inf encoding, and one Inf or NaN would poison the
    amax of its whole tensor/row, so TRACE refuses such inputs instead of encoding them.
    """
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        value = x[idx].item()
        count = int(bad.sum())
        raise ValueError(
            f"{name} contains {value} at index {idx} ({count} non-finite element(s) in shape "
            f"{tuple(x.shape)}); FP4 quantization needs finite inputs"
        )
