"""The prompt stream over a dataset: deterministic, resumable by position, long prompts
skipped and counted, chat messages through the tokenizer's chat template."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from trace_common.data.prompts import DatasetPrompts, PromptFormat, first_prompts
from trace_common.data.sources import DatasetError, open_source
from trace_common.tasks import CharTokenizer, load_tokenizer

ALPHABET = "0123456789+=?#abcdefghijklmnopqrstuvwxyz "
TOK = CharTokenizer(ALPHABET)


def dataset(tmp_path: pathlib.Path, rows: list[dict], name: str = "train.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return open_source(path)


def sums(n: int) -> list[dict]:
    return [{"q": f"{i}+{i}=?", "sol": f"#### {2 * i}"} for i in range(n)]


def ids(batch) -> list[int]:
    return [p.prompt_id for p in batch]


def test_the_stream_is_a_seeded_permutation_per_epoch(tmp_path: pathlib.Path) -> None:
    src = dataset(tmp_path, sums(10))
    fmt = PromptFormat(prompt_column="q", columns={"answer": "sol"})
    stream = DatasetPrompts(src, fmt, TOK, seed=3)
    texts = [p.problem.prompt for p in stream.next_batch(20)]
    assert sorted(texts[:10]) == sorted(r["q"] for r in sums(10))  # one epoch: every row once
    assert sorted(texts[10:]) == sorted(texts[:10]) and texts[10:] != texts[:10]  # reshuffled
    again = DatasetPrompts(src, fmt, TOK, seed=3)
    assert [p.problem.prompt for p in again.next_batch(20)] == texts
    other = DatasetPrompts(src, fmt, TOK, seed=4)
    assert [p.problem.prompt for p in other.next_batch(10)] != texts[:10]
    plain = DatasetPrompts(src, fmt, TOK, shuffle=False)
    assert [p.problem.prompt for p in plain.next_batch(10)] == [r["q"] for r in sums(10)]


def test_a_resumed_stream_continues_with_the_prompts_it_would_have_seen(
    tmp_path: pathlib.Path,
) -> None:
    rows = sums(30)
    rows[7]["q"] = "9" * 40  # too long: skipped on both paths
    src = dataset(tmp_path, rows)
    fmt = PromptFormat(prompt_column="q", columns={"answer": "sol"}, max_prompt_tokens=12)
    whole = DatasetPrompts(src, fmt, TOK, seed=1)
    expected = [whole.next_batch(8) for _ in range(6)]
    first = DatasetPrompts(src, fmt, TOK, seed=1)
    for _ in range(3):
        first.next_batch(8)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = DatasetPrompts(open_source(tmp_path / "train.jsonl"), fmt, TOK, seed=1)
    resumed.load_state_dict(state)
    got = [resumed.next_batch(8) for _ in range(3)]
    assert [ids(b) for b in got] == [ids(b) for b in expected[3:]]
    assert [[p.token_ids for p in b] for b in got] == [
        [p.token_ids for p in b] for b in expected[3:]
    ]
    assert resumed.skipped == whole.skipped and whole.skipped["too_long"] >= 1


def test_a_checkpoint_of_another_dataset_or_seed_is_refused(tmp_path: pathlib.Path) -> None:
    fmt = PromptFormat(prompt_column="q")
    state = DatasetPrompts(dataset(tmp_path, sums(10)), fmt, TOK, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed mismatch"):
        DatasetPrompts(dataset(tmp_path, sums(10)), fmt, TOK, seed=2).load_state_dict(state)
    bigger = dataset(tmp_path, sums(11), "other.jsonl")
    with pytest.raises(ValueError, match="has 11 rows, but the checkpoint's stream was over 10"):
        DatasetPrompts(bigger, fmt, TOK, seed=1).load_state_dict(state)


def test_long_prompts_are_skipped_and_counted_never_truncated(tmp_path: pathlib.Path) -> None:
    rows = [{"q": "1+1=?"}, {"q": "1" * 30}, {"q": "2+2=?"}, {"q": "3" * 31}]
    stream = DatasetPrompts(dataset(tmp_path, rows), PromptFormat(prompt_column="q",
                            max_prompt_tokens=10), TOK, shuffle=False)  # fmt: skip
    batch = stream.next_batch(3)
    assert [p.problem.prompt for p in batch] == ["1+1=?", "2+2=?", "1+1=?"]  # 2nd epoch
    assert [p.prompt_id for p in batch] == [0, 2, 4]
    assert all(len(p.token_ids) <= 10 for p in batch)
    assert stream.skipped == {"too_long": 2, "malformed": 0}


def test_malformed_rows_are_skipped_counted_and_named(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"q": "1+1=?", "sol": "2"}\n{"q": 5, "sol": "2"}\n{"sol": "2"}\nnot json\n')
    fmt = PromptFormat(prompt_column="q", columns={"answer": "sol"})
    stream = DatasetPrompts(open_source(path), fmt, TOK, shuffle=False)
    with caplog.at_level(logging.WARNING):
        batch = stream.next_batch(2)
    assert [p.prompt_id for p in batch] == [0, 4]
    assert stream.skipped == {"too_long": 0, "malformed": 3}
    log = caplog.text
    assert f"{path} line 2: field 'q' must be a string" in log
    assert f"{path} line 3: no field 'q'; fields found: ['sol']" in log
    assert f"{path} line 4: not valid JSON" in log


def test_a_stream_where_no_row_fits_stops_with_the_reason(tmp_path: pathlib.Path) -> None:
    src = dataset(tmp_path, [{"q": "1" * 50}] * 3)
    stream = DatasetPrompts(src, PromptFormat(prompt_column="q", max_prompt_tokens=5), TOK)
    with pytest.raises(DatasetError, match=r"rows in a row gave no prompt.*max_prompt_tokens=5"):
        stream.next_batch(1)


def test_a_missing_column_names_the_column_and_the_columns_found(tmp_path: pathlib.Path) -> None:
    src = dataset(tmp_path, sums(3))
    with pytest.raises(DatasetError, match=r"no column 'question'.*columns found: \['q', 'sol'\]"):
        DatasetPrompts(src, PromptFormat(prompt_column="question"), TOK)


def test_reward_fields_map_columns_and_keep_the_others(tmp_path: pathlib.Path) -> None:
    src = dataset(tmp_path, [{"q": "1+1=?", "sol": "#### 2", "level": 3}])
    fmt = PromptFormat(prompt_column="q", columns={"answer": "sol"}, target_column="sol")
    (p,) = DatasetPrompts(src, fmt, TOK).next_batch(1)
    assert p.problem.row == {"q": "1+1=?", "sol": "#### 2", "level": 3, "answer": "#### 2"}
    assert p.problem.answer == "#### 2"  # the warm start's target
    assert p.token_ids == (TOK.bos_id, *TOK.encode("1+1=?"))


def test_a_template_string_formats_plain_prompts(tmp_path: pathlib.Path) -> None:
    src = dataset(tmp_path, [{"q": "1+1", "hint": "add"}])
    fmt = PromptFormat(prompt_column="q", template="{hint} {prompt}=?")
    (p,) = DatasetPrompts(src, fmt, TOK).next_batch(1)
    assert p.problem.prompt == "add 1+1=?"


def test_chat_messages_and_plain_prompts_go_through_the_chat_template(
    tmp_path: pathlib.Path, chat_tokenizer_dir: pathlib.Path
) -> None:
    tok = load_tokenizer(str(chat_tokenizer_dir))
    rows = [
        {"messages": [{"role": "user", "content": "How many apples?"}]},
        {"messages": "How many apples?"},
    ]
    fmt = PromptFormat(prompt_column="messages", system="Answer with a number.")
    p1, p2 = DatasetPrompts(dataset(tmp_path, rows), fmt, tok, shuffle=False).next_batch(2)
    expected = (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
        "<|im_start|>user\nHow many apples?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert p1.problem.prompt == expected == p2.problem.prompt
    assert p1.token_ids == p2.token_ids
    assert (
        tok.decode(p1.token_ids)
        == "system\nAnswer with a number.\nuser\nHow many apples?\nassistant\n"
    )
    im_start = tok._tok.convert_tokens_to_ids("<|im_start|>")  # a special token, not its characters
    assert p1.token_ids[0] == im_start and p1.token_ids.count(im_start) == 3
    never = PromptFormat(prompt_column="messages", chat="never")
    (plain,) = DatasetPrompts(dataset(tmp_path, rows[1:], "p.jsonl"), never, tok).next_batch(1)
    assert plain.problem.prompt == "How many apples?"


def test_chat_messages_need_a_tokenizer_with_a_chat_template(
    tmp_path: pathlib.Path, plain_tokenizer_dir: pathlib.Path
) -> None:
    tok = load_tokenizer(str(plain_tokenizer_dir))
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    stream = DatasetPrompts(dataset(tmp_path, rows), PromptFormat(prompt_column="messages"), tok)
    with pytest.raises(DatasetError, match="holds chat messages, but the tokenizer has no chat"):
        stream.next_batch(1)


def test_held_out_prompts_are_the_first_that_fit_in_file_order(tmp_path: pathlib.Path) -> None:
    rows = sums(6)
    rows[1]["q"] = "1" * 40
    stream = DatasetPrompts(dataset(tmp_path, rows), PromptFormat(prompt_column="q",
                            max_prompt_tokens=12), TOK, seed=9)  # fmt: skip
    held = first_prompts(stream, 3)
    assert [p.problem.prompt for p in held] == ["0+0=?", "2+2=?", "3+3=?"]
    assert [p.prompt_id for p in first_prompts(stream, 3)] == [p.prompt_id for p in held]
