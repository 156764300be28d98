"""The rollout replica's settings: the CUDA engine's kernel launch settings from the
environment, typed and checked at start-up."""

from __future__ import annotations

import pathlib

import pytest

from services.rollout.config import RolloutSettings
from trace_common.service import load_settings

WIRING = {
    "TRACE_AUTH_TOKEN": "t",
    "TRACE_WEIGHT_SYNC_ADDRESS": "127.0.0.1:1",
    "TRACE_QUANT_CACHE_ADDRESS": "127.0.0.1:2",
}


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("TRACE_"):
            monkeypatch.delenv(name)
    for k, v in WIRING.items():
        monkeypatch.setenv(k, v)


def test_kernel_settings_default_to_the_built_in_tables() -> None:
    k = load_settings(RolloutSettings).kernels()
    assert (k.small_launch, k.expert_gemm_configs, k.attn_config) == ({}, None, None)


def test_kernel_settings_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    configs = tmp_path / "gemm.json"
    configs.write_text('{"2048,16,1": [64, 128, 4, 3]}')
    monkeypatch.setenv("TRACE_KERNEL_SMALL_LAUNCH", '{"qkv": 8, "RING_STAGES": 3}')
    monkeypatch.setenv("TRACE_KERNEL_EXPERT_GEMM_CONFIGS", str(configs))
    monkeypatch.setenv("TRACE_KERNEL_ATTN_CONFIG", '["ring", 4, 4, 4]')
    k = load_settings(RolloutSettings).kernels()
    assert k.small_launch == {"qkv": 8, "RING_STAGES": 3}
    assert k.expert_gemm_configs == configs
    assert k.attn_config == ("ring", 4, 4, 4)


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("TRACE_KERNEL_SMALL_LAUNCH", '{"qkvz": 8}', "TRACE_KERNEL_SMALL_LAUNCH: .*'qkvz'"),
        ("TRACE_KERNEL_EXPERT_GEMM_CONFIGS", "/nonexistent/gemm.json", "no such file"),
        ("TRACE_KERNEL_ATTN_CONFIG", '["zzz", 1, 1, 1]', "TRACE_KERNEL_ATTN_CONFIG: .*'zzz'"),
        ("TRACE_KERNEL_SMALL_LAUNCH", "not json", "TRACE_KERNEL_SMALL_LAUNCH"),
    ],
)
def test_a_bad_kernel_setting_stops_start_up_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name, value, match
) -> None:
    import re

    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        load_settings(RolloutSettings)
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)
