"""recipes/qwen3-30b-a3b-math.toml, the recipe for a real Qwen3-30B-A3B on a cluster, on a
stand-in: a tiny random Qwen3-MoE saved by transformers with the shipped BPE tokenizer (a
real Hugging Face tokenizer directory with a chat template) in place of the model directory,
and the shipped math set as the Parquet files the recipe names. The trainer starts on it (its
start-up checks pass) and one RL step runs through the recipe's prompts, chat template and
math reward on in-process replicas."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from services.trainer.app import TrainerApp
from services.trainer.config import TrainerSettings
from trace_common.rl.core import RewardScorer, TrainerConfig, TrainerCore
from trace_common.rl.dispatch import DispatchConfig, Dispatcher, StaticDirectory
from trace_common.rl.engine import LocalReplica
from trace_common.rl.local import LocalPublisher, MemoryRecordStore
from trace_common.rollout.engine import EngineHolder
from trace_common.rollout.native import NativeEngine
from trace_common.service import Metrics

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pyarrow = pytest.importorskip("pyarrow", reason="the [data] extra is not installed")

ROOT = pathlib.Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "qwen3-30b-a3b-math.toml"
MODEL_DIR = "/models/Qwen3-30B-A3B"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A data root with models/Qwen3-30B-A3B (tiny, random) and data/gsm8k/*.parquet."""
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("cluster")
    model = root / "models" / "Qwen3-30B-A3B"
    model.mkdir(parents=True)
    for f in (ROOT / "data" / "tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(str(model))
    (root / "data" / "gsm8k").mkdir(parents=True)
    for split in ("train", "test"):
        rows = [json.loads(x) for x in (ROOT / "data/math-word" / f"{split}.jsonl").open()]
        pq.write_table(pyarrow.Table.from_pylist(rows[:200]),
                       root / "data/gsm8k" / f"{split}.parquet", row_group_size=64)  # fmt: skip
    return root


def test_the_cluster_recipe_starts_and_trains_a_step_on_a_stand_in(
    stand_in: pathlib.Path,
) -> None:
    model_dir = str(stand_in / "models" / "Qwen3-30B-A3B")
    assert MODEL_DIR in RECIPE.read_text()
    # The recipe as shipped, but for where the model lives and a run small enough for a CPU.
    small = {"model.name": model_dir, "task.tokenizer": model_dir, "prompts_per_step": 2,
             "group_size": 2, "sampling.max_new_tokens": 6, "dispatch.prompts_per_unit": 2}  # fmt: skip
    settings = TrainerSettings(
        weight_sync_address="127.0.0.1:1", quant_cache_address="127.0.0.1:2", auth_token="t",
        recipe=RECIPE, run=small, data_root=stand_in,
    )  # fmt: skip
    app = TrainerApp(settings, Metrics("trainer"))
    try:
        run = app.run_config
        assert run.reward.name == "math" and run.guidance.layers == "all"
        assert run.dataset.train == stand_in / "data/gsm8k/train.parquet"
        assert app.inputs == {"train_rows": 200, "eval_rows": 200}
        assert len(app.eval_prompts) == 200  # eval.prompts = 500: every held-out row fits
        (prompt,) = app.core.prompts.with_seed(0).next_batch(1)
        assert prompt.problem.prompt.startswith(
            "<|im_start|>system\nSolve the problem step by step."
        ) and prompt.problem.prompt.endswith("<|im_start|>assistant\n")
        # One step of the recipe's loop on in-process replicas (the learner the app built).
        learner = app.learner
        store, holder = MemoryRecordStore(), EngineHolder()
        core = TrainerCore(
            TrainerConfig(mode=run.mode, prompts_per_step=2, group_size=2,
                          sampling=run.sampling),
            prompts=app.core.prompts,
            dispatcher=Dispatcher(StaticDirectory([LocalReplica("r", holder, store.put)]),
                                  DispatchConfig(prompts_per_unit=2)),
            scorer=RewardScorer(app.rewards, app.tokenizer, truncated=run.reward.truncated),
            records=store, learner=learner,
            publisher=LocalPublisher([holder], NativeEngine.from_weights),
        )  # fmt: skip
        core.publish()
        m = core.step()
        assert m["samples_trained"] == 4 and m["reward_errors"] == 0
        assert m["logp_abs_diff_max"] < 1e-3  # every layer guided, routing replayed
    finally:
        app.rewards.close()
