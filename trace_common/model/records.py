"""Per-sample rollout records: guidance at guided (layer, site) pairs plus routing.

One `SampleRecords` describes one generated sequence of L tokens (prompt + completion). The
model ran on its first L-1 tokens (the last sampled token is never fed back), so every record
has R = L-1 rows, row r belonging to the input token at position r: prompt rows come from the
batched prefill, the others from the decode step that consumed that token.

`to_bytes()` is the blob the rollout service stores in quant-cache (opaque to it):

    magic b"TRSR" | u16 version | u32 header length | JSON header |
    tokens int32[L] | routing (uint8 or int16)[R, n_moe_layers, k] | guidance records ...

The JSON header lists the format, mode, prompt length, the routing layers and shape, and the
(layer, site, byte length) of every guidance record, which follow in that order, each in
`GuidanceRecord.to_bytes()` form.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np
import torch

from trace_common.fp4.e2m1 import pack_bits, unpack_uint4
from trace_common.fp4.record import GuidanceRecord, check_magic_version, concat_records
from trace_common.model.config import GUIDED_SITES, ModelConfig

RECORDS_MAGIC = b"TRSR"
RECORDS_VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, JSON header length
_E2M1_MANTISSA_BIT = 0b0001  # bit 0 of an E2M1 code
_UINT8_MAX_EXPERTS = 256  # expert ids fit uint8 below this many experts, else int16

Key = tuple[int, str]


@dataclass(slots=True)
class SampleRecords:
    """Everything the rollout recorded for one sample.

    tokens:     int64 [L] prompt + generated tokens
    prompt_len: number of prompt tokens (<= L-1)
    fmt, mode:  FP4 format name and guidance mode ("compact" | "full"); mode is "" if no
                guidance was recorded
    guidance:   {(layer, site): GuidanceRecord with R = L-1 rows}
    moe_layers: the MoE layers, in the order of routing's second dim
    routing:    int64 [R, len(moe_layers), k] expert ids, or None if not recorded
    """

    tokens: torch.Tensor
    prompt_len: int
    fmt: str
    mode: str
    guidance: dict[Key, GuidanceRecord] = field(default_factory=dict)
    moe_layers: tuple[int, ...] = ()
    routing: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.tokens.numel()) - 1

    @property
    def guidance_nbytes(self) -> int:
        """Guidance body bytes (the size the paper's arithmetic counts)."""
        return sum(r.nbytes for r in self.guidance.values())

    def validate(self, cfg: ModelConfig | None = None) -> None:
        """Raise ValueError if sections disagree with each other (or with the model)."""
        if self.tokens.dim() != 1 or self.tokens.numel() < 2:
            raise ValueError(
                f"records need >= 2 tokens in a 1-D tensor, got {tuple(self.tokens.shape)}"
            )
        if not 0 < self.prompt_len <= self.num_rows:
            raise ValueError(f"prompt_len={self.prompt_len} outside [1, {self.num_rows}]")
        for (layer, site), rec in self.guidance.items():
            if rec.num_rows != self.num_rows:
                raise ValueError(
                    f"guidance record ({layer}, {site!r}) has {rec.num_rows} rows, "
                    f"the sample has {self.num_rows} (= {self.num_rows + 1} tokens - 1)"
                )
            if rec.fmt != self.fmt or rec.mode != self.mode:
                raise ValueError(
                    f"guidance record ({layer}, {site!r}) is {rec.fmt}/{rec.mode}, "
                    f"the sample says {self.fmt}/{self.mode}"
                )
            if cfg is not None:
                if not 0 <= layer < cfg.num_layers:
                    raise ValueError(
                        f"guidance record for layer {layer}; model has {cfg.num_layers}"
                    )
                if site not in GUIDED_SITES:
                    raise ValueError(f"guidance record for unknown site {site!r}")
                if not cfg.has_act_site(layer, site):
                    raise ValueError(f"guidance record ({layer}, {site!r}): layer has no {site}")
                width = cfg.act_width(site)
                if rec.k != width:
                    raise ValueError(
                        f"guidance record ({layer}, {site!r}) has width {rec.k}, "
                        f"the model's {site} width is {width}"
                    )
        if self.routing is not None:
            shape = tuple(self.routing.shape)
            if len(shape) != 3 or shape[:2] != (self.num_rows, len(self.moe_layers)):
                raise ValueError(
                    f"routing has shape {shape}, expected "
                    f"({self.num_rows}, {len(self.moe_layers)}, k)"
                )
            if cfg is not None:
                if self.moe_layers != cfg.moe_layers or shape[2] != cfg.top_k:
                    raise ValueError(
                        f"routing covers layers {self.moe_layers} with k={shape[2]}; the model's "
                        f"MoE layers are {cfg.moe_layers} with top_k={cfg.top_k}"
                    )
                if self.routing.numel() and not bool(
                    ((self.routing >= 0) & (self.routing < cfg.num_experts)).all()
                ):
                    raise ValueError(f"routing has expert ids outside [0, {cfg.num_experts})")

    def to_bytes(self) -> bytes:
        self.validate()
        blobs = [
            (layer, site, rec.to_bytes()) for (layer, site), rec in sorted(self.guidance.items())
        ]
        routing_bytes, routing_dtype, routing_shape = b"", None, None
        if self.routing is not None:
            routing_shape = list(self.routing.shape)
            big = int(self.routing.max()) >= _UINT8_MAX_EXPERTS if self.routing.numel() else False
            routing_dtype = "<i2" if big else "u1"
            routing_bytes = self.routing.cpu().numpy().astype(routing_dtype).tobytes()
        header = {
            "fmt": self.fmt,
            "mode": self.mode,
            "prompt_len": self.prompt_len,
            "num_tokens": int(self.tokens.numel()),
            "moe_layers": list(self.moe_layers),
            "routing_dtype": routing_dtype,
            "routing_shape": routing_shape,
            "guidance": [[layer, site, len(b)] for layer, site, b in blobs],
        }
        hjson = json.dumps(header, separators=(",", ":")).encode()
        tokens = self.tokens.cpu().numpy().astype("<i4").tobytes()
        return b"".join(
            [_PREFIX.pack(RECORDS_MAGIC, RECORDS_VERSION, len(hjson)), hjson, tokens, routing_bytes]
            + [b for _, _, b in blobs]
        )

    @classmethod
    def from_bytes(cls, buf: bytes | bytearray | memoryview) -> SampleRecords:
        buf = bytes(buf)
        if len(buf) < _PREFIX.size:
            raise ValueError(f"truncated sample records: {len(buf)} bytes")
        magic, version, hlen = _PREFIX.unpack_from(buf, 0)
        check_magic_version("sample records", magic, version, RECORDS_MAGIC, RECORDS_VERSION)
        off = _PREFIX.size
        try:
            h = json.loads(buf[off : off + hlen])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"sample records header is not valid JSON: {e}") from None
        off += hlen
        n_tok = int(h["num_tokens"])
        need = off + 4 * n_tok
        routing_shape = h["routing_shape"]
        if routing_shape is not None:
            need += int(np.prod(routing_shape)) * np.dtype(h["routing_dtype"]).itemsize
        need += sum(n for _, _, n in h["guidance"])
        if len(buf) != need:
            raise ValueError(f"sample records are {len(buf)} bytes, the header describes {need}")
        tokens = torch.from_numpy(np.frombuffer(buf, "<i4", n_tok, off).astype(np.int64))
        off += 4 * n_tok
        routing = None
        if routing_shape is not None:
            n = int(np.prod(routing_shape))
            arr = np.frombuffer(buf, h["routing_dtype"], n, off).astype(np.int64)
            routing = torch.from_numpy(arr).reshape(routing_shape)
            off += n * np.dtype(h["routing_dtype"]).itemsize
        guidance = {}
        for layer, site, n in h["guidance"]:
            guidance[(int(layer), str(site))] = GuidanceRecord.from_bytes(buf[off : off + n])
            off += n
        out = cls(
            tokens=tokens,
            prompt_len=int(h["prompt_len"]),
            fmt=h["fmt"],
            mode=h["mode"],
            guidance=guidance,
            moe_layers=tuple(h["moe_layers"]),
            routing=routing,
        )
        out.validate()
        return out

    def select(
        self, keys: set[Key] | None = None, *, mode: str | None = None, routing: bool = True
    ) -> SampleRecords:
        """A subset: only guidance at `keys` (None: all), optionally full -> compact, with or
        without routing. Used to derive cheaper records from a full one (e.g. in benchmarks)."""
        mode = mode or self.mode
        guidance = {}
        for key, rec in self.guidance.items():
            if keys is not None and key not in keys:
                continue
            guidance[key] = to_mode(rec, mode)
        return SampleRecords(
            tokens=self.tokens,
            prompt_len=self.prompt_len,
            fmt=self.fmt,
            mode=mode if guidance else "",
            guidance=guidance,
            moe_layers=self.moe_layers,
            routing=self.routing if routing else None,
        )


def to_mode(rec: GuidanceRecord, mode: str) -> GuidanceRecord:
    """Convert a full record to compact (keep each code's mantissa bit); identity otherwise."""
    if rec.mode == mode:
        return rec
    if rec.mode != "full" or mode != "compact":
        raise ValueError(f"cannot convert a {rec.mode!r} record to {mode!r} (only full -> compact)")
    bits = pack_bits(unpack_uint4(rec.payload) & _E2M1_MANTISSA_BIT)  # [R, K/8]
    return GuidanceRecord(
        rec.fmt, "compact", rec.shape, bits.contiguous(), rec.block_scales, rec.row_scales
    )


def batch_guidance(records: list[SampleRecords]) -> dict[Key, GuidanceRecord]:
    """Concatenate the samples' guidance per (layer, site), sample-major.

    All samples must carry the same (layer, site) set (ValueError naming the difference).
    """
    keys = set(records[0].guidance)
    for i, r in enumerate(records):
        if set(r.guidance) != keys:
            raise ValueError(
                f"sample {i} has guidance at {sorted(r.guidance)}, sample 0 at "
                f"{sorted(keys)}; a batch needs the same guided sites"
            )
    return {k: concat_records([r.guidance[k] for r in records]) for k in sorted(keys)}


def batch_routing(records: list[SampleRecords]) -> dict[int, torch.Tensor]:
    """{layer: ids [N_valid, k]} concatenated over samples (ValueError if one lacks routing)."""
    for i, r in enumerate(records):
        if r.routing is None:
            raise ValueError(f"routing replay requested but sample {i} has no routing record")
    cat = torch.cat([r.routing for r in records])  # [N_valid, n_moe, k]
    return {layer: cat[:, j] for j, layer in enumerate(records[0].moe_layers)}
