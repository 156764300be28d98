"""Row sources: the same rows from JSONL, Parquet and a `datasets` directory, read lazily,
and bad files named with their line or row."""

from __future__ import annotations

import json
import pathlib
import tracemalloc

import pytest

from trace_common.data.sources import DatasetError, JsonlSource, open_source

ROWS = [
    {"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}", "tests": [f"t{i}"]}
    for i in range(50)
]


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: pathlib.Path, rows: list[dict], row_group_size: int = 16) -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_jsonl_parquet_and_a_datasets_directory_give_the_same_rows(tmp_path: pathlib.Path) -> None:
    import datasets

    jsonl = write_jsonl(tmp_path / "train.jsonl", ROWS)
    parquet = write_parquet(tmp_path / "train.parquet", ROWS)
    single = tmp_path / "hf-dataset"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    split_dir = tmp_path / "hf-dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:5])}
    ).save_to_disk(str(split_dir))
    sources = [open_source(jsonl), open_source(parquet), open_source(single),
               open_source(split_dir, "train")]  # fmt: skip
    for src in sources:
        assert len(src) == len(ROWS)
        assert set(src.columns) == {"question", "answer", "tests"}
        for i in (0, 17, 33, 49, 16, 15):  # across Parquet row groups, out of order
            assert src.row(i) == ROWS[i], (type(src).__name__, i)
    assert len(open_source(split_dir, "test")) == 5


def test_a_datasets_directory_without_the_split_names_the_splits_found(
    tmp_path: pathlib.Path,
) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
        str(tmp_path / "d")
    )
    with pytest.raises(DatasetError, match=r"no split 'validation'; splits found: \['train'\]"):
        open_source(tmp_path / "d", "validation")


def test_a_malformed_jsonl_line_is_named_by_file_and_line(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n[1, 2]\n')
    src = JsonlSource(path)
    assert len(src) == 3  # the blank line is no row
    assert src.row(0) == {"prompt": "a"}
    with pytest.raises(DatasetError, match=rf"{path} line 3: not valid JSON"):
        src.row(1)
    with pytest.raises(DatasetError, match=rf"{path} line 4: a row must be a JSON object"):
        src.row(2)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.jsonl", "", "no rows"),
        ("rows.csv", "a,b\n", "unknown format '.csv'"),
        ("broken.parquet", "not parquet", "not a readable Parquet file"),
    ],
)
def test_unreadable_files_are_refused_naming_them(
    tmp_path: pathlib.Path, name: str, content: str, message: str
) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(DatasetError, match=message):
        open_source(tmp_path / name)


def test_missing_paths_and_foreign_directories_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(DatasetError, match="no such file or directory"):
        open_source(tmp_path / "nope.jsonl")
    (tmp_path / "dir").mkdir()
    with pytest.raises(DatasetError, match="not one saved by datasets' save_to_disk"):
        open_source(tmp_path / "dir")


def test_a_big_jsonl_file_is_not_read_into_memory(tmp_path: pathlib.Path) -> None:
    """40 MB of rows: opening keeps 16 bytes a row (offset and line), not the rows."""
    path = tmp_path / "big.jsonl"
    filler = "x" * 2000
    with open(path, "w") as f:
        for i in range(20_000):
            f.write(json.dumps({"prompt": f"{i} {filler}", "answer": str(i)}) + "\n")
    assert path.stat().st_size > 40e6
    tracemalloc.start()
    src = JsonlSource(path)
    row = src.row(12_345)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert row["answer"] == "12345"
    assert peak < 5e6, f"opening a 40 MB JSONL file took {peak / 1e6:.1f} MB"
