"""Row sources: a dataset split read one row at a time, never whole into memory.

Three formats, chosen by what the path is (never by guessing at contents):

- a ``.jsonl`` file: one JSON object per line. Opening it makes one pass that keeps the byte
  offset of each non-blank line (8 bytes a row); a row is parsed when it is read.
- a ``.parquet`` file: rows are read by row group (pyarrow), the last few groups cached.
- a directory written by Hugging Face ``datasets`` (``save_to_disk``): a ``Dataset`` or a
  ``DatasetDict`` (then ``split`` picks one); ``datasets.load_from_disk`` memory-maps its Arrow
  files.

Every row comes back as a plain ``dict`` of Python values (lists, not arrays), so it can be
pickled to a reward worker. A row that cannot be read is a :class:`DatasetError` that names
the file and the line or row.
"""

from __future__ import annotations

import bisect
import collections
import json
import pathlib
from typing import Any, Protocol

import numpy as np

FORMATS = ("jsonl", "parquet", "hf")
PARQUET_CACHED_GROUPS = 2  # row groups kept decoded (sequential reads of a shuffled stream
# hit random groups; two cover the common case of a small file with one or two groups)


class DatasetError(ValueError):
    """A dataset that cannot be read as configured: names the file, the row and the field."""


class RowSource(Protocol):
    """One split of a dataset: its size, its columns and random access to a row."""

    path: pathlib.Path
    columns: tuple[str, ...]

    def __len__(self) -> int: ...

    def row(self, index: int) -> dict[str, Any]: ...

    def where(self, index: int) -> str:
        """The row's location for messages, e.g. "train.jsonl line 12"."""
        ...


def source_format(path: pathlib.Path) -> str:
    """ "jsonl", "parquet" or "hf" for `path`; a DatasetError names what it found instead."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return "hf"
        raise DatasetError(
            f"dataset {path}: a directory, but not one saved by datasets' save_to_disk "
            "(no dataset_dict.json or state.json)"
        )
    if not path.exists():
        raise DatasetError(f"dataset {path}: no such file or directory")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise DatasetError(
        f"dataset {path}: unknown format {suffix!r}; expected a .jsonl or .parquet file or a "
        "directory saved by datasets' save_to_disk"
    )


def open_source(path: pathlib.Path | str, split: str = "train") -> RowSource:
    """The row source at `path` (`split` picks a split of a DatasetDict directory)."""
    path = pathlib.Path(path)
    fmt = source_format(path)
    if fmt == "jsonl":
        return JsonlSource(path)
    if fmt == "parquet":
        return ParquetSource(path)
    return HFDiskSource(path, split)


class JsonlSource:
    """A JSON Lines file: line offsets indexed once, rows parsed when read."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        offsets: list[int] = []
        lines: list[int] = []
        with open(path, "rb") as f:
            pos = 0
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    offsets.append(pos)
                    lines.append(lineno)
                pos += len(raw)
        if not offsets:
            raise DatasetError(f"dataset {path}: no rows (the file is empty)")
        self._offsets = np.asarray(offsets, dtype=np.int64)  # [N] byte offset of row i
        self._lines = np.asarray(lines, dtype=np.int64)  # [N] 1-based line number of row i
        self._file = open(path, "rb")  # noqa: SIM115 - held open for random reads
        self.columns = tuple(self.row(0))

    def __len__(self) -> int:
        return len(self._offsets)

    def where(self, index: int) -> str:
        return f"{self.path} line {int(self._lines[index])}"

    def row(self, index: int) -> dict[str, Any]:
        self._file.seek(int(self._offsets[index]))
        raw = self._file.readline()
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(f"{self.where(index)}: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise DatasetError(
                f"{self.where(index)}: a row must be a JSON object, got {type(value).__name__}"
            )
        return value

    def close(self) -> None:
        self._file.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("JsonlSource holds an open file; send rows, not the source")


class ParquetSource:
    """A Parquet file, read by row group."""

    def __init__(self, path: pathlib.Path) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("Parquet datasets need pyarrow: pip install 'trace-rl[data]'") from e
        self.path = path
        try:
            self._file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid and friends
            raise DatasetError(f"dataset {path}: not a readable Parquet file: {e}") from None
        meta = self._file.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._starts = np.cumsum([0, *sizes])  # [G + 1] first row of each group
        if self._starts[-1] == 0:
            raise DatasetError(f"dataset {path}: no rows")
        self.columns = tuple(self._file.schema_arrow.names)
        self._groups: collections.OrderedDict[int, list[dict[str, Any]]] = collections.OrderedDict()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def where(self, index: int) -> str:
        return f"{self.path} row {index}"

    def row(self, index: int) -> dict[str, Any]:
        group = bisect.bisect_right(self._starts, index) - 1
        rows = self._groups.get(group)
        if rows is None:
            rows = self._file.read_row_group(group).to_pylist()
            self._groups[group] = rows
            while len(self._groups) > PARQUET_CACHED_GROUPS:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(group)
        return dict(rows[index - int(self._starts[group])])


class HFDiskSource:
    """A directory saved by Hugging Face ``datasets`` (memory-mapped Arrow)."""

    def __init__(self, path: pathlib.Path, split: str) -> None:
        try:
            import datasets
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "datasets directories need Hugging Face datasets: pip install 'trace-rl[data]'"
            ) from e
        self.path = path
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DatasetError(
                    f"dataset {path}: no split {split!r}; splits found: {sorted(loaded)}"
                )
            loaded = loaded[split]
            self.path = path / split
        if len(loaded) == 0:
            raise DatasetError(f"dataset {self.path}: no rows")
        self._ds = loaded
        self.columns = tuple(loaded.column_names)

    def __len__(self) -> int:
        return len(self._ds)

    def where(self, index: int) -> str:
        return f"{self.path} row {index}"

    def row(self, index: int) -> dict[str, Any]:
        return dict(self._ds[int(index)])
