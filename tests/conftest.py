"""Test tiers: markers are registered in pyproject.toml and `--strict-markers` is on.

Tests under tests/unit, tests/integration and tests/e2e get the marker of their folder
automatically; GPU tests (`@pytest.mark.gpu`) are skipped, with the reason, where CUDA is absent.
"""

from __future__ import annotations

import pathlib

import pytest

_TIERS = ("unit", "integration", "e2e")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    has_gpu = _cuda_available()
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for tier in _TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(no_gpu)
