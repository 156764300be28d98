"""bench/experiments/cta_stamps.py's source instrumentation and span table (no GPU needed)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench" / "experiments"))

from cta_stamps import SLOTS, instrument, span_table

SRC = """// a kernel file
#include "fp4_common.cuh"  // helpers

template <int N>
__global__ void __launch_bounds__(N * 32) first(const int* a,
                                               int* b) {  // comment after the brace
  const int x = a[0];
  if (x) {
    pdl_wait();
    pdl_launch_dependents();
  }
  b[0] = x;  // marker
}

__global__ void second(int* b) {
  b[1] = 2;
}
"""


def test_instrument_places_every_stamp():
    out = instrument(SRC, {"b[0] = x;  // marker": 3})
    assert out.index("#include") < out.index("cta_stamps[") < out.index("template <int N>")
    body1 = out[out.index("first(") : out.index("second(")]
    # entry first, then the exit guard, both before the kernel's own code
    assert body1.index("CTA_STAMP(0)") < body1.index("CtaStampExit") < body1.index("const int x")
    assert body1.index("pdl_wait();") < body1.index("CTA_STAMP(1)") < body1.index(
        "pdl_launch_dependents")  # fmt: skip
    assert body1.index("// marker") < body1.index("CTA_STAMP(3)")
    body2 = out[out.index("second(") :]
    assert "CTA_STAMP(0)" in body2 and "CTA_STAMP(1)" not in body2, "no wait, no slot 1"


@pytest.mark.parametrize(("anchors", "message"), [({"nowhere": 3}, "occurs 0 times"),
                                                  ({"b[0] = x;": 1}, "slot 1"),
                                                  ({"b[0] = x;": SLOTS - 1}, "slot 7")])  # fmt: skip
def test_instrument_refuses_bad_anchors(anchors, message):
    with pytest.raises(ValueError, match=message):
        instrument(SRC, anchors)
    with pytest.raises(ValueError, match="#include"):
        instrument("__global__ void k() {\n}\n")


def test_span_table_orders_kernels_by_first_entry():
    def st(entry, exit_):  # two CTAs; CTA 1 has no slot-1 stamp
        s = [[0, 0] for _ in range(SLOTS)]
        s[0] = [entry, entry + 1000]
        s[1] = [entry + 500, 0]
        s[SLOTS - 1] = [exit_, exit_ + 2000]
        return s

    rows = span_table({"late": st(10_000, 20_000), "early": st(4_000, 9_000),
                       "idle": [[0, 0] for _ in range(SLOTS)]})  # fmt: skip
    assert [r[0] for r in rows] == ["early", "late"], "unlaunched kernels are left out"
    _, n, spans = rows[0]
    assert n == 2 and spans[0] == (0, 0.0, 1.0, 0.0)
    assert spans[1] == (1, 0.5, 0.5, 0.5) and spans[2] == (SLOTS - 1, 5.0, 7.0, 5.0)
    assert rows[1][2][0] == (0, 6.0, 7.0, 6.0), "times from the earliest entry of all"
