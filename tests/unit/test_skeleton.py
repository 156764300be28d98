from __future__ import annotations

import importlib


def test_packages_import() -> None:
    for name in ("trace_common", "services", "trace_common.cli"):
        assert importlib.import_module(name) is not None
