"""The trainer's FP4 sites and guided sites come from its run (the recipe's quant.sites,
guidance.sites)."""

from __future__ import annotations

import pytest

from services.trainer.config import TrainerSettings
from trace_common.model import QuantConfig, get_config

REQUIRED = {"weight_sync_address": "127.0.0.1:1", "quant_cache_address": "127.0.0.1:2"}


def _settings(**run: object) -> TrainerSettings:
    """The trainer with run keys given by their section: quant_sites -> quant.sites."""
    keys = {k.replace("_", ".", 1): v for k, v in run.items()}
    return TrainerSettings(**REQUIRED, auth_token="t", run=keys)


def test_default_is_the_papers_setting() -> None:
    cfg = get_config("debug")
    assert _settings().run.quant.build(cfg).sites == QuantConfig().sites
    assert _settings(quant_format="mxfp4").run.quant.build(cfg).format == "mxfp4"


def test_all_is_every_site_the_model_has() -> None:
    cfg = get_config("debug")
    quant = _settings(quant_sites="all").run.quant.build(cfg)
    assert quant.sites == QuantConfig.every_site(cfg).sites
    assert {"attn_weights", "lm_head_weights", "kv"} <= quant.sites


def test_explicit_sites_and_guided_sites() -> None:
    s = _settings(
        quant_sites="expert_weights, expert_acts,kv,attn_weights,attn_acts",
        guidance_sites="moe_in,attn_in,o_in",
        guidance_layers="all",
    )
    cfg = get_config("debug")
    quant = s.run.quant.build(cfg)
    assert quant.sites == {"expert_weights", "expert_acts", "kv", "attn_weights", "attn_acts"}
    guidance = s.run.guidance.build(cfg.num_layers)
    assert guidance.sites == ("moe_in", "attn_in", "o_in")
    pairs = guidance.resolve(cfg, quant)
    assert {site for _, site in pairs} == {"moe_in", "attn_in", "o_in"}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("quant_sites", "expert_weights,atn_weights", "atn_weights"),
        ("quant_sites", "norm_weights", "norm_weights"),
        ("guidance_sites", "moe_in,kk", "kk"),
        ("guidance_sites", "lm_head_in", "lm_head_in"),
    ],
)
def test_bad_site_names_stop_start_up_naming_them(field: str, value: str, named: str) -> None:
    with pytest.raises(ValueError, match=named) as err:
        _settings(**{field: value})
    assert field.replace("_", ".", 1) in str(err.value)  # the tree's key: quant.sites


def test_a_site_the_model_lacks_or_a_guided_site_left_high_precision_is_refused() -> None:
    cfg = get_config("debug")
    assert not cfg.shared_expert_intermediate_size, "the debug shape has no shared expert"
    with pytest.raises(ValueError, match="shared_expert_weights"):
        _settings(quant_sites="shared_expert_weights").run.quant.build(cfg)
    s = _settings(guidance_sites="attn_in")  # attn_acts is not FP4 by default
    with pytest.raises(ValueError, match="attn_acts"):
        s.run.guidance.build(cfg.num_layers).resolve(cfg, s.run.quant.build(cfg))
