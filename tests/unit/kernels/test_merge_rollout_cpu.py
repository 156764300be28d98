"""bench/merge_rollout.py: new bench/rollout_gpu.py runs merged into the kept results file
(CPU; a plot is drawn where matplotlib is installed)."""

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def mr(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the script imports its neighbours by name
    import bench.merge_rollout as mr

    return mr


def _row(engine, context, batch, tok_s, run=None, note=""):
    r = {"engine": engine, "context": context, "batch": batch, "tok_s": tok_s, "ms_step": 1.0,
         "note": note, "small": False, "pdl": False}  # fmt: skip
    return r if run is None else dict(r, run=run)


def _run(command, bw, rows):
    return {"env": {"gpu": "H200", "command": command}, "copy_bw_tb_s": bw, "rows": rows}


def test_merge_replaces_rows_keeps_named_runs_and_numbers_runs(mr):
    old = {
        "env": {"gpu": "H200", "command": ["a", "b", "c"], "tree": "old"},
        "copy_bw_tb_s": [4.27, 4.28, 4.29],
        "rows": [_row("bf16", 1024, 32, 1900.0, 0), _row("fp4", 1024, 32, 4000.0, 0),
                 _row("fp4", 1024, 32, 4010.0, 2), _row("fp4+capture", 1024, 32, 4005.0, 2),
                 _row("fp4", 1024, 2, 670.0, 5)],
    }  # fmt: skip
    new1 = _run("d", 4.30, [_row("bf16", 1024, 32, 1950.0), _row("fp4", 1024, 32, 4100.0)])
    new2 = _run("e", 4.26, [_row("fp4", 32768, 8, 1100.0)])
    got = mr.merge(old, [new1, new2], keep_runs={2}, tree="new tree", note="why")
    seen = sorted((r["engine"], r["batch"], r["context"], r["run"]) for r in got["rows"])
    assert seen == [("bf16", 32, 1024, 6), ("fp4", 2, 1024, 5), ("fp4", 8, 32768, 7),
                    ("fp4", 32, 1024, 2), ("fp4", 32, 1024, 6),
                    ("fp4+capture", 32, 1024, 2)]  # fmt: skip
    assert got["env"]["command"] == ["a", "b", "c", "d", "e"]
    assert got["copy_bw_tb_s"] == [4.27, 4.28, 4.29, 4.30, 4.26]
    assert (got["env"]["tree"], got["env"]["note"]) == ("new tree", "why")
    assert old["env"]["command"] == ["a", "b", "c"], "the old file's lists were changed in place"
    latest = {(r["engine"], r["batch"]): r["run"] for r in mr.latest_rows(got["rows"])}
    assert latest[("fp4", 32)] == 6 and latest[("fp4+capture", 32)] == 2


def test_merge_refuses_files_that_are_not_one_run(mr):
    old = {"env": {"command": ["a"]}, "copy_bw_tb_s": [4.3], "rows": []}
    with pytest.raises(ValueError, match="no 'rows'"):
        mr.merge(old, [{"env": {"command": "x"}, "copy_bw_tb_s": 4.3}])
    with pytest.raises(ValueError, match="several runs"):
        mr.merge(old, [old])


def test_main_writes_the_file_and_its_plot(mr, tmp_path, monkeypatch):
    into = tmp_path / "kept.json"
    into.write_text(json.dumps({"env": {"command": ["a"]}, "copy_bw_tb_s": [4.3],
                                "rows": [_row("bf16", 1024, 8, 900.0, 0)]}))  # fmt: skip
    new = tmp_path / "rollout_gpu.json"
    new.write_text(json.dumps(_run("b", 4.2, [
        _row("bf16", 1024, 8, 910.0), _row("fp4", 1024, 8, 1600.0),
        _row("fp4", 32768, 118, 2700.0, note="largest batch in a 120 GiB budget")])))  # fmt: skip
    monkeypatch.setattr("sys.argv", ["merge_rollout.py", str(new), "--into", str(into)])
    mr.main()
    got = json.loads(into.read_text())
    assert [(r["engine"], r["tok_s"], r["run"]) for r in got["rows"]] == [
        ("bf16", 910.0, 1), ("fp4", 1600.0, 1), ("fp4", 2700.0, 1)]  # fmt: skip
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    assert into.with_suffix(".png").stat().st_size > 1000
