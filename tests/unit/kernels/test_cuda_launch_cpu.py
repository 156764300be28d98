"""cuda_launch's cuLaunchKernelEx plumbing (PDL, clusters), without a GPU: the PDL default,
the ctypes mirrors of cuda.h's launch structures, and argument checking before any driver call.
The launches themselves run in tests/unit/gpu/test_small_batch_gpu.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from trace_common.kernels import cuda_launch


def test_pdl_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(cuda_launch.torch.cuda, "is_available", lambda: False)
    assert cuda_launch.pdl_enabled() is False  # no GPU: never on


def test_launch_structures_match_cuda_h():
    """sizeof / offsetof of CUlaunchAttribute and CUlaunchConfig (cuda.h, CUDA 12.0-13.0 on
    x86-64, printed by a C program compiled against /usr/local/cuda-13.0/include/cuda.h)."""
    a, c = cuda_launch._LaunchAttribute, cuda_launch._LaunchConfig
    assert (ctypes.sizeof(a), a.value.offset) == (72, 8)
    offsets = (c.stream.offset, c.attrs.offset, c.num_attrs.offset)
    assert (ctypes.sizeof(c), *offsets) == (56, 32, 40, 48)
    attr = a(id=cuda_launch._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    raw = bytes(attr)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")
    # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4, value.clusterDim = {x, y, z} (uint each)
    attr = a(id=cuda_launch._CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attr.value[0], attr.value[1], attr.value[2] = 8, 1, 1
    raw = bytes(attr)
    assert raw[:4] == (4).to_bytes(4, "little")
    assert raw[8:20] == b"".join(v.to_bytes(4, "little") for v in (8, 1, 1))


@pytest.mark.parametrize("cluster,grid", [(9, 9), (4, 6)])
def test_launch_rejects_bad_cluster_before_the_driver(monkeypatch, cluster, grid):
    def no_driver():
        raise AssertionError("the driver must not be reached")

    monkeypatch.setattr(cuda_launch, "_driver", no_driver)
    with pytest.raises(ValueError, match=f"cluster={cluster}: needs 1..8 CTAs dividing"):
        cuda_launch.launch_ex(None, (grid,), (32,), (), stream=0, cluster=cluster)


def test_launch_ex_rejects_unknown_argument_before_the_driver(monkeypatch):
    def no_driver():
        raise AssertionError("the driver must not be reached")

    monkeypatch.setattr(cuda_launch, "_driver", no_driver)
    with pytest.raises(TypeError, match="not a numpy scalar"):
        cuda_launch.launch_ex(None, (1,), (32,), (np.uint64(0), 3), stream=0)


def test_launch_wraps_torch_stream_per_device(monkeypatch):
    """launch_on_torch_stream launches inside a CuPy wrapper of PyTorch's current stream, made
    once per (stream handle, device) through the CUDA stream protocol (Stream.from_external)
    under that device (the legacy default stream is handle 0 on every device); CuPy faked."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    made, devices, launched = [], [], []

    class FakeStream:
        def __init__(self, obj):
            self.obj = obj

        @classmethod
        def from_external(cls, obj):
            made.append(obj.__cuda_stream__())
            return cls(obj)

        def __enter__(self):
            launched.append(("enter", self.obj.device.index))

        def __exit__(self, *exc):
            return False

    def device(index):
        devices.append(index)
        return nullcontext()

    cp = SimpleNamespace(cuda=SimpleNamespace(Stream=FakeStream, Device=device))
    monkeypatch.setattr(cuda_launch, "require_cupy", lambda: cp)
    monkeypatch.setattr(cuda_launch, "_STREAMS", {})

    class TorchStream:  # what torch.cuda.current_stream returns, as far as the launch reads it
        def __init__(self, index):
            self.cuda_stream, self.device = 0, SimpleNamespace(index=index)

        def __cuda_stream__(self):
            return (0, self.cuda_stream)

    monkeypatch.setattr(cuda_launch.torch.cuda, "current_stream", lambda d: TorchStream(d))

    def fn(grid, block, args, shared_mem=0):
        launched.append(("launch", grid, shared_mem))

    for index in (0, 0, 1):
        cuda_launch.launch_on_torch_stream(fn, (2,), (32,), (), index, shared_mem=16)
    assert made == [(0, 0), (0, 0)] and devices == [0, 1], "one wrapper per (handle, device)"
    assert launched == [("enter", 0), ("launch", (2,), 16)] * 2 + [("enter", 1),
                                                                   ("launch", (2,), 16)]  # fmt: skip
