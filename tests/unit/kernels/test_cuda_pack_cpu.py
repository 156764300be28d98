"""CPU tests of the CUDA FP4 expert GEMM's data layouts (the kernel itself runs in
tests/unit/gpu): weight packing + the kernel's decode formulas reproduce every code at its
mma.sync A-fragment position, scales land where the kernel reads them, and the activation
B-fragment permutation. Importing the wrapper needs no CuPy and no GPU."""

from __future__ import annotations

import pytest
import torch

from trace_common.kernels import cuda_moe, moe_layout

# fp16 bits of E2M1 code c times 2**-14 (the kernel's decode): sign -> bit 15, e1 e0 m -> 11..9
E2M1_FP16_BITS = [(c & 8) << 12 | (c & 7) << 9 for c in range(16)]


def test_fp16_bit_trick_is_value_times_2_pow_minus_14():
    from trace_common.fp4.constants import E2M1_VALUES

    assert E2M1_FP16_BITS[0b1011] == 0b1_00001_1000000000  # -1.5 * 2**-14
    bits = torch.tensor(E2M1_FP16_BITS, dtype=torch.int32).to(torch.int16)
    vals = bits.view(torch.float16).float() * 2.0**14
    assert torch.equal(vals, torch.tensor(E2M1_VALUES)), "code -> fp16 * 2**14 != E2M1 value"


def test_pack_bits_partition_the_word():
    lut = moe_layout._slot_lut("cpu")  # [8 slots, 16 codes]
    full = lut[:, 15]  # code 0b1111 sets all 4 bits of its slot
    assert int(full.sum()) == 0xFFFFFFFF, "slots must cover all 32 bits"
    for i in range(8):
        for j in range(i):
            assert int(full[i]) & int(full[j]) == 0, f"slots {i} and {j} overlap"


@pytest.mark.parametrize("e,n,k", [(2, 32, 128), (3, 48, 64)])
def test_pack_and_decode_give_each_fragment_element(e, n, k):
    g = torch.Generator().manual_seed(e * n + k)
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 127, (e, n, k // 16), dtype=torch.uint8, generator=g)
    p = moe_layout.pack_fp4_weights(codes, scales, chunk=2)
    assert p.words.shape == (e, n // 16, k // 64, 32, 4)
    nib = torch.stack((codes & 15, codes >> 4), -1).reshape(e, n, k).long()
    want_bits = torch.tensor(E2M1_FP16_BITS)[nib]  # [e, n, k]
    got = cuda_moe.decode_packed_reference(p.words)  # [e, tile, kg, lane, q, reg, half]
    for lane in (0, 5, 31):
        gg, t = lane // 4, lane % 4
        for r in range(4):
            row = gg + 8 * (r & 1)
            for h in range(2):
                col = 2 * t + 8 * (r >> 1) + h
                for q in range(4):
                    ref = want_bits.reshape(e, n // 16, 16, k // 64, 4, 16)[:, :, row, :, q, col]
                    assert torch.equal(got[:, :, :, lane, q, r, h], ref), (lane, r, h, q)
    # scales: lane group g reads (row g, row g+8) of k-tile q as bytes 2q, 2q+1 of its 8
    sb = p.scales.view(torch.uint8).reshape(e, n // 16, k // 64, 8, 4, 2)
    ref_s = scales.reshape(e, n // 16, 2, 8, k // 64, 4).permute(0, 1, 4, 3, 5, 2)
    assert torch.equal(sb, ref_s)


def test_pack_rejects_bad_shapes():
    with pytest.raises(ValueError, match="N=24"):
        moe_layout.pack_fp4_weights(torch.zeros(1, 24, 32, dtype=torch.uint8),
                                  torch.zeros(1, 24, 4, dtype=torch.uint8))  # fmt: skip


def test_dq16_permutation_is_the_b_fragment_order():
    perm = cuda_moe.dq16_permutation()
    assert sorted(perm.tolist()) == list(range(16))
    for t in range(4):  # lane quad t reads halves 4t..4t+3: elements 2t, 2t+1, 2t+8, 2t+9
        inv = {int(perm[kk]): kk for kk in range(16)}
        assert [inv[4 * t + i] for i in range(4)] == [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]


def _kernel_row(p: torch.Tensor, a_mul: int) -> torch.Tensor:
    """moe_fp4.cu pair_row in 64-bit integer arithmetic: umulhi(p, low word) + p * high word,
    truncated to 32 bits as the kernel's u32 sum is."""
    lo, hi = a_mul & 0xFFFFFFFF, a_mul >> 32
    return (((p * lo) >> 32) + p * hi) & 0xFFFFFFFF


@pytest.mark.parametrize("a_div", [1, 2, 3, 6, 7, 8, 10, 128, 255, 256])
def test_row_multiplier_gives_the_quotient(a_div):
    """pair // a_div from the multiplier at every pair of small plans and across the whole range
    the check admits (its end included)."""
    n = (1 << 32) // a_div
    m = cuda_moe.row_multiplier(a_div, n)
    g = torch.Generator().manual_seed(a_div)
    p = torch.cat([torch.arange(0, 70000), torch.randint(0, n, (200000,), generator=g),
                   torch.tensor([n - 1, n - 2, n // 2])]).long()  # fmt: skip
    assert torch.equal(_kernel_row(p, m), p // a_div)


def test_row_multiplier_checks():
    with pytest.raises(ValueError, match="a_div=0"):
        cuda_moe.row_multiplier(0, 8)
    with pytest.raises(ValueError, match="a_div=8 with 1073741824 pairs"):
        cuda_moe.row_multiplier(8, 1 << 30)


def test_block_m_and_configs():
    assert cuda_moe.block_m_for(8, 128) == 8  # batch 1, top-8
    assert cuda_moe.block_m_for(256, 128) == 8  # batch 32
    assert cuda_moe.block_m_for(1024, 128) == 16  # batch 128
    for (k, bm, gated), (rw, wk, kgw, _minb) in cuda_moe.CONFIGS.items():
        assert wk * kgw * moe_layout.K_GROUP == k and bm in cuda_moe.BLOCK_MS
        assert cuda_moe.smem_bytes(bm, rw, wk, gated) <= cuda_moe.SMEM_LIMIT
    rw, wk, kgw, _ = cuda_moe.default_config(512, 8, gated=False)
    assert wk * kgw * 64 == 512


def test_small_step_fp4_fusions():
    from trace_common.kernels import cuda_small

    assert {"pdl", "xq", "act", "kv_attn"} == cuda_small.FP4_FUSE


@pytest.fixture
def overrides(tmp_path):
    """Apply a launch-config file's overrides (through KernelSettings, as the engine does);
    the built-in tables again afterwards."""
    from trace_common.kernels.settings import KernelSettings

    def apply(text: str) -> None:
        f = tmp_path / "cfg.json"
        f.write_text(text)
        KernelSettings(expert_gemm_configs=f).apply()

    yield apply
    KernelSettings().apply()


def test_config_override_file(overrides):
    overrides('{"2048,8,True": [2, 16, 2, 2]}')
    assert cuda_moe.default_config(2048, 8, True) == (2, 16, 2, 2)
    assert cuda_moe.default_config(768, 8, False) == cuda_moe.CONFIGS[(768, 8, False)]


def test_gemm_impl_validation():
    from trace_common.kernels import cupy_available, fp4_gemm_impl

    with pytest.raises(ValueError, match="'cutlass'"):
        fp4_gemm_impl("cutlass")
    assert fp4_gemm_impl("triton") == "triton"
    assert fp4_gemm_impl() == ("cuda" if cupy_available() else "triton")


def _fp4_bytes(w: int) -> tuple[int, int]:
    """attn_fp4.cu's `fp4_bytes` in Python: word of 8 codes -> (bytes of codes 0,2,4,6; of
    codes 1,3,5,7), each byte the high byte of the code's fp16 decode."""
    m = 0xFFFFFFFF
    lo = ((w << 4) & 0x80808080) | ((w << 1) & 0x0E0E0E0E)
    hi = (w & 0x80808080) | ((w >> 3) & 0x0E0E0E0E)
    return lo & m, hi & m


@pytest.mark.parametrize("pos", range(8))
def test_attention_decode_formula_every_code_every_position(pos):
    """Every code at every nibble of a word comes out as its fp16 bits (value * 2**-14) in the
    byte the attention kernel reads it from, with the other nibbles set to anything."""
    g = torch.Generator().manual_seed(pos)
    for c in range(16):
        for _ in range(4):
            w = int(torch.randint(0, 1 << 32, (1,), generator=g, dtype=torch.int64))
            w = (w & ~(0xF << (4 * pos))) | (c << (4 * pos))
            lo, hi = _fp4_bytes(w)
            byte = ((hi if pos % 2 else lo) >> (8 * (pos // 2))) & 0xFF
            assert byte << 8 == E2M1_FP16_BITS[c], f"code {c:#x} at nibble {pos}"


def test_attn_impl_validation():
    from trace_common.kernels import cupy_available, fp4_attn_impl

    with pytest.raises(ValueError, match="'flash'"):
        fp4_attn_impl("flash")
    assert fp4_attn_impl("triton") == "triton"
    assert fp4_attn_impl() == ("cuda" if cupy_available() else "triton")


def test_no_cupy_at_import_time():
    """The kernel packages import without pulling in CuPy (it is imported at first launch)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import trace_common.kernels, trace_common.kernels.attention, trace_common.kernels.engine\n"
        "import trace_common.kernels.cuda_attn, trace_common.kernels.cuda_moe\n"
        "import trace_common.kernels.cuda_launch\n"
        "assert 'cupy' not in sys.modules, 'cupy imported at import time'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stream_configs_fit():
    """Every streaming config (shipped, swept, or derived for another shape) tiles K exactly,
    copies its scales with <= 32 lanes and fits the opt-in shared memory of one CTA."""
    import bench.experiments.rollout_gpu_kernels as bench

    cases = [(key, cfg) for key, cfg in cuda_moe.STREAM_CONFIGS.items()]
    for bm in cuda_moe.BLOCK_MS:
        cases += [((2048, bm, True), c) for c in bench.SWEEP_STREAM_GATE_UP]
        cases += [((768, bm, False), c) for c in bench.SWEEP_STREAM_DOWN]
    for k, n_out, gated in [
        (512, 256, True),
        (256, 512, False),
        (2048, 768, True),
        (64, 16, False),
    ]:
        for bm in cuda_moe.BLOCK_MS:
            cases.append(((k, bm, gated), cuda_moe.default_stream_config(k, bm, gated, n_out)))
            rw = cases[-1][1][0]
            assert (n_out // 16) % rw == 0
    for (k, bm, gated), (rw, wk, kgw, stages, _minb) in cases:
        assert wk * kgw * moe_layout.K_GROUP == k and kgw * 4 <= 32 and stages >= 2
        smem = cuda_moe.stream_smem_bytes(bm, rw, wk, kgw, stages, gated)
        assert smem <= cuda_moe.STREAM_SMEM_MAX, (k, bm, gated, rw, wk, kgw, stages)


def test_stream_grid_covers_every_item_in_one_wave():
    for n_items in (1, 7, 24, 48, 128):
        for est in (1.0, 8.0, 50.0, 112.0, 128.5, 200.0):
            for ctas in (1, 2, 3):
                gy, ipc = cuda_moe.stream_grid(n_items, est, ctas, 132)
                assert gy * ipc >= n_items and (gy - 1) * ipc < n_items  # no empty CTA column
                assert gy == 1 or gy * est <= 132 * ctas  # one wave for the expected blocks
    assert cuda_moe.stream_grid(48, 8.0, 2, 132) == (24, 2)  # batch 1 gate_up, 1 tile/item


def test_expected_blocks():
    assert cuda_moe.expected_blocks(1, 8, 128, 8, 16) == pytest.approx(8.0)
    assert 105 < cuda_moe.expected_blocks(32, 8, 128, 8, 384) < 115
    assert cuda_moe.expected_blocks(128, 8, 128, 16, 192) == pytest.approx(128, rel=0.01)
    assert cuda_moe.expected_blocks(1000, 8, 16, 16, 516) == 500  # pairs / block_m


def test_cuda_kernel_validation():
    with pytest.raises(ValueError, match="'marlin'"):
        cuda_moe.cuda_kernel("marlin")
    with pytest.raises(ValueError, match="'tma'"):
        cuda_moe.cuda_kernel("tma")
    assert cuda_moe.cuda_kernel("stream") == "stream"
    assert cuda_moe.cuda_kernel() == cuda_moe.DEFAULT_CUDA_KERNEL


def test_config_override_file_stream(overrides):
    overrides('{"2048,8,True": [1, 16, 2, 3, 1], "768,8,False": [4, 4, 3, 0]}')
    assert cuda_moe.default_stream_config(2048, 8, True, 768) == (1, 16, 2, 3, 1)
    assert cuda_moe.default_stream_config(768, 8, False, 2048) == cuda_moe.STREAM_CONFIGS[
        (768, 8, False)]  # fmt: skip
    assert cuda_moe.default_config(768, 8, False) == (4, 4, 3, 0)


def test_cuda_kernel_per_shape(overrides):
    """The kernel follows KERNEL_FOR per shape; an override file's config length picks the
    kernel for its shapes; the argument forces one."""
    for key, kern in cuda_moe.KERNEL_FOR.items():
        assert cuda_moe.cuda_kernel(key=key) == kern
        assert key in cuda_moe.CONFIGS and key in cuda_moe.STREAM_CONFIGS
    assert cuda_moe.cuda_kernel(key=(512, 8, True)) == cuda_moe.DEFAULT_CUDA_KERNEL
    many = cuda_moe.WG_MAX_PAIRS + 8  # past them the 16-slot default is the stream kernel
    assert cuda_moe.cuda_kernel(key=(2048, 16, True), n_pairs=cuda_moe.WG_MAX_PAIRS) == "wg"
    assert cuda_moe.cuda_kernel(key=(2048, 16, True), n_pairs=many) == "stream"
    assert cuda_moe.cuda_kernel("wg", key=(2048, 16, True), n_pairs=many) == "wg"
    assert cuda_moe.cuda_kernel(key=(2048, 8, True), n_pairs=many) == "mma"
    overrides('{"2048,8,True": [1, 8, 4, 4, 2], "2048,16,True": [2, 8, 4, 2]}')
    assert cuda_moe.cuda_kernel(key=(2048, 8, True)) == "stream"
    assert cuda_moe.cuda_kernel(key=(2048, 16, True)) == "mma"
    assert cuda_moe.cuda_kernel(key=(768, 8, False)) == cuda_moe.KERNEL_FOR[(768, 8, False)]
    assert cuda_moe.cuda_kernel("mma", key=(2048, 8, True)) == "mma"
    assert cuda_moe.cuda_kernel("stream", key=(2048, 16, True)) == "stream"
    with pytest.raises(ValueError, match="not 'K,block_m,gated': 3, 4 or 5"):
        overrides('{"2048,8,True": [1, 8], "768,16,False": [3, 3, 2]}')
    overrides('{"768,16,False": [3, 3, 2]}')
    assert cuda_moe.cuda_kernel(key=(768, 16, False)) == "wg"
    assert cuda_moe.cuda_kernel(key=(768, 8, False)) == cuda_moe.KERNEL_FOR[(768, 8, False)]


def test_sm_resources_cpu_device():
    """Launch plans built for a CPU device (CPU tests) use an H200's SM resources."""
    from trace_common.kernels.cuda_launch import sm_resources

    assert sm_resources("cpu") == (132, 228 * 1024, 65536, 2048)


def test_compiled_function_smem_opt_in(monkeypatch, tmp_path):
    """compiled_function compiles a kernel once and raises its dynamic shared-memory limit to
    what a launch takes, only upwards (with static shared memory a launch may pass 48 KB
    below 48 KB of dynamic; CuPy faked: no GPU here)."""
    from types import SimpleNamespace

    from trace_common.kernels import cuda_launch

    compiled = []

    class Fn:
        def compile(self):
            compiled.append(1)

    class RawModule:
        def __init__(self, **kw):
            self.fn = Fn()

        def get_function(self, name):
            return self.fn

    monkeypatch.setattr(cuda_launch, "require_cupy", lambda: SimpleNamespace(RawModule=RawModule))
    monkeypatch.setattr(cuda_launch, "_MODULES", {})
    monkeypatch.setattr(cuda_launch, "_SMEM_ALLOWED", {})
    src = tmp_path / "k.cu"
    src.write_text("// a kernel")
    fn = cuda_launch.compiled_function(src, "k<1>")
    assert not hasattr(fn, "max_dynamic_shared_size_bytes")
    assert cuda_launch.compiled_function(src, "k<1>", 40 * 1024) is fn
    assert fn.max_dynamic_shared_size_bytes == 40 * 1024
    cuda_launch.compiled_function(src, "k<1>", 100_000)
    assert fn.max_dynamic_shared_size_bytes == 100_000
    cuda_launch.compiled_function(src, "k<1>", 60_000)
    assert fn.max_dynamic_shared_size_bytes == 100_000  # never lowered
    cuda_launch.compiled_function(src, "k<1>", 120_000)
    assert fn.max_dynamic_shared_size_bytes == 120_000
    assert len(compiled) == 1


def test_block_m_for_rule():
    assert cuda_moe.block_m_for(5 * 128, 128) == 8
    assert cuda_moe.block_m_for(5 * 128 + 1, 128) == 16


def test_wg_configs_fit():
    """Every warpgroup-MMA config (moe_fp4_wg) splits K into whole stages of >= 2 k groups,
    tiles N_out into 64-feature items and fits the opt-in shared memory; off sm_90 (here: a CPU
    device) the per-shape default falls back to the stream kernel."""
    for (k, bm, gated), (kgw, stages, nwg) in cuda_moe.WG_CONFIGS.items():
        assert k % (moe_layout.K_GROUP * kgw) == 0 and 2 <= kgw <= 8 and stages >= 2
        n_out = 768 if gated else 2048
        assert n_out % 64 == 0 and 1 <= nwg <= 8 and bm in cuda_moe.BLOCK_MS
        assert cuda_moe.wg_smem_bytes(k, kgw, stages, gated, nwg, bm) <= cuda_moe.STREAM_SMEM_MAX
        assert cuda_moe.KERNEL_FOR[(k, bm, gated)] == "wg"
    # B (block_m rows of K fp16) + 4 warps x NWG x S stages x (gate + up) x KGW groups of 576 B
    assert cuda_moe.wg_smem_bytes(2048, 4, 2, True, 3) == 65536 + 12 * 2 * 2 * 4 * 576
    assert cuda_moe.wg_smem_bytes(2048, 4, 2, True, 3, 8) == 32768 + 12 * 2 * 2 * 4 * 576
    assert not cuda_moe.wg_supported(torch.device("cpu"))


def test_block_count_moments_match_sampled_routing():
    """The expert-block count's mean (exact for independent experts) and variance (an upper
    bound: the experts' counts are negatively correlated) against 2000 sampled uniform top-8
    routings of 128 experts."""
    g = torch.Generator().manual_seed(0)
    for t, bm in ((1, 8), (80, 8), (192, 16)):
        ids = torch.rand(2000, t, 128, generator=g).topk(8, dim=-1).indices.reshape(2000, -1)
        cnt = torch.zeros(2000, 128, dtype=torch.long).scatter_add_(1, ids, torch.ones_like(ids))
        blocks = ((cnt + bm - 1) // bm).sum(1).double()
        mean, var = cuda_moe.block_count_moments(t, 8, 128, bm)
        assert abs(mean - float(blocks.mean())) < 0.01 * mean + 0.1, (t, mean, blocks.mean())
        assert var >= 0.9 * float(blocks.var()), (t, var, blocks.var())
    assert cuda_moe.block_count_moments(5, 128, 128, 16) == (128.0, 0.0)  # every expert chosen


def test_wave_grid():
    """One CTA per block while the blocks fit one wave of resident CTAs; split blocks when a
    second, nearly empty wave is likely; every split covers the block's items."""
    assert cuda_moe.wave_grid(12, 128.3, 0.4, 132, 192) == (1, 12)  # batch 128, 16 slots
    gy, ipc = cuda_moe.wave_grid(12, 140.1, 10.9, 132, 224)  # batch 192: ~140 blocks
    assert gy > 1 and gy * ipc >= 12 and (gy - 1) * ipc < 12
    assert cuda_moe.wave_grid(12, 8.0, 0.0, 132, 16) == (12, 1)  # batch 1: one item per CTA
    for n_items in (12, 32):
        for mean in (8.0, 60.0, 131.0, 150.0, 250.0):
            gy, ipc = cuda_moe.wave_grid(n_items, mean, mean / 10, 264, 400)
            assert gy * ipc >= n_items and (gy - 1) * ipc < n_items
