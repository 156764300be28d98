"""`trace-rl export`: a trainer checkpoint (or an HF checkpoint) -> HF directories others load.

Writes, under an empty or absent `out`:
  out/nvfp4/  the FP4 policy in NVIDIA ModelOpt's NVFP4 checkpoint format (vLLM:
              `LLM(model="out/nvfp4", quantization="modelopt_fp4")`), static activation and
              K/V scales calibrated on prompts of the run's task;
  out/master/ the master weights as a plain `Qwen3MoeForCausalLM` checkpoint (BF16 unless
              `dtype` says otherwise);
  out/tokenizer/  a Hugging Face tokenizer directory's files, when the run used one.
docs/export.md describes the formats.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trace_common.model import MoECausalLM, QuantConfig, get_config, quantize_policy
from trace_common.model.export import (
    calibrate_act_amax,
    check_nvfp4_exportable,
    save_hf_checkpoint,
    save_nvfp4_checkpoint,
)
from trace_common.model.hf import load_native_state_dict
from trace_common.tasks import PromptStream, load_tokenizer, make_task

NVFP4_DIR = "nvfp4"
MASTER_DIR = "master"
TOKENIZER_DIR = "tokenizer"
# Calibration prompts come from their own stream position, away from training and evaluation.
CALIB_SEED = 7_000_003


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    """What to export and how to calibrate the static scales."""

    out: Path  # must be empty or absent
    model: str = "debug"  # named shape (vocab sized to the tokenizer) or an HF checkpoint dir
    checkpoint: Path | None = None  # trainer checkpoint: its root (uses `latest`) or a step dir
    tokenizer: str = "char"  # "char" or an HF tokenizer directory (the run's task.tokenizer)
    quant: QuantConfig = field(default_factory=QuantConfig)  # the run's quant.sites
    task: str = "reverse"  # calibration prompts (the run's task)
    difficulty: int = 3
    calib_samples: int = 64  # prompt + answer sequences run through the FP4 policy
    # The calibration sequences' token ids, when the caller has them (a dataset run's prompts
    # and targets); None: `calib_samples` problems of `task`.
    sequences: list[list[int]] | None = None
    dtype: torch.dtype = torch.bfloat16  # high-precision tensors of both exports
    master: bool = True  # also write the master weights (out/master)

    def __post_init__(self) -> None:
        if self.calib_samples < 1:
            raise ValueError(f"calib_samples must be >= 1, got {self.calib_samples}")


def _model(cfg: ExportConfig, vocab_size: int) -> MoECausalLM:
    """The run's architecture with the checkpoint's master weights (as the trainer builds it)."""
    from trace_common.model import load_hf_checkpoint

    path = Path(cfg.model)
    if path.is_dir():
        model = load_hf_checkpoint(path)
    else:
        model = MoECausalLM(get_config(cfg.model).replace(vocab_size=vocab_size))
        if cfg.checkpoint is None:
            raise ValueError(
                f"model {cfg.model!r} is a named shape: give the trainer checkpoint whose "
                "weights to export (--checkpoint)"
            )
    if cfg.checkpoint is not None:
        from trace_common.rl.checkpoint import latest_checkpoint, load_checkpoint

        step = latest_checkpoint(cfg.checkpoint) or cfg.checkpoint
        load_native_state_dict(model, load_checkpoint(step).model, source=str(step))
    return model


def calibration_batches(cfg: ExportConfig) -> list[torch.Tensor]:
    """One [1, T] batch per prompt + answer + EOS of the task (what rollouts see), or per
    sequence the caller gave."""
    if cfg.sequences is not None:
        return [torch.tensor([list(seq)]) for seq in cfg.sequences]
    tok = load_tokenizer(cfg.tokenizer)
    stream = PromptStream(make_task(cfg.task, cfg.difficulty), tok, seed=CALIB_SEED)
    return [
        torch.tensor([[*p.token_ids, *tok.encode(p.problem.answer), tok.eos_id]])
        for p in stream.next_batch(cfg.calib_samples)
    ]


def run_export(cfg: ExportConfig) -> dict[str, Path]:
    """Write the exports; returns {name: directory}."""
    out = Path(cfg.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"export directory {str(out)!r} exists and is not empty")
    tok = load_tokenizer(cfg.tokenizer)
    model = _model(cfg, tok.vocab_size).eval()
    check_nvfp4_exportable(cfg.quant, model.cfg)  # before anything is written
    quantize_policy(model, cfg.quant)
    amax = calibrate_act_amax(model, calibration_batches(cfg))
    written = {NVFP4_DIR: save_nvfp4_checkpoint(model, out / NVFP4_DIR, amax, dtype=cfg.dtype)}
    if cfg.master:
        written[MASTER_DIR] = save_hf_checkpoint(model, out / MASTER_DIR, dtype=cfg.dtype)
    if Path(cfg.tokenizer).is_dir():
        shutil.copytree(cfg.tokenizer, out / TOKENIZER_DIR)
        written[TOKENIZER_DIR] = out / TOKENIZER_DIR
    return written
