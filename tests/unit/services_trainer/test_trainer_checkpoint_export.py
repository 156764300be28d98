"""checkpoint.export: a trainer checkpoint also gets its HF exports (docs/export.md)."""

from __future__ import annotations

from pathlib import Path

from services.trainer.app import export_checkpoint
from services.trainer.config import TrainerSettings
from trace_common.model import MoECausalLM, get_config
from trace_common.model.export import load_nvfp4_checkpoint
from trace_common.rl.checkpoint import Checkpoint, save_checkpoint
from trace_common.tasks import CharTokenizer


def test_checkpoint_export_writes_both_directories(tmp_path: Path) -> None:
    settings = TrainerSettings(
        weight_sync_address="127.0.0.1:1", quant_cache_address="127.0.0.1:2", auth_token="t",
        run={"model.name": "debug", "task.name": "reverse", "task.difficulty": 2,
             "checkpoint.export": True},
    )  # fmt: skip
    model = MoECausalLM(get_config("debug").replace(vocab_size=CharTokenizer().vocab_size))
    model.init_weights(2)
    ckpt = Checkpoint(
        step=1, version=1, model=model.state_dict(), optimizer={}, prompt_state={}, extra={}
    )
    path = save_checkpoint(tmp_path, ckpt)
    export_checkpoint(settings.run, path, settings.run.quant.build(model.cfg))
    assert sorted(p.name for p in (path / "export").iterdir()) == ["master", "nvfp4"]
    loaded, _ = load_nvfp4_checkpoint(path / "export" / "nvfp4")
    assert loaded.quant == settings.run.quant.build(model.cfg)
