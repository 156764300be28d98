"""The fast-path hook: the reference hands a registered fast path exactly the tensors and
records it accepts, and the model's quantization hooks register the Triton kernels."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from trace_common.fp4 import nvfp4
from trace_common.fp4.fake import fake_quantize
from trace_common.fp4.fast_path import FastPath, fast_path_for, register_fast_path
from trace_common.fp4.guided import guided_quantize
from trace_common.fp4.record import capture


@pytest.fixture
def recording_path() -> Iterator[list[str]]:
    """A fast path accepting float16 tensors that returns x + 1 and logs each call."""
    calls: list[str] = []

    def fake(x: torch.Tensor, *, scale_granularity: str) -> torch.Tensor:
        calls.append(f"fake/{scale_granularity}")
        return x + 1

    def guided(x: torch.Tensor, record: object) -> torch.Tensor:
        calls.append("guided")
        return x + 1

    path = FastPath("test", lambda x: x.dtype == torch.float16, fake, guided)
    previous = register_fast_path(path)
    try:
        yield calls
    finally:
        register_fast_path(previous)


def test_fake_quantize_takes_the_fast_path_for_accepted_nvfp4_tensors(recording_path) -> None:
    x = torch.randn(2, 32, dtype=torch.float16, requires_grad=True)
    y = fake_quantize(x, "nvfp4", scale_granularity="tensor")
    assert recording_path == ["fake/tensor"]
    assert torch.equal(y.detach(), x.detach() + 1)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)), "straight-through around the fast path"


def test_fake_quantize_keeps_the_reference_elsewhere(recording_path) -> None:
    x32 = torch.randn(2, 32)
    assert torch.equal(fake_quantize(x32, "nvfp4"), nvfp4.dequantize(
        nvfp4.quantize(x32, scale_granularity="row"), torch.float32))  # fmt: skip
    fake_quantize(x32.half(), "mxfp4")
    fake_quantize(x32.half(), "nvfp4", scale_granularity="tensor", per_tensor_scale=torch.ones(()))
    assert recording_path == [], "not accepted, not nvfp4, or a keyword the fast path lacks"


def test_guided_quantize_takes_the_fast_path_for_compact_nvfp4_only(recording_path) -> None:
    x = torch.randn(2, 32, dtype=torch.float16)
    for fmt, mode in (("nvfp4", "full"), ("mxfp4", "compact")):
        guided_quantize(x, capture(x, fmt, mode)[1])
    assert recording_path == []
    y = guided_quantize(x, capture(x, "nvfp4", "compact")[1])
    assert recording_path == ["guided"]
    assert torch.equal(y, x + 1)


def test_register_returns_the_replaced_path_and_none_restores_the_reference() -> None:
    path = FastPath("a", lambda x: True, lambda x, **kw: x, lambda x, r: x)
    previous = register_fast_path(path)
    try:
        assert fast_path_for(torch.zeros(1)) is path
        assert register_fast_path(None) is path
        assert fast_path_for(torch.zeros(1)) is None
    finally:
        register_fast_path(previous)


def test_fp4_alone_registers_nothing_and_the_model_registers_the_kernels() -> None:
    """In a fresh interpreter: the reference imports no kernels; importing the model's hooks
    (as the trainer and the rollout do) registers `kernels.quant.FAST_PATH`."""
    script = textwrap.dedent(
        """
        import sys
        import trace_common.fp4.fake, trace_common.fp4.guided
        from trace_common.fp4 import fast_path
        assert not any(m.startswith("trace_common.kernels") for m in sys.modules), "kernels"
        assert fast_path._registered is None
        import trace_common.model
        from trace_common.kernels import quant
        assert fast_path._registered is quant.FAST_PATH
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
