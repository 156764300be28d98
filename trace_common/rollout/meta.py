"""The string metadata a pushed policy version carries besides the model's own (model and
quant configs, written by `trace_common.model.export_quantized_state_dict`): where the rollout
records guidance, and the special tokens that end a completion."""

from __future__ import annotations

import json
from dataclasses import dataclass

from trace_common.model import GuidanceConfig

META_GUIDANCE = "trace_guidance_config"  # JSON GuidanceConfig, or "null": no guidance
META_TOKENS = "trace_special_tokens"  # JSON {"eos_id": .., "pad_id": ..}


def guidance_to_json(g: GuidanceConfig | None) -> str:
    if g is None:
        return "null"
    return json.dumps({"layers": None if g.layers is None else list(g.layers),
                       "sites": list(g.sites), "mode": g.mode})  # fmt: skip


def guidance_from_json(s: str) -> GuidanceConfig | None:
    d = json.loads(s)
    if d is None:
        return None
    layers = None if d["layers"] is None else tuple(d["layers"])
    return GuidanceConfig(layers=layers, sites=tuple(d["sites"]), mode=d["mode"])


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyMeta:
    """The rollout-side metadata of a pushed version."""

    guidance: GuidanceConfig | None
    eos_id: int
    pad_id: int

    @classmethod
    def parse(cls, metadata: dict[str, str]) -> PolicyMeta:
        """ValueError naming the missing key when the metadata lacks one."""
        for key in (META_GUIDANCE, META_TOKENS):
            if key not in metadata:
                raise ValueError(f"policy metadata lacks {key!r}; got keys {sorted(metadata)}")
        special = json.loads(metadata[META_TOKENS])
        return cls(
            guidance=guidance_from_json(metadata[META_GUIDANCE]),
            eos_id=int(special["eos_id"]),
            pad_id=int(special["pad_id"]),
        )

    def to_metadata(self) -> dict[str, str]:
        return {
            META_GUIDANCE: guidance_to_json(self.guidance),
            META_TOKENS: json.dumps({"eos_id": self.eos_id, "pad_id": self.pad_id}),
        }
