"""bench/soak.py's bookkeeping: percentiles, RSS growth per process, the fault schedule."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def soak(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import soak

    return soak


def test_percentile_is_nearest_rank(soak) -> None:
    xs = [float(i) for i in range(1, 101)]  # 1..100
    assert (soak.percentile(xs, 50), soak.percentile(xs, 99)) == (50.0, 99.0)
    assert soak.percentile([3.0], 99) == 3.0
    assert soak.percentile([], 50) != soak.percentile([], 50)  # NaN


def test_rss_growth_is_judged_per_process_after_warm_up(soak) -> None:
    mem = soak.MemorySamples()
    mem.take(0.0, {})  # nothing running yet: nothing recorded
    for t, rss in ((0, 100), (10, 200), (20, 220)):  # warm at t=10: +10%
        mem.samples["trainer"].append((float(t), 1, rss))
    for t, rss in ((25, 300), (30, 310)):  # restarted at 25, younger than the warm-up at the end
        mem.samples["trainer"].append((float(t), 2, rss))
    for t, rss in ((0, 50), (10, 50), (30, 60)):
        mem.samples["quant-cache"].append((float(t), 7, rss))
    got = mem.report(warmup_s=10.0)
    assert got["trainer"]["restarts"] == 1 and got["trainer"]["growth"] is None
    assert got["trainer"]["max_growth"] == pytest.approx(0.10)
    assert got["quant-cache"]["growth"] == pytest.approx(0.20)
    assert got["quant-cache"]["start_rss_bytes"] == 50


def test_each_fault_kind_once_per_round(soak, tmp_path: pathlib.Path) -> None:
    cfg = soak.SoakConfig(minutes=1, fault_every_s=10, seed=3)
    faults = soak.Faults(cluster=None, cfg=cfg, workdir=tmp_path)  # type: ignore[arg-type]
    kinds = [faults._next_kind() for _ in range(2 * len(soak.FAULTS))]
    assert sorted(kinds[:4]) == sorted(kinds[4:]) == sorted(soak.FAULTS)
    assert 5.0 <= faults.next_at <= 15.0


def test_bad_settings_are_refused(soak) -> None:
    with pytest.raises(ValueError, match="unknown faults"):
        soak.SoakConfig(faults=("disk",))
    with pytest.raises(ValueError, match="minutes"):
        soak.SoakConfig(minutes=0)


def test_old_checkpoints_are_pruned_but_never_the_latest(soak, tmp_path: pathlib.Path) -> None:
    for step in (2, 4, 6, 8, 10):
        (tmp_path / f"step-{step:06d}").mkdir()
        (tmp_path / f"step-{step:06d}" / "trainer_state.json").write_text("{}")
    (tmp_path / "latest").write_text("step-000004")  # behind the newest (a resumed trainer)
    soak.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-000004",
        "step-000008",
        "step-000010",
    ]
