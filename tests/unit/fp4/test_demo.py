"""The `make demo` numerics demo runs and shows guidance beating plain rounding."""

from __future__ import annotations

import io

from rich.console import Console

from trace_common.fp4.demo import (
    NumericsDemoConfig,
    compare,
    make_activations,
    rollout_gemm,
    run_demo,
    trainer_gemm,
)

SMALL = NumericsDemoConfig(tokens=32, hidden=256, k=256, split_k=4, drifts=(0.2,))


def test_run_demo_prints_table() -> None:
    buf = io.StringIO()
    run_demo(SMALL, Console(file=buf, width=120))
    out = buf.getvalue()
    for text in ("accumulation order only", "+ 20% upstream drift", "guided, compact", "mxfp4"):
        assert text in out


def test_guided_flips_fewer_codes_than_rtn() -> None:
    h, w, _ = make_activations(SMALL)
    x_rollout, x_train = rollout_gemm(h, w, SMALL.split_k), trainer_gemm(h, w)
    assert not (x_rollout == x_train).all(), "the two kernels should disagree somewhere"
    for fmt in ("nvfp4", "mxfp4"):
        rows = {
            method: (flips, d_act) for method, flips, d_act, _ in compare(x_rollout, x_train, fmt)
        }
        rtn_flips, rtn_d = rows["RTN, own scales"]
        assert rtn_flips > 0 and rtn_d > 0, f"{fmt}: nothing to fix ({rows})"
        for mode in ("compact", "full"):
            flips, d_act = rows[f"guided, {mode}"]
            assert flips < rtn_flips and d_act < rtn_d, f"{fmt}/{mode}: {rows}"
