"""A static KV cache for batched incremental decoding.

K and V are appended *after* the kv site hook, so with FP4 KV the cache holds the dequantized
value of each token's FP4 codes (quantized once per token row when it is appended, never
re-quantized). Storing dequantized values rather than packed codes keeps attention a plain
matmul on CPU; a GPU engine can store packed codes plus scales instead, since the values are
identical either way. Columns are shared by the batch (left-padded prompts, one new column per
decode step); `valid` marks which columns hold a real token of each sample.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # [B, S_max]
        self.max_len = max_len
        self.length = 0  # columns filled so far (all layers)

    def key_valid(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Set validity of the next T columns (new_valid [B, T]); returns valid [B, length+T]."""
        t = new_valid.shape[1]
        if self.length + t > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {t} > max_len={self.max_len}")
        self.valid[:, self.length : self.length + t] = new_valid
        return self.valid[:, : self.length + t]

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, n_kv, D] at the next columns; return all keys/values so far."""
        t = k.shape[1]
        end = self.length + t
        self.k[layer][:, self.length : end] = k
        self.v[layer][:, self.length : end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def advance(self, t: int) -> None:
        """Called once per forward after every layer appended its T columns."""
        self.length += t
