"""`trace-rl export` on a trainer checkpoint: the directories it writes and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trace_common.cli import app
from trace_common.model import (
    MoECausalLM,
    QuantConfig,
    export_quantized_state_dict,
    get_config,
    load_hf_checkpoint,
    quantize_policy,
)
from trace_common.model.export import load_nvfp4_checkpoint
from trace_common.rl.checkpoint import Checkpoint, save_checkpoint
from trace_common.tasks import CharTokenizer

runner = CliRunner()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def message(output: str) -> str:
    """The CLI's error text with rich's box drawing and line wrapping taken out."""
    return " ".join(output.replace("│", " ").split())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoECausalLM, Path]:
    """A 'trained' debug policy (random weights) saved as the trainer saves it."""
    model = MoECausalLM(get_config("debug").replace(vocab_size=CharTokenizer().vocab_size))
    model.init_weights(11, std=0.1)
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    save_checkpoint(
        root,
        Checkpoint(
            step=3, version=3, model=model.state_dict(), optimizer={}, prompt_state={}, extra={}
        ),
    )
    return model, root


def test_export_writes_nvfp4_and_master_dirs(trained, tmp_path: Path) -> None:
    model, ckpt = trained
    out = tmp_path / "export"
    args = ["export", str(out), "--checkpoint", str(ckpt), "--calib-samples", "4"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["master", "nvfp4"]
    quant_cfg = json.loads((out / "nvfp4" / "hf_quant_config.json").read_text())
    assert quant_cfg["quantization"]["quant_algo"] == "NVFP4"
    loaded, scales = load_nvfp4_checkpoint(out / "nvfp4")
    assert scales and all(s.dtype == torch.float32 and s.shape == () for s in scales.values())
    want, _ = export_quantized_state_dict(quantize_policy(model, QuantConfig()))
    got, _ = export_quantized_state_dict(loaded)
    packed = [k for k, t in want.items() if t.dtype == torch.uint8 or "weight_scale" in k]
    bad = [k for k in packed if not torch.equal(bits(got[k]), bits(want[k]))]
    assert packed and not bad, f"FP4 codes/scales differ from the checkpoint's: {bad[:4]}"
    master = load_hf_checkpoint(out / "master")
    for key, t in model.state_dict().items():
        assert torch.equal(master.state_dict()[key], t.to(torch.bfloat16).float()), key


def test_export_refusals_are_clear(trained, tmp_path: Path) -> None:
    _, ckpt = trained
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    res = runner.invoke(app, ["export", str(tmp_path / "full"), "--checkpoint", str(ckpt)])
    assert res.exit_code == 2 and "not empty" in message(res.output)
    sites = "expert_weights,expert_acts,router_weights,router_acts"
    args = ["export", str(tmp_path / "out"), "--checkpoint", str(ckpt), "--quant-sites", sites]
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "cannot be exported" in message(res.output)
    assert not (tmp_path / "out").exists()
    res = runner.invoke(app, ["export", str(tmp_path / "out")])
    assert res.exit_code == 2 and "--checkpoint" in message(res.output)
