"""bench/ratio_bound.py: a layer's critical path split by part, and the FP4/BF16 ratio bounds
derived from it (CPU; synthetic step_profile rows)."""

import json
import pathlib

import pytest

import bench.ratio_bound as rb
from trace_common.kernels.engine_model import EngineShape


def _row(engine, context, batch, timeline):
    return {"engine": engine, "context": context, "batch": batch, "step_us": 1.0,
            "timeline": timeline}  # fmt: skip


BF16_TL = [["nvjet_qkv", 0, 8, 8.0], ["attn_bf16_fused", 8, 30, 22.0],
           ["decode_attn_reduce_kernel", 30, 34, 4.0], ["add_rmsnorm_kernel", 34, 37, 3.0],
           ["moe_gemm_kernel", 37, 237, 200.0], ["moe_gemm_kernel", 237, 337, 100.0]]  # fmt: skip
FP4_TL = [
    ["nvjet_qkv", 0, 8, 8.0],
    ["attn_fp4_ring", 8, 20, 12.0],
    ["add_rmsnorm_quant_kernel", 20, 26, 6.0],
    ["moe_fp4_mma", 26, 86, 60.0],
    ["nvfp4_quant_kernel", 86, 90, 4.0],
    ["moe_fp4_mma", 90, 120, 30.0],
    ["gemv_bf16", 115, 118, -2.0],
]  # fmt: skip  (a PDL kernel ending early adds nothing)


def test_categories_and_layer_split():
    assert rb.category("moe_fp4_stream") == "experts"
    assert rb.category("nvfp4_quant_kernel") == "experts"  # FP4's act quantize
    assert rb.category("decode_attn_split_kernel") == "attention"
    assert rb.category("qk_norm_rope_append_kernel") == "shared"
    assert rb.category("cublasLt::splitKreduce_kernel") == "shared"
    assert rb.layer_split(BF16_TL) == {"shared": 11.0, "attention": 26.0, "experts": 300.0}
    assert rb.layer_split(FP4_TL) == {"shared": 14.0, "attention": 12.0, "experts": 94.0}


def test_targets_per_row():
    assert rb.target_for(1024, 1) == rb.target_for(32768, 1) == 1.7
    assert rb.target_for(1024, 8) is None and rb.target_for(1024, 16) is None
    assert rb.target_for(1024, 32) == rb.target_for(1024, 128) == 2.8
    assert rb.target_for(32768, 8) == 3.2


def test_bytes_follow_the_model_shape():
    shape = EngineShape.named()
    # one token touches top_k experts; an FP4 expert is 4.5 / 16 of a BF16 one
    assert rb.expert_bytes(shape, 1, False) == pytest.approx(8 * 3 * 2048 * 768 * 2)
    assert rb.expert_bytes(shape, 1, True) / rb.expert_bytes(shape, 1, False) == 0.28125
    assert rb.expert_bytes(shape, 10_000, False) == pytest.approx(128 * 3 * 2048 * 768 * 2)
    bf = rb.attention_bytes(shape, 4, 1024, False)
    assert bf == 4 * 1024 * 2 * 4 * 128 * 2  # K and V, 4 kv heads of 128, bf16
    assert rb.attention_bytes(shape, 4, 1024, True) < bf / 3


def test_bounds_and_the_shared_part_a_target_needs(tmp_path):
    rows = [
        _row("bf16", 1024, 32, BF16_TL),
        _row("fp4", 1024, 32, FP4_TL),
        _row("bf16", 1024, 8, BF16_TL),
    ]  # fmt: skip  (batch 8 lacks FP4: left out)
    (b,) = rb.bounds(rows, copy_tbs=4.0)
    assert (b.context, b.batch, b.target) == (1024, 32, 2.8)
    assert b.measured == pytest.approx(337 / 120)
    us = 1e6 / 4e12
    shape = EngineShape.named()
    assert b.fp4_copy["experts"] == pytest.approx(rb.expert_bytes(shape, 32, True) * us)
    assert b.fp4_copy["shared"] == 14.0
    assert b.at_copy == pytest.approx(337 / sum(b.fp4_copy.values()))
    # the shared part S (both engines) solving (S + 326) / (S + xf) = 2.8, plugged back in
    for parts in (b.fp4, b.fp4_copy):
        s = b.shared_for_target(parts)
        xf = parts["experts"] + parts["attention"]
        if s is None:  # unreachable: even S = 0 leaves the ratio below the target
            assert 326 / xf < 2.8
        else:
            assert (s + 326) / (s + xf) == pytest.approx(2.8)
    text = rb.table([b])
    assert "| 1024 | 32 |" in text and "2.81x" in text
    no_timeline = {k: v for k, v in rows[0].items() if k != "timeline"}
    with pytest.raises(ValueError, match="no timeline"):
        rb.bounds([no_timeline, rows[1]], 4.0)


def test_main_prints_the_table_and_draws_the_plot(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    prof = tmp_path / "sp.json"
    prof.write_text(json.dumps([_row("bf16", 32768, 8, BF16_TL), _row("fp4", 32768, 8, FP4_TL)]))
    png = tmp_path / "rb.png"
    monkeypatch.setattr("sys.argv", ["ratio_bound.py", str(prof), "--png", str(png)])
    rb.main()
    assert "| 32768 | 8 |" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_refuses_profiles_without_both_engines(tmp_path, monkeypatch):
    prof = tmp_path / "sp.json"
    prof.write_text(json.dumps([_row("bf16", 1024, 8, BF16_TL)]))
    monkeypatch.setattr("sys.argv", ["ratio_bound.py", str(pathlib.Path(prof))])
    with pytest.raises(SystemExit, match="both engines"):
        rb.main()
