"""E2M1 spec tables: all 16 codes, ties to even, saturation, packing as binary literals."""

from __future__ import annotations

import pytest
import torch

from trace_common.fp4.constants import E2M1_VALUES, F4_E2M1_MAX
from trace_common.fp4.e2m1 import (
    e2m1_to_f32,
    f32_to_e2m1,
    pack_bits,
    pack_uint4,
    packed_values,
    unpack_bits,
    unpack_uint4,
)

# code -> value, written out from the E2M1 spec (sign bit 3, exponent bits 2-1, mantissa bit 0).
SPEC_TABLE = {
    0b0000: 0.0,
    0b0001: 0.5,
    0b0010: 1.0,
    0b0011: 1.5,
    0b0100: 2.0,
    0b0101: 3.0,
    0b0110: 4.0,
    0b0111: 6.0,
    0b1000: 0.0,  # -0 decodes to +0.0 (ModelOpt's table)
    0b1001: -0.5,
    0b1010: -1.0,
    0b1011: -1.5,
    0b1100: -2.0,
    0b1101: -3.0,
    0b1110: -4.0,
    0b1111: -6.0,
}


def test_decode_all_16_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    got = e2m1_to_f32(codes).tolist()
    assert got == [SPEC_TABLE[c] for c in range(16)]
    assert list(E2M1_VALUES) == [SPEC_TABLE[c] for c in range(16)]
    # +0.0, never -0.0, for the negative-zero code
    assert torch.signbit(e2m1_to_f32(torch.tensor([0b1000], dtype=torch.uint8))).item() is False


def test_encode_every_grid_value_exactly() -> None:
    for code, value in SPEC_TABLE.items():
        if code == 0b1000:
            continue
        assert f32_to_e2m1(torch.tensor([value])).item() == code, value


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (0.25, 0b0000),  # tie 0 | 0.5 -> 0 (even)
        (0.75, 0b0010),  # tie 0.5 | 1 -> 1
        (1.25, 0b0010),  # tie 1 | 1.5 -> 1
        (1.75, 0b0100),  # tie 1.5 | 2 -> 2
        (2.5, 0b0100),  # tie 2 | 3 -> 2
        (3.5, 0b0110),  # tie 3 | 4 -> 4
        (5.0, 0b0110),  # tie 4 | 6 -> 4
        (-0.75, 0b1010),
        (-2.5, 0b1100),
        (-5.0, 0b1110),
    ],
)
def test_ties_to_even(value: float, code: int) -> None:
    assert f32_to_e2m1(torch.tensor([value])).item() == code


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (0.2500001, 0b0001),
        (0.7499999, 0b0001),
        (1.2500001, 0b0011),
        (2.4999998, 0b0100),
        (2.5000002, 0b0101),
        (4.9999995, 0b0110),
        (5.0000005, 0b0111),
        (-0.1, 0b1000),  # negative values rounding to zero keep the sign bit (ModelOpt)
        (-0.0, 0b0000),
    ],
)
def test_round_to_nearest_off_ties(value: float, code: int) -> None:
    assert f32_to_e2m1(torch.tensor([value], dtype=torch.float32)).item() == code


def test_saturation() -> None:
    x = torch.tensor([F4_E2M1_MAX, 6.5, 100.0, 3.4e38, float("inf"), -7.0, float("-inf")])
    assert f32_to_e2m1(x).tolist() == [0b0111] * 5 + [0b1111] * 2


def test_nan_is_refused_with_index() -> None:
    with pytest.raises(ValueError, match=r"NaN at index \(2,\)"):
        f32_to_e2m1(torch.tensor([1.0, 2.0, float("nan")]))


def test_encode_rejects_integer_dtype() -> None:
    with pytest.raises(TypeError, match="int64"):
        f32_to_e2m1(torch.tensor([1, 2]))


def test_encode_decode_roundtrip_bf16_input() -> None:
    x = torch.tensor([0.5, -1.5, 3.0, -6.0], dtype=torch.bfloat16)
    assert e2m1_to_f32(f32_to_e2m1(x)).tolist() == [0.5, -1.5, 3.0, -6.0]


def test_pack_uint4_even_element_low_nibble() -> None:
    codes = torch.tensor([0b0001, 0b1010, 0b1111, 0b0000], dtype=torch.uint8)
    packed = pack_uint4(codes)
    assert packed.tolist() == [0b1010_0001, 0b0000_1111]
    assert unpack_uint4(packed).tolist() == codes.tolist()


def test_pack_uint4_roundtrip_all_pairs() -> None:
    codes = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).reshape(1, -1)
    packed = pack_uint4(codes)
    assert packed.shape == (1, 256)
    assert packed.flatten().tolist() == [(hi << 4) | lo for lo in range(16) for hi in range(16)]
    assert torch.equal(unpack_uint4(packed), codes)


def test_pack_uint4_errors() -> None:
    with pytest.raises(ValueError, match=r"even last dim.*\(3,\)"):
        pack_uint4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="code 16"):
        pack_uint4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(TypeError, match="int32"):
        pack_uint4(torch.zeros(2, dtype=torch.int32))


def test_pack_bits_little_endian_bit_order() -> None:
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.uint8)
    packed = pack_bits(bits)
    assert packed.tolist() == [0b0000_0001, 0b1000_0110]
    assert unpack_bits(packed).tolist() == bits.tolist()


def test_pack_bits_errors() -> None:
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_bits(torch.zeros(12, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0/1 values, got max 2"):
        pack_bits(torch.tensor([2, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8))


def test_packed_values_decodes_every_code_pair_as_unpack_then_decode() -> None:
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)  # every byte: all code pairs
    want = e2m1_to_f32(unpack_uint4(packed))
    got = packed_values(packed)
    assert got.dtype == torch.float32 and got.shape == (4, 128)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 included
