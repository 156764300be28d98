"""bench/step_profile.py's layer timeline (pure bookkeeping over profiler spans; CPU)."""

import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench"


@pytest.fixture
def layer_timeline(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its neighbours by name
    from bench.step_profile import layer_timeline

    return layer_timeline


def _spans(replays: int, layer: list[tuple[str, float, float]], layers: int):
    """(start, end, name) of `replays` steps: an embed kernel, `layers` copies of `layer`
    ((name, start offset, duration) from the layer's start, 10 us apart) and a head kernel."""
    out, t = [], 0.0
    for _ in range(replays):
        out.append((t, t + 1, "embed"))
        t += 2
        for _ in range(layers):
            out += [(t + s, t + s + d, n) for n, s, d in layer]
            t += 10
        out.append((t, t + 3, "head"))
        t += 4
    return out


def test_layer_timeline_gives_each_kernels_share_of_the_critical_path(layer_timeline):
    # b starts (PDL) before a ends: its share is its end minus a's end, not its duration
    layer = [("a", 0.0, 4.0), ("b", 2.0, 5.0), ("c", 7.5, 1.0)]
    tl = layer_timeline(_spans(3, layer, 4)[::-1], replays=3, layers=4, layer=2)
    assert tl == [("a", 0.0, 4.0, 4.0), ("b", 2.0, 7.0, 3.0), ("c", 7.5, 8.5, 1.5)]


def test_layer_timeline_checks_its_arguments(layer_timeline):
    spans = _spans(2, [("a", 0.0, 1.0)], 3)
    with pytest.raises(ValueError, match="--timeline 3"):
        layer_timeline(spans, replays=2, layers=3, layer=3)
    with pytest.raises(ValueError, match="5 times"):
        layer_timeline(spans, replays=2, layers=5, layer=0)
