"""`trace-rl demo`'s configuration: the GPU recipe behind `--device cuda`, explicit options
over it, and the settings each service process gets (device, shape, engine)."""

from __future__ import annotations

import pathlib

import pytest

from trace_common.rl.demo import GPU_RECIPE, DemoConfig, rollout_env, trainer_env


def test_cpu_defaults_are_the_tiny_demo() -> None:
    cfg = DemoConfig.for_device("cpu")
    assert (cfg.shape, cfg.task, cfg.difficulty, cfg.steps) == ("debug", "reverse", 3, 40)
    assert cfg == DemoConfig()


def test_cuda_takes_the_gpu_recipe_and_explicit_options_win() -> None:
    cfg = DemoConfig.for_device("cuda", steps=None, task=None)
    assert (cfg.shape, cfg.task, cfg.difficulty) == ("mid-1b", "addition", 4)
    assert cfg.steps == GPU_RECIPE["steps"] >= 100 and cfg.device == "cuda"
    mine = DemoConfig.for_device("cuda:1", steps=7, shape="debug", lr=0.5)
    assert (mine.steps, mine.shape, mine.lr, mine.task) == (7, "debug", 0.5, "addition")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"device": "gpu"}, "device 'gpu'"),
        ({"shape": "huge"}, "unknown model shape 'huge'"),
        ({"rollout_engine": "vllm"}, "rollout engine 'vllm'"),
        ({"rollout_dtype": "float16"}, "rollout dtype 'float16'"),
        ({"guidance_mode": "half"}, "guidance mode 'half'"),
    ],
)
def test_bad_values_are_named(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kw)


def test_every_process_gets_the_device_shape_and_engine(tmp_path: pathlib.Path) -> None:
    cfg = DemoConfig.for_device("cuda", rollout_engine="native")
    t = trainer_env(cfg, tmp_path, "w.safetensors")
    assert (t["TRACE_DEVICE"], t["TRACE_MODEL"], t["TRACE_TASK"]) == ("cuda", "mid-1b", "addition")
    assert t["TRACE_CHECKPOINT_EVERY"] == "100" and t["TRACE_INIT_WEIGHTS"] == "w.safetensors"
    assert t["TRACE_GUIDANCE_MODE"] == "compact"  # what the CUDA engine records
    r = rollout_env(cfg)
    assert r == {"TRACE_DEVICE": "cuda", "TRACE_ROLLOUT_ENGINE": "native",
                 "TRACE_ENGINE_DTYPE": "auto"}  # fmt: skip
    cpu = trainer_env(DemoConfig(), tmp_path, "w")
    assert (cpu["TRACE_DEVICE"], cpu["TRACE_MODEL"], cpu["TRACE_CHECKPOINT_EVERY"]) == (
        "cpu", "debug", "10",
    )  # fmt: skip
    assert cpu["TRACE_GUIDANCE_MODE"] == "full"
