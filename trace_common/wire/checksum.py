"""CRC-32 of record and tensor bytes (the zlib polynomial, same values as `zlib.crc32`).

zlib-ng computes it with carry-less multiply instructions (PCLMULQDQ/VPCLMULQDQ): measured
0.08 ms per 4 MiB here vs 0.7-1.0 ms for the stdlib's zlib, which made the four checks of
a quant-cache put+get (client, service in, service out, client) a large part of its time.
Falls back to the stdlib if the `zlib-ng` wheel is missing; the values are identical, so
either side of a transfer may use either.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a declared dependency
    from zlib import crc32

__all__ = ["crc32"]
