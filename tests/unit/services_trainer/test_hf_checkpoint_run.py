"""A Hugging Face Qwen3-MoE checkpoint directory plus a Hugging Face tokenizer directory run
through the trainer's model builder and one in-process RL step (the path real models take)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.build import build_model
from services.trainer.config import TrainerSettings
from trace_common.model import GuidanceConfig, QuantConfig
from trace_common.rl.core import TrainerConfig, TrainerCore
from trace_common.rl.dispatch import DispatchConfig, Dispatcher, StaticDirectory
from trace_common.rl.engine import LocalReplica
from trace_common.rl.local import LocalPublisher, MemoryRecordStore
from trace_common.rl.policy import LearnerConfig, ModelLearner
from trace_common.rollout.engine import EngineHolder
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.types import SamplingConfig
from trace_common.tasks import PromptStream, exact_match_reward, load_tokenizer, make_task

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="the [hf] extra is not installed")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf-qwen3moe")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    chars = "0123456789+=SR"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    raw.decoder = tokenizers.decoders.Fuse()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return path


def test_hf_checkpoint_and_tokenizer_run_an_rl_step(hf_dir: Path) -> None:
    settings = TrainerSettings(
        weight_sync_address="127.0.0.1:1", quant_cache_address="127.0.0.1:2", auth_token="t",
        run={"model.name": str(hf_dir), "task.tokenizer": str(hf_dir)},
    )  # fmt: skip
    tok = load_tokenizer(settings.run.task.tokenizer)
    model = build_model(settings.run, tok.vocab_size)
    assert (model.cfg.num_layers, model.cfg.num_experts, model.cfg.vocab_size) == (2, 4, 32)
    learner = ModelLearner(
        model, LearnerConfig(mode="trace"), quant=QuantConfig(), guidance=GuidanceConfig(),
        eos_id=tok.eos_id, pad_id=tok.pad_id,
    )  # fmt: skip
    store, holder = MemoryRecordStore(), EngineHolder()
    task = make_task("reverse", 2)
    core = TrainerCore(
        TrainerConfig(mode="trace", prompts_per_step=2, group_size=2,
                      sampling=SamplingConfig(max_new_tokens=3)),
        prompts=PromptStream(task, tok, seed=0),
        dispatcher=Dispatcher(StaticDirectory([LocalReplica("r", holder, store.put)]),
                              DispatchConfig(prompts_per_unit=2)),
        scorer=lambda s, p: exact_match_reward(s.completion_tokens, p.answer, tok),
        records=store, learner=learner,
        publisher=LocalPublisher([holder], NativeEngine.from_weights),
    )  # fmt: skip
    core.publish()
    m = core.step()
    assert m["samples_trained"] == 4 and holder.version == 1
    assert m["logp_abs_diff_max"] < 1e-4  # fresh samples, guided + replayed: paths agree


def test_tokenizer_larger_than_the_checkpoint_vocab_is_a_clear_error(hf_dir: Path) -> None:
    settings = TrainerSettings(
        weight_sync_address="127.0.0.1:1", quant_cache_address="127.0.0.1:2", auth_token="t",
        run={"model.name": str(hf_dir)},
    )  # fmt: skip
    with pytest.raises(ValueError, match="has 99 tokens but the checkpoint"):
        build_model(settings.run, 99)
