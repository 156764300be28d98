"""The run's configuration tree (`trace_common.config`): built in one place from defaults, a
recipe file, the environment's run keys and overrides; errors name the key and the value."""

from __future__ import annotations

import pathlib
import tomllib

import pytest
from typer.testing import CliRunner

from trace_common.cli import app
from trace_common.config import (
    RUN_ENV,
    ConfigError,
    RunConfig,
    build_run_config,
    dump_toml,
    load_run_config,
    run_config_dict,
)
from trace_common.model.generate import SamplingConfig
from trace_common.rl.dispatch import DispatchConfig
from trace_common.rl.policy import LearnerConfig

REQUIRED = {"weight_sync_address": "127.0.0.1:1", "quant_cache_address": "127.0.0.1:2"}


def recipe(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_trainer_services_defaults() -> None:
    run = load_run_config(env={})
    assert (run.mode, run.steps, run.prompts_per_step, run.group_size) == ("trace", 50, 16, 8)
    assert (run.task.name, run.task.difficulty, run.model.name) == ("addition", 1, "debug")
    o = run.objective
    assert (o.lr, o.clip_eps, o.tis_cap, o.minibatches) == (1e-3, 0.2, 5.0, 2)
    assert (run.max_staleness, run.checkpoint.every, run.dispatch.prompts_per_unit) == (3, 10, 4)
    assert run.dispatch.wait_for_replicas_s == 120.0
    assert run.sampling.max_new_tokens == 3  # unset: the task's longest answer (2) + EOS
    # the sections are the components' own configs, not copies of their fields
    assert isinstance(o, LearnerConfig) and isinstance(run.sampling, SamplingConfig)
    assert isinstance(run.dispatch, DispatchConfig)


def test_recipe_then_environment_then_overrides(tmp_path: pathlib.Path) -> None:
    path = recipe(
        tmp_path,
        'steps = 7\nmode = "rtn"\n[objective]\nlr = 1e-4\ntis_cap = 2\n'
        '[task]\nname = "reverse"\ndifficulty = 4\n[guidance]\nmode = "full"\n',
    )
    run = load_run_config(path, env={})
    assert (run.steps, run.mode, run.objective.lr, run.objective.tis_cap) == (7, "rtn", 1e-4, 2.0)
    assert run.sampling.max_new_tokens == 5 and run.guidance.mode == "full"
    env = {"TRACE_STEPS": "9", "TRACE_ROUTING_REPLAY": "false", "TRACE_CLIP_EPS": "0.1"}
    run = load_run_config(path, env=env)
    assert (run.steps, run.guidance.routing_replay, run.objective.clip_eps) == (9, False, 0.1)
    run = load_run_config(path, env=env, overrides={"steps": 11, "objective.lr": "3e-4"})
    assert (run.steps, run.objective.lr, run.task.name) == (11, 3e-4, "reverse")


def test_derived_keys_follow_their_source(tmp_path: pathlib.Path) -> None:
    text = (
        'mode = "fp4"\nseed = 5\n[sampling]\ntemperature = 0.7\n'
        "[guidance]\nrouting_replay = false\nmeasure_records = true\n"
    )
    run = load_run_config(recipe(tmp_path, text), env={})
    o = run.objective
    assert (o.mode, o.temperature, o.routing_replay, o.measure_records) == (
        "fp4", 0.7, False, True,
    )  # fmt: skip
    assert run.sampling.seed == 5


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("stepz = 3\n", "unknown key stepz = 3"),
        ("[objective]\nlearning_rate = 0.1\n", "unknown key objective.learning_rate = 0.1"),
        ("[colour]\nx = 1\n", "unknown key colour"),
        ('steps = "many"\n', "steps = 'many': expected an integer"),
        ("[objective]\nlr = true\n", "objective.lr = True: expected a number"),
        ('mode = "fp8"\n', "mode = 'fp8': expected one of ['bf16', 'fp4', 'rtn', 'trace']"),
        ("[guidance]\nrouting_replay = 1\n", "guidance.routing_replay = 1: expected true or false"),
        ('[objective]\nmode = "bf16"\n', "objective.mode = 'bf16' is derived from mode"),
        ("[sampling]\nseed = 3\n", "sampling.seed = 3 is derived from seed"),
        ("steps = 0\n", "steps must be >= 1, got 0"),
        ("[objective]\nclip_eps = 1.5\n", "clip_eps=1.5"),
        ('[quant]\nsites = "kv,atn_weights"\n', "atn_weights"),
        ('[guidance]\nlayers = "2,x"\n', "guidance.layers='2,x'"),
        ('[model]\nname = "huge"\n', "unknown model shape 'huge'"),
        ("[model.overrides]\nnum_layerz = 2\n", "num_layerz"),
        ('[model.overrides]\nnum_layers = "two"\n', "model.overrides.num_layers = 'two'"),
        ("steps = 3\nsteps = 4\n", "not valid TOML"),
    ],
)
def test_bad_keys_and_values_are_named(tmp_path: pathlib.Path, text: str, named: str) -> None:
    path = recipe(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_run_config(path, env={})
    assert named in str(err.value)
    assert str(path) in str(err.value)  # which file


def test_a_bad_environment_value_is_named() -> None:
    with pytest.raises(
        ConfigError,
        match=r"task.difficulty = 'x': expected an integer \(from TRACE_TASK_DIFFICULTY\)",
    ):
        load_run_config(env={"TRACE_TASK_DIFFICULTY": "x"})
    with pytest.raises(ConfigError, match="not a file"):
        load_run_config("/nonexistent/run.toml", env={})


def test_model_overrides_replace_fields_of_the_named_shape(tmp_path: pathlib.Path) -> None:
    run = load_run_config(
        recipe(tmp_path, '[model]\nname = "debug"\n[model.overrides]\nnum_layers = 2\n'), env={}
    )
    cfg = run.model.config(vocab_size=40)
    assert (cfg.num_layers, cfg.vocab_size, cfg.hidden_size) == (2, 40, 64)


def test_a_written_run_reads_back_equal() -> None:
    run = load_run_config(
        env={}, overrides={"steps": 3, "model.init_weights": "/w.safetensors", "quant.sites": "all"}
    )
    text = dump_toml(run_config_dict(run))
    assert "seed" not in tomllib.loads(text)["sampling"]  # derived keys are not written
    assert build_run_config(tomllib.loads(text)) == run


def test_every_environment_key_is_a_key_of_the_tree() -> None:
    for name, path in RUN_ENV.items():
        node: object = RunConfig()
        for part in path.split("."):
            assert hasattr(node, part), f"{name} -> {path}"
            node = getattr(node, part)


def test_the_trainer_reads_its_recipe_and_the_environment(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.trainer.config import TrainerSettings

    path = recipe(tmp_path, 'steps = 7\n[task]\nname = "sort"\n[checkpoint]\nexport = true\n')
    monkeypatch.setenv("TRACE_CONFIG", str(path))
    monkeypatch.setenv("TRACE_LR", "0.01")
    s = TrainerSettings(**REQUIRED, auth_token="t", group_size=4)
    assert (s.run.steps, s.run.task.name, s.run.checkpoint.export) == (7, "sort", True)
    assert (s.run.objective.lr, s.run.group_size) == (0.01, 4)  # environment, then arguments
    assert {"TRACE_CONFIG", "TRACE_STEPS", "TRACE_AUTH_TOKEN"} <= s.env_names()
    monkeypatch.setenv("TRACE_CONFIG", str(recipe(tmp_path, "stepz = 1\n")))
    with pytest.raises(ValueError, match="unknown key stepz"):
        TrainerSettings(**REQUIRED, auth_token="t")


def test_serve_takes_a_recipe_for_the_trainer_only(tmp_path: pathlib.Path) -> None:
    runner = CliRunner(env={"COLUMNS": "200"})  # error boxes on one line
    result = runner.invoke(app, ["serve", "rollout", "--config", str(tmp_path / "x")])
    assert result.exit_code != 0 and "rollout has no run settings" in result.output
    result = runner.invoke(app, ["serve", "trainer", "--config", str(tmp_path / "x")])
    assert result.exit_code != 0 and "not a file" in result.output
