"""bench/env_ab.py's per-setting environment: kernel sources and small-batch launch shapes
(CPU; nothing is compiled)."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def env_ab(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the script imports its neighbours by name
    import bench.env_ab as env_ab

    yield env_ab
    env_ab.apply({}, set(env_ab.SOURCES) | {"TRACE_SMALL_CONFIG"})


def test_a_setting_swaps_kernel_sources_and_launch_shapes(env_ab, tmp_path):
    from trace_common.kernels import cuda_moe, cuda_small

    old = tmp_path / "small_old.cu"
    old.write_text("// an older revision")
    small0, moe0, warps0 = cuda_small.SOURCE, cuda_moe.SOURCE, dict(cuda_small.WARPS)
    names = {"TRACE_AB_SMALL_SOURCE", "TRACE_SMALL_CONFIG"}
    env_ab.apply({"TRACE_AB_SMALL_SOURCE": str(old), "TRACE_SMALL_CONFIG": '{"o":16}'}, names)
    now = (cuda_small.SOURCE, cuda_moe.SOURCE, cuda_small.WARPS["o"])
    assert now == (old.resolve(), moe0, 16)
    env_ab.apply({}, names)  # the next setting names neither: the defaults come back
    assert (cuda_small.SOURCE, dict(cuda_small.WARPS)) == (small0, warps0)


def test_a_missing_source_file_is_refused_by_name(env_ab, tmp_path):
    with pytest.raises(ValueError, match=r"TRACE_AB_MOE_SOURCE=.*nope\.cu: no such file"):
        env_ab.apply({"TRACE_AB_MOE_SOURCE": str(tmp_path / "nope.cu")}, {"TRACE_AB_MOE_SOURCE"})


def test_a_setting_swaps_the_fp4_attention_source(env_ab, tmp_path):
    from trace_common.kernels import cuda_attn

    variant = tmp_path / "attn_variant.cu"
    variant.write_text("// a variant")
    attn0 = cuda_attn.SOURCE
    env_ab.apply({"TRACE_AB_ATTN_SOURCE": str(variant)}, {"TRACE_AB_ATTN_SOURCE"})
    swapped = cuda_attn.SOURCE
    env_ab.apply({}, {"TRACE_AB_ATTN_SOURCE"})
    assert (swapped, cuda_attn.SOURCE) == (variant.resolve(), attn0)
