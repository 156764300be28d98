"""A tiny Hugging Face tokenizer directory with a ChatML chat template, built here."""

from __future__ import annotations

import pathlib

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_chat_tokenizer(path: pathlib.Path, *, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A byte-level BPE trained on a few sentences, saved with transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = ["How many apples does Ann have? 7 + 5 = 12 #### 12", "def add(a, b): return a + b"]
    tok.train_from_iterator(
        text * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )  # fmt: skip
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("chat-tokenizer")
    save_chat_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def plain_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("plain-tokenizer")
    save_chat_tokenizer(path, chat_template=None)
    return path
