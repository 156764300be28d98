"""Metrics naming, JSON logs, client retry config and the tensor wire format."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from trace_common.clients.tensors import TensorAssembler, tensor_to_wire
from trace_common.service import Metrics, RetryPolicy
from trace_common.service.logs import JsonFormatter
from trace_common.wire.tensor_wire import DTYPE_ITEMSIZE, expected_nbytes


def test_metric_names_follow_convention() -> None:
    m = Metrics("quant_cache")
    m.counter("put_bytes", "bytes").inc(5)
    m.histogram("put_seconds", "latency").observe(0.01)
    text = m.exposition().decode()
    assert "trace_quant_cache_put_bytes_total 5.0" in text
    assert "trace_quant_cache_put_seconds_bucket" in text
    with pytest.raises(ValueError, match="lower_snake_case"):
        Metrics("Quant-Cache")


def test_json_log_lines_carry_extra_fields() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "stored %d", (3,), None)
    record.run_id = "r1"
    line = json.loads(JsonFormatter("quant_cache").format(record))
    assert (
        line["msg"] == "stored 3" and line["component"] == "quant_cache" and line["run_id"] == "r1"
    )
    assert line["ts"].endswith("Z") and line["level"] == "INFO"


def test_retry_service_config_is_exponential_and_transient_only() -> None:
    cfg = json.loads(RetryPolicy().service_config("trace.x.v1.X", ["Get"]))
    policy = cfg["methodConfig"][0]["retryPolicy"]
    assert policy["backoffMultiplier"] == 2.0 and policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert cfg["methodConfig"][0]["name"] == [{"service": "trace.x.v1.X", "method": "Get"}]


@pytest.mark.parametrize("name", sorted(DTYPE_ITEMSIZE))
def test_every_wire_dtype_round_trips_bit_exact(name: str) -> None:
    dtype = getattr(torch, name)
    assert dtype.itemsize == DTYPE_ITEMSIZE[name]
    raw = torch.randint(0, 256, (3 * 5 * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    tensor = raw.view(dtype).reshape(3, 5)  # [3, 5]
    spec, view = tensor_to_wire("t", tensor)
    assert spec.dtype == name and list(spec.shape) == [3, 5] and spec.nbytes == len(view)
    asm = TensorAssembler(spec)
    asm.add(0, bytes(view[:7]))
    asm.add(7, bytes(view[7:]))
    out = asm.tensor()
    assert out.dtype == dtype and out.shape == (3, 5)
    assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))


def test_wire_edge_cases() -> None:
    spec, view = tensor_to_wire("scalar", torch.tensor(1.5))
    assert list(spec.shape) == [] and len(view) == 4
    strided = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    spec, view = tensor_to_wire("t", strided)
    asm = TensorAssembler(spec)
    asm.add(0, bytes(view))
    assert torch.equal(asm.tensor(), strided)
    bad = TensorAssembler(spec)
    bad.add(0, bytes(len(view)))
    with pytest.raises(ValueError, match="crc32"):
        bad.tensor()
    with pytest.raises(ValueError, match="offset 4"):
        TensorAssembler(spec).add(4, b"x")
    with pytest.raises(ValueError, match="unsupported dtype"):
        expected_nbytes("int4", [2])
    with pytest.raises(TypeError, match="cannot travel"):
        tensor_to_wire("q", torch.zeros(2, dtype=torch.uint1))
