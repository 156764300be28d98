"""cuda_small's launch-shape settings (no GPU needed): configure / KernelSettings.small_launch."""

from __future__ import annotations

import pytest

from trace_common.kernels import cuda_small


@pytest.fixture
def restore():
    yield
    cuda_small.configure()


def test_configure_overrides_warps_and_ring(restore):
    cfg = cuda_small.configure({"qkv": 16, "RING_STAGES": 4})
    assert cuda_small.WARPS["qkv"] == 16 and cfg["qkv"] == 16
    assert cuda_small.RING_STAGES == 4 and cfg["RING_STAGES"] == 4
    # split_k reads the ring depth at call time: 2048 / (32 x 8 warps) = 8 chunks, 4 per stage
    assert cuda_small.split_k(2048, 8).ns == 2
    cuda_small.configure({"RING_STAGE_CHUNKS": 2, "RING_STAGES": 4})
    assert cuda_small.split_k(2048, 8).ns == 4
    cfg = cuda_small.configure({"RING_STAGE_CHUNKS": 2})  # each call starts from the defaults
    assert cuda_small.split_k(2048, 8).ns == cuda_small.DEFAULT_RING["RING_STAGES"]
    assert cfg == cuda_small.config() and cfg["qkv"] == cuda_small.DEFAULT_WARPS["qkv"]


def test_by_tokens_defaults_yield_to_named_keys(restore):
    cuda_small.configure({})
    for (key, tokens), val in cuda_small.BY_TOKENS.items():
        site = key.removesuffix("_stages")
        got = cuda_small.stages_of(site, tokens) if key.endswith("_stages") else (
            cuda_small.warps_of(site, tokens))  # fmt: skip
        assert got == val, (key, tokens)
    assert cuda_small.warps_of("gate_up", 7) == cuda_small.DEFAULT_WARPS["gate_up"]
    assert cuda_small.stages_of("down", 7) is None, "RING_STAGES where no default is set"
    cuda_small.configure({"gate_up": 2, "down_stages": 2})
    assert cuda_small.warps_of("gate_up", 2) == 2 and cuda_small.stages_of("down", 1) == 2


def test_kernel_settings_apply_small_launch(restore):
    from trace_common.kernels.settings import KernelSettings

    KernelSettings(small_launch={"router": 4, "RING_STAGE_CHUNKS": 2}).apply()
    assert cuda_small.config()["router"] == 4 and cuda_small.RING_STAGE_CHUNKS == 2
    KernelSettings().apply()
    assert cuda_small.config() == cuda_small.configure({})
    with pytest.raises(ValueError, match="key 'qkvv'"):
        KernelSettings(small_launch={"qkvv": 8})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"qkvv": 8}, "key 'qkvv'"),
        ({"o": 0}, "o=0"),
        ({"RING_STAGES": 2.5}, "RING_STAGES=2.5"),
        ('{"o": "8"}', "o='8'"),
    ],
)
def test_configure_rejects_bad_settings(restore, spec, message):
    before = cuda_small.configure({"qkv": 4})
    with pytest.raises(ValueError, match=message):
        cuda_small.configure(spec)
    assert cuda_small.config() == before, "a refused setting changed nothing"


def test_experts_by_pairs_rule():
    limit = cuda_small.PAIRS_MAX_BATCH
    assert cuda_small.experts_by_pairs(limit) and not cuda_small.experts_by_pairs(limit + 1)


def test_gate_up_rejects_mixed_or_missing_routing():
    import torch

    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(4, 32, 64, dtype=torch.bfloat16)
    act = torch.zeros(2, 16, dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    sp, be = torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="not both"):
        cuda_small.moe_gate_up(x, w, sp, be, act, top_k=2, topk_ids=ids)
    with pytest.raises(ValueError, match="needs sorted_pair and block_expert, or topk_ids"):
        cuda_small.moe_gate_up(x, w, None, be, act, top_k=2)
    with pytest.raises(ValueError, match="topk_ids"):
        cuda_small.moe_gate_up(x, w, None, None, act, top_k=2, topk_ids=ids.view(2, 1))


def test_configure_site_stages(restore):
    cfg = cuda_small.configure({"down_stages": 6, "gate_up_stages": 4})
    assert cfg["down_stages"] == 6 and cuda_small.STAGES == {"down": 6, "gate_up": 4}
    # down: K = 768 on one warp, 24 chunks in stages of 4: up to 6 stages
    assert cuda_small.split_k(768, 1, stages=cuda_small.STAGES["down"]).ns == 6
    assert cuda_small.split_k(768, 1, stages=8).ns == 6, "at most one stage per round"
    cuda_small.configure({})
    assert cuda_small.STAGES == {}, "each call replaces the site stages"
    with pytest.raises(ValueError, match="key 'o_stages'"):
        cuda_small.configure({"o_stages": 2})


def test_gemv_supported_shapes():
    assert cuda_small.gemv_supported(2048, 4096)
    assert not cuda_small.gemv_supported(2040, 4096)  # not whole 16-row tiles
    assert not cuda_small.gemv_supported(2048, 4080)  # not whole 32-wide chunks
    assert not cuda_small.gemv_supported(0, 4096)


def test_step_gemv_sites(monkeypatch):
    """The standard step's GEMV projections: AUTO_STEP_GEMV up to AUTO_STEP_GEMV_MAX_BATCH
    tokens; none where the GEMV cannot run (CPU device, no CuPy) or the shape does not fit."""
    from trace_common.kernels import engine

    shape = engine.EngineShape.named()
    monkeypatch.setattr("trace_common.kernels.engine.cupy_available", lambda: True)
    assert {"o", "router"} == engine.AUTO_STEP_GEMV
    assert engine.step_gemv_sites(shape, 1, "cuda") == engine.AUTO_STEP_GEMV
    assert engine.step_gemv_sites(shape, engine.AUTO_STEP_GEMV_MAX_BATCH, "cuda") == {"o", "router"}
    assert engine.step_gemv_sites(shape, engine.AUTO_STEP_GEMV_MAX_BATCH + 1, "cuda") == set()
    assert engine.step_gemv_sites(shape, 8, "cpu") == frozenset()
    odd = engine.EngineShape.named(num_experts=8, top_k=2)  # an 8-row router is not a whole tile
    assert engine.step_gemv_sites(odd, 2, "cuda") == {"o"}
    monkeypatch.setattr("trace_common.kernels.engine.cupy_available", lambda: False)
    assert engine.step_gemv_sites(shape, 8, "cuda") == frozenset()


def test_gemv_rejects_token_counts_and_pdl():
    import torch

    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    for t in (0, cuda_small.GEMV_MAX_TOKENS + 1):
        x = torch.zeros(t, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=f"{t} tokens"):
            cuda_small.gemv(x, w, torch.zeros(t, 32, dtype=torch.bfloat16))
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not launched with PDL"):
        cuda_small.gemv(x, w, torch.zeros(16, 32, dtype=torch.bfloat16), pdl=True)
