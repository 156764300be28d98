"""cuda_launch's programmatic-dependent-launch plumbing, without a GPU: the TRACE_PDL switch,
the ctypes mirrors of cuda.h's launch structures, and argument checking before any driver call.
The launches themselves run in tests/unit/gpu/test_small_batch_gpu.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from trace_common.kernels import cuda_launch


def test_pdl_switch(monkeypatch):
    monkeypatch.setenv("TRACE_PDL", "sometimes")
    with pytest.raises(ValueError, match="TRACE_PDL='sometimes'"):
        cuda_launch.pdl_enabled()
    assert cuda_launch.pdl_enabled("off") is False
    monkeypatch.setattr(cuda_launch.torch.cuda, "is_available", lambda: False)
    assert cuda_launch.pdl_enabled("on") is False  # no GPU: never on


def test_launch_structures_match_cuda_h():
    """sizeof / offsetof of CUlaunchAttribute and CUlaunchConfig (cuda.h, CUDA 12.0-13.0 on
    x86-64, printed by a C program compiled against /usr/local/cuda-13.0/include/cuda.h)."""
    a, c = cuda_launch._LaunchAttribute, cuda_launch._LaunchConfig
    assert (ctypes.sizeof(a), a.value.offset) == (72, 8)
    offsets = (c.stream.offset, c.attrs.offset, c.num_attrs.offset)
    assert (ctypes.sizeof(c), *offsets) == (56, 32, 40, 48)
    attr = a(id=cuda_launch._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    raw = bytes(attr)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")


def test_launch_pdl_rejects_unknown_argument_before_the_driver(monkeypatch):
    def no_driver():
        raise AssertionError("the driver must not be reached")

    monkeypatch.setattr(cuda_launch, "_driver", no_driver)
    with pytest.raises(TypeError, match="not a numpy scalar"):
        cuda_launch.launch_pdl(None, (1,), (32,), (np.uint64(0), 3), stream=0)
