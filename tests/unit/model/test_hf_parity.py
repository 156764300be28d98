"""Our Qwen3-MoE equals transformers' on a tiny random checkpoint built locally (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trace_common.model import ModelConfig, load_hf_checkpoint

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

HF_KW = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=128,
    initializer_range=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF_KW)).eval()
    path = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(path)
    return path


def test_logits_match_transformers(hf_dir: Path) -> None:
    ref_model = transformers.Qwen3MoeForCausalLM.from_pretrained(hf_dir).eval()
    ours = load_hf_checkpoint(hf_dir).eval()
    ids = torch.randint(0, HF_KW["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids).logits
        out = ours(ids, torch.arange(12).expand(2, 12), torch.ones(2, 12, dtype=torch.bool))
    assert ref.abs().max() > 0.1, "test model too close to zero to be a meaningful comparison"
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)


def test_config_read_from_checkpoint(hf_dir: Path) -> None:
    cfg = load_hf_checkpoint(hf_dir).cfg
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.head_dim) == (3, 8, 2, 32)
    assert cfg.rope_theta == 10000.0 and cfg.norm_topk_prob


def test_mismatching_expected_config_is_a_clear_error(hf_dir: Path) -> None:
    expected = load_hf_checkpoint(hf_dir).cfg.replace(num_experts=16)
    with pytest.raises(ValueError, match=r"num_experts: expected 16, checkpoint has 8"):
        load_hf_checkpoint(hf_dir, expected=expected)


def test_checkpoint_with_wrong_shapes_or_type_is_rejected(hf_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    (bad / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"experts\.\w+_proj. has shape"):
        load_hf_checkpoint(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'"):
        load_hf_checkpoint(bad)


def test_model_config_rejects_inconsistent_fields() -> None:
    with pytest.raises(ValueError, match="top_k=9"):
        ModelConfig(
            vocab_size=8,
            hidden_size=16,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=8,
            num_experts=8,
            top_k=9,
            moe_intermediate_size=16,
        )
