"""Tokenizers for the RL tasks: a character tokenizer for the tiny demo model, and an adapter
that gives a Hugging Face tokenizer directory the same small interface.

Both expose the same five things the trainer and rollout need: ``vocab_size``, the special ids
(``pad_id``, ``bos_id``, ``eos_id``), ``encode`` and ``decode``. Nothing else in the code looks
inside a tokenizer, so a real model's tokenizer drops in without code changes.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

PAD_TOKEN = "<pad>"  # id 0: fills right-padded batches, never sampled
BOS_TOKEN = "<bos>"  # id 1: starts every prompt
EOS_TOKEN = "<eos>"  # id 2: ends a completion; a completion without it is truncated
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

# Characters the built-in tasks use: digits, the operators and the task markers.
DEFAULT_ALPHABET = "0123456789+=SR"


@runtime_checkable
class Tokenizer(Protocol):
    """What the RL loop needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def prompt_ids(self, text: str) -> list[int]:
        """A prompt's token ids, with the BOS the model expects (when it has one)."""
        ...


class CharTokenizer:
    """One token per character of a fixed alphabet, after the three special tokens.

    ``encode`` never adds special tokens (callers add BOS/EOS where they mean to); ``decode``
    drops special tokens. An unknown character is a ``ValueError`` naming it.
    """

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        if not alphabet:
            raise ValueError("alphabet is empty")
        self.alphabet = alphabet
        self._char_to_id = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(alphabet)}
        self._id_to_char = {i: c for c, i in self._char_to_id.items()}

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def encode(self, text: str) -> list[int]:
        ids = []
        for c in text:
            if c not in self._char_to_id:
                raise ValueError(
                    f"character {c!r} is not in the tokenizer alphabet {self.alphabet!r}"
                )
            ids.append(self._char_to_id[c])
        return ids

    def prompt_ids(self, text: str) -> list[int]:
        return [self.bos_id, *self.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < len(SPECIAL_TOKENS):
                continue
            if i not in self._id_to_char:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(self._id_to_char[i])
        return "".join(out)


class HFTokenizerAdapter:
    """A Hugging Face tokenizer (a directory with ``tokenizer.json`` / ``tokenizer_config.json``)
    behind the :class:`Tokenizer` interface.

    Models without a pad token pad with EOS; models without a BOS token (Qwen3) start prompts
    with EOS-free text, so ``bos_id`` falls back to the pad id and callers that prepend BOS
    still get a valid id.
    """

    def __init__(self, path: str | pathlib.Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "a Hugging Face tokenizer needs transformers: pip install 'trace-rl[hf]'"
            ) from exc
        path = pathlib.Path(path)
        if not path.is_dir():
            raise ValueError(f"tokenizer directory {str(path)!r} does not exist")
        self._tok = AutoTokenizer.from_pretrained(str(path))
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer at {str(path)!r} defines no eos token")
        self._eos = int(eos)
        pad = self._tok.pad_token_id
        self._pad = int(pad) if pad is not None else self._eos
        bos = self._tok.bos_token_id
        self._has_bos = bos is not None
        self._bos = int(bos) if bos is not None else self._pad
        self.path = path

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def prompt_ids(self, text: str) -> list[int]:
        """`text`'s ids, after the tokenizer's BOS when it has one and the text (a rendered
        chat template, say) does not start with it already."""
        ids = self.encode(text)
        if (self._has_bos and (not ids or ids[0] != self._bos)) or not ids:
            ids.insert(0, self._bos)  # an empty prompt still needs one position
        return ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Chat messages as the prompt text of the tokenizer's chat template, ending where the
        assistant's reply begins."""
        if not self.has_chat_template:
            raise ValueError(f"tokenizer at {str(self.path)!r} has no chat template")
        return self._tok.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )


def load_tokenizer(spec: str) -> Tokenizer:
    """``"char"`` (or ``"char:<alphabet>"``) for the character tokenizer, else a directory path
    holding a Hugging Face tokenizer."""
    if spec == "char":
        return CharTokenizer()
    if spec.startswith("char:"):
        return CharTokenizer(spec[len("char:") :])
    return HFTokenizerAdapter(spec)
