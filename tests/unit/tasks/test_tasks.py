"""Tasks, exact-match reward, character / Hugging Face tokenizers, the seeded prompt stream."""

from __future__ import annotations

import random

import pytest

from trace_common.tasks import (
    AdditionTask,
    CharTokenizer,
    HFTokenizerAdapter,
    PromptStream,
    ReverseTask,
    SortTask,
    exact_match_reward,
    make_task,
)


def test_char_tokenizer_round_trip_and_specials() -> None:
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len("0123456789+=SR")
    ids = tok.encode("12+9=")
    assert ids == [4, 5, 13, 12, 14]
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "12+9="
    with pytest.raises(ValueError, match="character 'x' is not in the tokenizer alphabet"):
        tok.encode("1x")
    with pytest.raises(ValueError, match="token id 99 is outside the vocabulary"):
        tok.decode([99])


def test_tasks_produce_correct_answers() -> None:
    rng = random.Random(0)
    for _ in range(50):
        p = AdditionTask(digits=3).sample(rng)
        a, b = p.prompt[:-1].split("+")
        assert int(p.answer) == int(a) + int(b)
        s = SortTask(length=5).sample(rng)
        assert s.prompt.startswith("S") and s.answer == "".join(sorted(s.prompt[1:-1]))
        r = ReverseTask(length=4).sample(rng)
        assert r.answer == r.prompt[1:-1][::-1]
    assert make_task("mixed", 2).max_answer_chars == 3
    with pytest.raises(ValueError, match="unknown task 'divide'"):
        make_task("divide", 2)
    with pytest.raises(ValueError, match="addition digits must be >= 1, got 0"):
        AdditionTask(digits=0)


def test_exact_match_reward_needs_eos_and_exact_text() -> None:
    tok = CharTokenizer()
    eos = tok.eos_id
    assert exact_match_reward([*tok.encode("125"), eos, 0, 0], "125", tok) == 1.0
    assert exact_match_reward([*tok.encode("125"), eos, *tok.encode("9")], "125", tok) == 1.0
    assert exact_match_reward([*tok.encode("1250"), eos], "125", tok) == 0.0
    assert exact_match_reward(tok.encode("125"), "125", tok) == 0.0  # truncated: no EOS
    assert exact_match_reward([eos], "125", tok) == 0.0


def test_prompt_stream_is_seeded_and_resumable() -> None:
    tok = CharTokenizer()
    a = PromptStream(make_task("addition", 2), tok, seed=7)
    first = a.next_batch(3) + a.next_batch(2)
    b = PromptStream(make_task("addition", 2), tok, seed=7)
    assert [p.problem for p in b.next_batch(5)] == [p.problem for p in first]
    assert [p.prompt_id for p in first] == [0, 1, 2, 3, 4]
    assert first[0].token_ids[0] == tok.bos_id
    c = PromptStream(make_task("addition", 2), tok, seed=7)
    c.load_state_dict({"seed": 7, "cursor": 3})
    assert [p.problem for p in c.next_batch(2)] == [p.problem for p in first[3:]]
    assert PromptStream(make_task("addition", 2), tok, seed=8).next_batch(5) != first
    with pytest.raises(ValueError, match="seed mismatch"):
        c.load_state_dict({"seed": 1, "cursor": 0})


def test_hf_tokenizer_directory_works(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="the hf extra is not installed")
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("0123456789+=")}}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    raw.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(tmp_path)
    tok = HFTokenizerAdapter(tmp_path)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("12+3=")
    assert ids == [4, 5, 13, 6, 14]
    assert tok.decode([1, *ids, 2]) == "12+3="
    assert exact_match_reward([*tok.encode("15"), tok.eos_id], "15", tok) == 1.0
    with pytest.raises(ValueError, match="does not exist"):
        HFTokenizerAdapter(tmp_path / "missing")
