"""Named constants of the FP4 formats (E2M1 elements, NVFP4 and MXFP4 scales).

Every magic number of the FP4 numerics lives here, with its bit pattern or meaning, so the
rest of `trace_common.fp4` never writes a bare 6.0 or 448.0.
"""

from __future__ import annotations

# --- E2M1 element: 1 sign bit (bit 3), 2 exponent bits (bias 1), 1 mantissa bit (bit 0) ---
F4_E2M1_MAX = 6.0  # 0b0111: largest magnitude; larger inputs saturate to it
F4_E2M1_MIN_NORMAL = 1.0  # 0b0010
F4_E2M1_MIN_SUBNORMAL = 0.5  # 0b0001: the only subnormal
F4_E2M1_SIGN_BIT = 0b1000  # bit 3 of a code is the sign; 0b1000 is -0
F4_E2M1_MAGNITUDE_MASK = 0b0111  # bits 0-2: index into E2M1_MAGNITUDES
F4_E2M1_MANTISSA_BIT = 0b0001  # bit 0: alternates along the magnitude ladder
F4_E2M1_NUM_CODES = 16

# Magnitude of codes 0b000 .. 0b111 (the ladder 0, .5, 1, 1.5, 2, 3, 4, 6).
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Value of each of the 16 codes. Code 0b1000 ("-0") decodes to +0.0, as in NVIDIA ModelOpt's
# decode table, so dequantized tensors are bit-identical to ModelOpt's (no -0.0 appears).
E2M1_VALUES: tuple[float, ...] = (*E2M1_MAGNITUDES, 0.0, *(-m for m in E2M1_MAGNITUDES[1:]))

# Round-to-nearest-even decision boundaries between consecutive magnitudes (midpoints).
# A magnitude exactly on a boundary goes to the even-mantissa neighbour: the boundaries after
# an odd-mantissa code (0.75, 1.75, 3.5) round up, the others (0.25, 1.25, 2.5, 5.0) round down.
E2M1_RNE_BOUNDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_BOUND_TIES_UP: tuple[bool, ...] = (False, True, False, True, False, True, False)

# --- FP8 E4M3 (float8_e4m3fn): the NVFP4 block scale ---
F8E4M3_MAX = 448.0  # 0b0_1111_110: largest finite e4m3fn value
F8E4M3_MIN_SUBNORMAL = 2.0**-9  # 0b0_0000_001: smallest positive e4m3fn value
# ModelOpt clamps block scales into [2**-9, 448] before the e4m3 cast (never 0, never NaN).
NVFP4_BLOCK_SCALE_MIN = F8E4M3_MIN_SUBNORMAL
NVFP4_BLOCK_SCALE_MAX = F8E4M3_MAX
# Block scale used for an all-zero block (its amax is 0, so any scale encodes it exactly).
NVFP4_ZERO_BLOCK_SCALE = 1.0
# Second-level (per-tensor / per-row) fp32 scale used when the amax is 0 (an all-zero tensor or
# row): ModelOpt would divide 0 by 0 there and emit NaN scales; TRACE uses 1.0 (as
# TransformerEngine's reference does), so every element encodes as code 0.
NVFP4_ZERO_AMAX_SCALE_2 = 1.0

# --- Block sizes ---
NVFP4_BLOCK_SIZE = 16  # elements per e4m3 block scale, along the last dim
MXFP4_BLOCK_SIZE = 32  # elements per e8m0 block scale, along the last dim (OCP MX v1.0)

# --- E8M0 (MX shared scale): 8 exponent bits, no sign, no mantissa, value 2**(bits - 127) ---
E8M0_EXPONENT_BIAS = 127
E8M0_NAN = 0xFF  # the only special encoding; never produced by the quantizer
E8M0_MIN_EXPONENT = -127  # bits 0x00 -> 2**-127
E8M0_MAX_EXPONENT = 127  # bits 0xFE -> 2**127
# floor(log2(F4_E2M1_MAX)) = 2: the OCP MX shared exponent is floor(log2(amax)) - 2.
F4_E2M1_EMAX = 2

# --- fp32 bit layout (used to take floor(log2|x|) exactly from the exponent field) ---
F32_MANTISSA_BITS = 23
F32_EXPONENT_MASK = 0xFF
F32_EXPONENT_BIAS = 127
