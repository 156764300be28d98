"""Merge `bench/rollout_gpu.py` results into the file the docs keep (docs/rollout_gpu_h200.json)
and redraw its plot (the .png beside it).

    python3 bench/merge_rollout.py --into docs/rollout_gpu_h200.json rg/rollout_gpu.json \
        rg32/rollout_gpu.json --tree "runs 9-10: abc1234" --note "..." --keep-runs 2

Each new file becomes the next run number, in the order given, its command and copy bandwidth
appended to the file's lists. An old row is dropped when a new file has a row of the same
(engine, context, batch), unless its run is in --keep-runs (a measurement whose partner rows
belong with it, e.g. a capture row). The plot shows, per (engine, context, batch), the fastest
row of the latest run that has one (the fixed-budget rows left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def _key(row: dict) -> tuple:
    return row["engine"], row["context"], row["batch"]


def merge(old: dict, news: list[dict], *, keep_runs: set[int] = frozenset(), tree: str = "",
          note: str = "") -> dict:  # fmt: skip
    """`old` (the kept file: env with command and copy_bw_tb_s lists, rows with runs) with the
    single-run files `news` merged in as runs max(old runs) + 1, + 2, ..."""
    for i, new in enumerate(news):
        for name in ("env", "copy_bw_tb_s", "rows"):
            if name not in new:
                raise ValueError(f"new file {i}: no {name!r}; expected bench/rollout_gpu.py output")
        if isinstance(new["env"].get("command"), list):
            raise ValueError(f"new file {i} holds several runs already (a merged file?)")
    commands = old["env"]["command"]
    bws = old["copy_bw_tb_s"]
    merged_env = dict(old["env"], command=list(commands if isinstance(commands, list)
                                                else [commands]))  # fmt: skip
    merged_bw = list(bws if isinstance(bws, list) else [bws])
    replaced = {_key(r) for new in news for r in new["rows"]}
    rows = [r for r in old["rows"] if _key(r) not in replaced or r.get("run") in keep_runs]
    run = max((r.get("run", 0) for r in old["rows"]), default=-1) + 1
    for new in news:
        rows += [dict(r, run=run) for r in new["rows"]]
        merged_env["command"].append(new["env"]["command"])
        merged_bw.append(new["copy_bw_tb_s"])
        run += 1
    if tree:
        merged_env["tree"] = tree
    if note:
        merged_env["note"] = note
    return dict(old, env=merged_env, copy_bw_tb_s=merged_bw, rows=rows)


def latest_rows(rows: list[dict]) -> list[dict]:
    """Per (engine, context, batch), the rows of the latest run that has that key."""
    last: dict[tuple, int] = {}
    for r in rows:
        last[_key(r)] = max(last.get(_key(r), -1), r.get("run", 0))
    return [r for r in rows if r.get("run", 0) == last[_key(r)]]


def redraw(merged: dict, png: pathlib.Path, layers: int = 48) -> None:
    """The rollout_gpu plot of `merged`'s latest rows (bf16 and fp4; not the fixed-budget
    rows, whose batches differ per engine) into `png`."""
    import rollout_gpu

    fields = {f.name for f in dataclasses.fields(rollout_gpu.Row)}
    rows = [rollout_gpu.Row(**{k: v for k, v in r.items() if k in fields})
            for r in latest_rows(merged["rows"])
            if r["engine"] in ("bf16", "fp4") and "budget" not in r.get("note", "")]  # fmt: skip
    args = argparse.Namespace(contexts=sorted({r.context for r in rows}),
                              batches=sorted({r.batch for r in rows}), layers=layers)  # fmt: skip
    rollout_gpu.plot(rows, args, png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("new", type=pathlib.Path, nargs="+", help="rollout_gpu.json of each new run")
    ap.add_argument("--into", type=pathlib.Path, required=True, help="the kept results file")
    ap.add_argument("--keep-runs", type=int, nargs="*", default=[])
    ap.add_argument("--tree", default="", help="which tree each run measured")
    ap.add_argument("--note", default="", help="what the file's runs are")
    args = ap.parse_args()
    merged = merge(json.loads(args.into.read_text()),
                   [json.loads(p.read_text()) for p in args.new],
                   keep_runs=set(args.keep_runs), tree=args.tree, note=args.note)  # fmt: skip
    args.into.write_text(json.dumps(merged, indent=1))
    redraw(merged, args.into.with_suffix(".png"))
    print(
        f"{args.into}: {len(merged['rows'])} rows, runs "
        f"{sorted({r['run'] for r in merged['rows']})}; plot {args.into.with_suffix('.png')}"
    )


if __name__ == "__main__":
    main()
