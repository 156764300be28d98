"""The run plots: one discrepancy panel per unit on a symlog axis, zero visible, legends off the
data, and the three PNGs written."""

from __future__ import annotations

import pathlib

import matplotlib
import pytest

from trace_common.launch import plots

matplotlib.use("Agg")  # plots imports pyplot lazily, so this takes effect

STEPS = 12


def _rows(fresh: float, stale: float | None) -> list[dict[str, object]]:
    """metrics.jsonl rows as a trace-mode run writes them: fresh measures `fresh`, every other
    step with stale samples at `stale`."""
    rows: list[dict[str, object]] = []
    for step in range(1, STEPS + 1):
        row: dict[str, object] = {
            "step": step,
            "reward_mean": 0.1 + 0.05 * step,
            "logp_abs_diff_mean": fresh,
            "logp_abs_diff_max": 10 * fresh,
            "k3_kl": fresh * fresh,
            "d_act_mean": fresh,
            "code_flip_rate": fresh,
        }
        if stale is not None and step % 2:
            row["logp_abs_diff_mean_stale"] = stale
        rows.append(row)
    return rows


def _panels(fig: object) -> dict[str, object]:
    return {ax.get_title(): ax for ax in fig.axes}  # type: ignore[attr-defined]


def test_one_panel_per_measure_with_its_unit_on_a_symlog_axis() -> None:
    fig = plots.discrepancy_figure(_rows(0.01, 0.05), "run")
    panels = _panels(fig)
    assert set(panels) == {p.title for p in plots.DISCREPANCY_PANELS}
    units = {p.title: p.ylabel for p in plots.DISCREPANCY_PANELS}
    assert len(set(units.values())) == len(units), "two panels share a unit: merge them"
    for title, ax in panels.items():
        assert ax.get_yscale() == "symlog", title
        assert ax.get_ylabel() == units[title]
    assert panels["k3 KL(rollout || train), fresh samples"].get_ylabel() == "nats per token"


def test_zero_series_are_drawn_above_the_bottom_of_the_axis() -> None:
    """A trace run's fresh measures are all exactly 0: each is a line of markers at y = 0 that
    lies inside the axis (bottom < 0), and the panel says so."""
    fig = plots.discrepancy_figure(_rows(0.0, 0.05), "run")
    for panel in plots.DISCREPANCY_PANELS:
        ax = _panels(fig)[panel.title]
        bottom, top = ax.get_ylim()
        assert bottom < 0 < top, (panel.title, bottom, top)
        series = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
        fresh = [line for line in series if "stale" not in line.get_label()]
        assert fresh, panel.title
        for line in fresh:
            assert line.get_marker() not in (None, "None", ""), "a zero line needs markers"
            assert set(line.get_ydata()) == {0.0}
        texts = [t.get_text() for t in ax.texts]
        assert any("0 at every step" in t for t in texts), (panel.title, texts)
    # the stale curve is nonzero and gets its own marker, so it cannot hide the fresh ones
    dlogp = _panels(fig)["|logp_train - logp_rollout| per token"]
    markers = [line.get_marker() for line in dlogp.get_lines() if line.get_label()[0] != "_"]
    assert len(markers) == 3 and len(set(markers)) == 3


def test_legends_do_not_cover_the_data() -> None:
    fig = plots.overview_figure(_rows(0.01, 0.05), "run", warm_start_reward=0.1, final_reward=0.7)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = 0
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        legends += 1
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert not box.overlaps(area), (ax.get_title(), box, area)
    assert legends == 2  # the reward panel and the three |dlogp| curves


def test_a_measure_that_was_never_logged_is_named_not_drawn() -> None:
    rows = _rows(0.01, None)
    for row in rows:
        del row["d_act_mean"]
    ax = _panels(plots.discrepancy_figure(rows, "run"))["D_act at guided sites, fresh samples"]
    assert [line for line in ax.get_lines() if line.get_label()[0] != "_"] == []
    assert [t.get_text() for t in ax.texts] == ["not measured: needs full guidance records"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.0, 0.0], plots.LINTHRESH_DEFAULT),
        ([0.0, 3e-5, 0.2], 1e-5),
        ([1e-20], plots.LINTHRESH_MIN),
        ([0.5], plots.LINTHRESH_MAX),
        ([float("nan"), 2e-7], 1e-7),
    ],
)
def test_linthresh_follows_the_smallest_nonzero_value(values: list[float], expected: float) -> None:
    assert plots.linthresh_for(values) == pytest.approx(expected)


def test_plot_run_writes_the_three_pngs(tmp_path: pathlib.Path) -> None:
    paths = plots.plot_run(_rows(0.0, 0.05), tmp_path, title="run", warm_start_reward=0.2)
    assert [p.name for p in paths] == ["reward.png", "discrepancy.png", "overview.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
