"""The run's configuration tree (`trace_common.config`): built in one place from defaults, a
recipe file and overrides; errors name the key and the value; a run key in the environment is
refused, naming the variable and the recipe key."""

from __future__ import annotations

import pathlib
import tomllib

import pytest
from typer.testing import CliRunner

from trace_common.cli import app
from trace_common.config import (
    RECIPES_DIR,
    RETIRED_RUN_ENV,
    ConfigError,
    build_run_config,
    check_no_run_env,
    dump_toml,
    load_run_config,
    run_config_dict,
    run_keys,
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
    run = load_run_config()
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


def test_recipe_then_overrides(tmp_path: pathlib.Path) -> None:
    path = recipe(
        tmp_path,
        'steps = 7\nmode = "rtn"\n[objective]\nlr = 1e-4\ntis_cap = 2\n'
        '[task]\nname = "reverse"\ndifficulty = 4\n[guidance]\nmode = "full"\n',
    )
    run = load_run_config(path)
    assert (run.steps, run.mode, run.objective.lr, run.objective.tis_cap) == (7, "rtn", 1e-4, 2.0)
    assert run.sampling.max_new_tokens == 5 and run.guidance.mode == "full"
    run = load_run_config(path, overrides={"steps": 11, "objective.lr": "3e-4"})
    assert (run.steps, run.objective.lr, run.task.name) == (11, 3e-4, "reverse")
    # nested and dotted keys mix; strings are parsed as from a command line
    run = load_run_config(path, overrides={"guidance": {"routing_replay": "false"}, "seed": "2"})
    assert (run.guidance.routing_replay, run.seed, run.steps) == (False, 2, 7)


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_recipe_is_a_run_the_trainer_accepts(path: pathlib.Path) -> None:
    """One recipe serves `trace-rl demo --config` and the trainer: the trainer skips the
    driver's `[demo]` table and checks everything else."""
    load_run_config(path)


def test_derived_keys_follow_their_source(tmp_path: pathlib.Path) -> None:
    text = (
        'mode = "fp4"\nseed = 5\n[sampling]\ntemperature = 0.7\n'
        "[guidance]\nrouting_replay = false\nmeasure_records = true\n"
    )
    run = load_run_config(recipe(tmp_path, text))
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
        load_run_config(path)
    assert named in str(err.value)
    assert str(path) in str(err.value)  # which file


def test_a_missing_recipe_is_named() -> None:
    with pytest.raises(ConfigError, match=r"recipe /nonexistent/run\.toml: not a file"):
        load_run_config("/nonexistent/run.toml")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"TRACE_STEPS": "3"}, "TRACE_STEPS (put `steps = ...` in the recipe)"),
        ({"TRACE_LR": "1e-4"}, "TRACE_LR (put `objective.lr = ...` in the recipe)"),
        ({"TRACE_TASK": "sort"}, "TRACE_TASK (put `task.name = ...` in the recipe)"),
        ({"TRACE_OBJECTIVE_LR": "1"}, "TRACE_OBJECTIVE_LR (put `objective.lr = ...`"),
        ({"TRACE_LOST_RECORDS": "drop"}, "TRACE_LOST_RECORDS (put `stores.lost_records = ...`"),
        ({"TRACE_CONFIG": "run.toml"}, "TRACE_CONFIG (renamed TRACE_RECIPE"),
    ],
)
def test_a_run_key_in_the_environment_is_refused_naming_it(env: dict, named: str) -> None:
    with pytest.raises(ConfigError, match="not read from the environment") as err:
        check_no_run_env({"TRACE_DEVICE": "cpu", "TRACE_RECIPE": "r.toml", **env})
    assert named in str(err.value) and "TRACE_DEVICE" not in str(err.value)


def test_every_retired_variable_names_a_key_of_the_tree() -> None:
    keys = set(run_keys())
    assert {"steps", "objective.lr", "stores.lost_records", "model.overrides"} <= keys
    assert "objective.mode" not in keys  # derived
    assert not {k for k in RETIRED_RUN_ENV.values() if k not in keys}


def test_model_overrides_replace_fields_of_the_named_shape(tmp_path: pathlib.Path) -> None:
    run = load_run_config(
        recipe(tmp_path, '[model]\nname = "debug"\n[model.overrides]\nnum_layers = 2\n')
    )
    cfg = run.model.config(vocab_size=40)
    assert (cfg.num_layers, cfg.vocab_size, cfg.hidden_size) == (2, 40, 64)


def test_a_written_run_reads_back_equal() -> None:
    run = load_run_config(
        overrides={"steps": 3, "model.init_weights": "/w.safetensors", "quant.sites": "all"}
    )
    text = dump_toml(run_config_dict(run))
    assert "seed" not in tomllib.loads(text)["sampling"]  # derived keys are not written
    assert build_run_config(tomllib.loads(text)) == run


def test_the_trainer_reads_its_recipe_and_overrides(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.trainer.config import TrainerSettings

    path = recipe(tmp_path, 'steps = 7\n[task]\nname = "sort"\n[checkpoint]\nexport = true\n')
    monkeypatch.setenv("TRACE_RECIPE", str(path))
    monkeypatch.setenv("TRACE_RESUME", "false")  # wiring: what this start does with the dir
    s = TrainerSettings(**REQUIRED, auth_token="t", run={"group_size": 4, "objective.lr": 0.01})
    assert (s.run.steps, s.run.task.name, s.run.checkpoint.export) == (7, "sort", True)
    assert (s.run.objective.lr, s.run.group_size, s.resume) == (0.01, 4, False)
    assert {"TRACE_RECIPE", "TRACE_RESUME", "TRACE_AUTH_TOKEN"} <= s.env_names()
    assert not {"TRACE_STEPS", "TRACE_CONFIG", "TRACE_RUN"} & s.env_names()
    monkeypatch.setenv("TRACE_RECIPE", str(recipe(tmp_path, "stepz = 1\n")))
    with pytest.raises(ValueError, match="unknown key stepz"):
        TrainerSettings(**REQUIRED, auth_token="t")


@pytest.mark.parametrize(
    ("name", "value", "key"),
    [("TRACE_STEPS", "3", "steps"), ("TRACE_GUIDANCE_LAYERS", "all", "guidance.layers")],
)
def test_the_trainer_stops_at_start_up_on_a_run_key_in_its_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str,
    key: str,
) -> None:  # fmt: skip
    """A stale compose file or script must not run the defaults silently."""
    from services.trainer.config import TrainerSettings
    from trace_common.service import load_settings

    for k, v in {**REQUIRED, "auth_token": "t"}.items():
        monkeypatch.setenv(f"TRACE_{k.upper()}", v)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        load_settings(TrainerSettings)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{name} (put `{key} = ...` in the recipe)" in err and "TRACE_RECIPE" in err


def test_the_trainer_refuses_run_keys_as_settings() -> None:
    """Flat run keys (as a TRACE_CONFIG_FILE YAML or old code passed them) are refused too."""
    from services.trainer.config import TrainerSettings

    with pytest.raises(ValueError, match=r"steps \(put `steps = ...` in the recipe\)"):
        TrainerSettings(**REQUIRED, auth_token="t", steps=3)
    with pytest.raises(ValueError, match="the run comes from the recipe"):
        TrainerSettings(**REQUIRED, auth_token="t", run="steps=3")


def test_serve_trainer_config_sets_the_recipe_variable(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import os
    import types

    seen: list[str | None] = []
    fake = types.SimpleNamespace(main=lambda: seen.append(os.environ.get("TRACE_RECIPE")))
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)
    monkeypatch.delenv("TRACE_RECIPE", raising=False)
    path = recipe(tmp_path, "steps = 2\n")
    result = CliRunner().invoke(app, ["serve", "trainer", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert seen == [str(path)]
    monkeypatch.delenv("TRACE_RECIPE", raising=False)  # serve set it in this process


def test_serve_takes_a_recipe_for_the_trainer_only(tmp_path: pathlib.Path) -> None:
    runner = CliRunner(env={"COLUMNS": "200"})  # error boxes on one line
    result = runner.invoke(app, ["serve", "rollout", "--config", str(tmp_path / "x")])
    assert result.exit_code != 0 and "rollout has no run settings" in result.output
    result = runner.invoke(app, ["serve", "trainer", "--config", str(tmp_path / "x")])
    assert result.exit_code != 0 and "not a file" in result.output
