"""One typed configuration tree for an RL run (`RunConfig`), and the one function that builds it.

A run is described by a *recipe*: a small TOML file under `recipes/` that overrides the
defaults declared here (it reads as a diff, like nanoGPT's configs):

    steps = 40
    [task]
    name = "reverse"
    difficulty = 3
    [guidance]
    mode = "full"

`load_run_config` builds the tree, in this order (later wins): the defaults below, the recipe
file, then explicit overrides (the command line, a test's or a bench's dotted keys). An
unknown key or a value of the wrong type is a `ConfigError` naming the key and the value.
Deployment wiring (addresses, ports, secrets, the device, file paths of the host) is not part
of the tree: it stays in each service's `TRACE_*` settings. A run key is never read from the
environment: `check_no_run_env` refuses one (the variables that used to carry run keys,
`RETIRED_RUN_ENV`, and `TRACE_<SECTION>_<KEY>` of every key), so a stale compose file or
script stops at start-up instead of running the defaults.

The sections reuse the components' own configs where one exists (`SamplingConfig`,
`LearnerConfig` as the objective, `DispatchConfig`), so each field is declared and documented
once. Keys of those configs that follow from another section are *derived*, and a recipe that
sets them is refused (`DERIVED`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from trace_common.model.config import (
    GuidanceConfig,
    ModelConfig,
    QuantConfig,
    get_config,
)
from trace_common.model.generate import SamplingConfig
from trace_common.rl.dispatch import DispatchConfig
from trace_common.rl.objective import DEFAULT_MAX_STALENESS
from trace_common.rl.policy import LearnerConfig
from trace_common.rl.types import TRAIN_MODES, TrainMode

RECIPES_DIR = pathlib.Path(__file__).resolve().parents[1] / "recipes"
# The trainer's run recipe (TOML; `trace-rl serve trainer --config FILE` sets it). Not to be
# confused with TRACE_CONFIG_FILE, a YAML file of service settings (trace_common.service).
RECIPE_ENV = "TRACE_RECIPE"
# Tables of a recipe that configure the program playing it, not the run: `trace-rl demo` reads
# `[demo]` and `trace-rl train` reads `[train]` (DemoConfig), the trainer skips them, so one
# recipe serves all three.
DRIVER_TABLES = ("demo", "train")


class ConfigError(ValueError):
    """A recipe or override that does not fit the tree, or a run key in the environment (names
    the key)."""


def site_names(csv: str) -> list[str]:
    """Comma-separated names as a list (blanks dropped)."""
    return [x.strip() for x in csv.split(",") if x.strip()]


@dataclass(kw_only=True, slots=True)
class TaskSection:
    """What the policy is trained on."""

    # A synthetic digit task, or "dataset": the rows of the [dataset] section.
    name: Literal["addition", "sort", "reverse", "mixed", "dataset"] = "addition"
    difficulty: int = 1  # digits (addition) or sequence length (sort, reverse)
    tokenizer: str = "char"  # "char" or a Hugging Face tokenizer directory

    def __post_init__(self) -> None:
        if self.difficulty < 1:
            raise ValueError(f"task.difficulty must be >= 1, got {self.difficulty}")


@dataclass(kw_only=True, slots=True)
class DatasetSection:
    """The user's dataset (task.name = "dataset"): its splits and how a row becomes a prompt
    (`trace_common.data`). Paths are relative to the working directory."""

    # A .jsonl or .parquet file, or a directory saved by Hugging Face datasets (save_to_disk).
    train: pathlib.Path | None = None
    eval: pathlib.Path | None = None  # the held-out split (evaluation); same formats
    train_split: str = "train"  # the split of a DatasetDict directory
    eval_split: str = "test"
    prompt: str = "prompt"  # the column holding the prompt: text, or a list of chat messages
    # reward field -> dataset column, e.g. {answer = "solution"}; other columns keep their names
    columns: dict[str, Any] = field(default_factory=dict)
    template: str = ""  # plain prompts: a format string over columns, "Q: {question}\nA:"
    system: str = ""  # a system message before chat prompts ("" = none)
    # Plain prompts through the tokenizer's chat template as one user message: "auto" (when
    # the tokenizer has one), "always" (refuse a tokenizer without), "never".
    chat: Literal["auto", "always", "never"] = "auto"
    target: str = ""  # the column a supervised warm start fits ("" = no warm start possible)
    max_prompt_tokens: int = 512  # longer prompts are skipped and counted, never truncated
    shuffle: bool = True  # a new seeded order each epoch (false: file order)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.columns.items() if not (isinstance(v, str) and v)}
        if bad:
            raise ConfigError(f"dataset.columns={self.columns}: each value is a column name")
        if self.max_prompt_tokens < 1:
            raise ValueError(
                f"dataset.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}"
            )


@dataclass(kw_only=True, slots=True)
class RewardSection:
    """How completions are scored (`trace_common.rewards`): a named reward run in a pool of
    worker processes beside the trainer."""

    # exact_match | math | code | module:function (a custom reward, importable by the trainer)
    name: str = "exact_match"
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the reward
    workers: int = 2  # worker processes
    timeout_s: float = 30.0  # a call running longer scores 0 (counted in reward_timeouts)
    # A completion cut off at sampling.max_new_tokens (no EOS): "zero" scores it 0 without
    # calling the reward, "score" scores its text like any other.
    truncated: Literal["zero", "score"] = "zero"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("reward.name must not be empty")
        if not 1 <= self.workers <= 256:
            raise ValueError(f"reward.workers must be in [1, 256], got {self.workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")


@dataclass(kw_only=True, slots=True)
class EvalSection:
    """Held-out evaluation on the rollout replicas (the FP4 rollout path): k samples per
    prompt at the run's sampling settings; mean reward, pass@1 and pass@k."""

    every: int = 0  # steps between evaluations, also run at the start and the end; 0 = off
    prompts: int = 64  # held-out prompts (the first that fit, in file order)
    samples: int = 4  # k: completions per prompt
    pass_threshold: float = 1.0  # a completion with reward >= this counts as passing

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every must be >= 0, got {self.every}")
        if self.prompts < 1 or self.samples < 1:
            raise ValueError(
                f"eval.prompts and eval.samples must be >= 1, got {self.prompts}, {self.samples}"
            )


@dataclass(kw_only=True, slots=True)
class ModelSection:
    """The policy's architecture: a named shape (`trace_common.model.config.NAMED_CONFIGS`)
    or a Hugging Face Qwen3-MoE checkpoint directory, with `ModelConfig` fields overridden."""

    name: str = "debug"
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields, e.g. num_layers
    init_weights: pathlib.Path | None = None  # safetensors of master weights to start from

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(ModelConfig)
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ConfigError(
                f"model.overrides: unknown ModelConfig field(s) {unknown}; known: {sorted(known)}"
            )
        self.overrides = {
            k: _coerce(v, hints[k], f"model.overrides.{k}", "") for k, v in self.overrides.items()
        }
        if self.overrides and self.is_checkpoint():
            raise ConfigError(
                f"model.overrides={self.overrides}: a checkpoint directory ({self.name}) "
                "has its own config.json"
            )
        if not self.is_checkpoint():
            self.config(vocab_size=None)  # unknown shape / bad override: ValueError now

    def is_checkpoint(self) -> bool:
        """A checkpoint directory: one that exists, or a name written as a path (the
        directory of a cluster recipe need not exist where the recipe is checked; the trainer
        refuses a missing one at start-up). Named shapes have no "/"."""
        return pathlib.Path(self.name).is_dir() or "/" in self.name

    def config(self, vocab_size: int | None) -> ModelConfig:
        """The named shape with the overrides (vocab sized to the tokenizer when given)."""
        cfg = dataclasses.replace(get_config(self.name), **self.overrides)
        return cfg if vocab_size is None else cfg.replace(vocab_size=vocab_size)


@dataclass(kw_only=True, slots=True)
class QuantSection:
    """Which sites run FP4, in which format (`QuantConfig`; site table in the README)."""

    format: Literal["nvfp4", "mxfp4"] = "nvfp4"
    # "default" (routed experts W4A4 + KV, the paper's setting), "all" (every site the model
    # has) or comma-separated site names such as "expert_weights,expert_acts,kv,attn_weights".
    sites: str = "default"

    def __post_init__(self) -> None:
        if self.sites not in ("default", "all"):
            try:
                QuantConfig(sites=frozenset(site_names(self.sites)), format=self.format)
            except ValueError as e:
                raise ConfigError(f"quant.sites={self.sites!r}: {e}") from None

    def build(self, model_cfg: ModelConfig) -> QuantConfig:
        """The run's FP4 sites, checked against the model (a site it lacks is a ValueError)."""
        if self.sites == "default":
            quant = QuantConfig(format=self.format)
        elif self.sites == "all":
            quant = QuantConfig.every_site(model_cfg, self.format)
        else:
            quant = QuantConfig(sites=frozenset(site_names(self.sites)), format=self.format)
        quant.check_model(model_cfg)
        return quant


@dataclass(kw_only=True, slots=True)
class GuidanceSection:
    """Where the rollout records guidance and what the trainer does with it
    (`GuidanceConfig`)."""

    layers: str = "deeper-half"  # "deeper-half", "all", or comma-separated layer ids "2,3"
    sites: str = "default"  # "default" (moe_in,k,v) or comma-separated guidable site names
    mode: Literal["compact", "full"] = "compact"  # full records also make D_act measurable
    routing_replay: bool = True  # trace mode: the trainer replays the rollout's expert choices
    measure_records: bool = False  # non-trace modes: rollouts record guidance, to measure D_act

    def __post_init__(self) -> None:
        if self.layers not in ("deeper-half", "all"):
            try:
                [int(x) for x in self.layers.split(",")]
            except ValueError:
                raise ConfigError(
                    f"guidance.layers={self.layers!r}: expected deeper-half, all or e.g. 2,3"
                ) from None
        if self.sites != "default":
            try:
                GuidanceConfig(sites=tuple(site_names(self.sites)))
            except ValueError as e:
                raise ConfigError(f"guidance.sites={self.sites!r}: {e}") from None

    def build(self, num_layers: int) -> GuidanceConfig:
        if self.layers == "deeper-half":
            layers = None
        elif self.layers == "all":
            layers = tuple(range(num_layers))
        else:
            layers = tuple(int(x) for x in self.layers.split(","))
        if self.sites == "default":
            return GuidanceConfig(layers=layers, mode=self.mode)
        return GuidanceConfig(layers=layers, sites=tuple(site_names(self.sites)), mode=self.mode)


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    """When checkpoints are written (where, and whether a start resumes from the latest one:
    the trainer's wiring, TRACE_CHECKPOINT_DIR and TRACE_RESUME)."""

    every: int = 10  # steps between checkpoints (the last step always gets one)
    # Also write <checkpoint>/export/{nvfp4,master}: the policy as a ModelOpt NVFP4 and a plain
    # HF checkpoint, calibrated on the task (docs/export.md).
    export: bool = False

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpoint.every must be >= 1, got {self.every}")


@dataclass(kw_only=True, slots=True)
class StoresSection:
    """How the trainer rides out failing stores (weight-sync, quant-cache / Redis)."""

    retry_seconds: float = 60.0  # an unavailable store is retried with backoff this long
    # The run fails (state failed, /healthz 503) once more than this fraction of the samples
    # received so far were dropped untrained (records lost, too stale).
    max_dropped_fraction: float = 0.5
    # A group whose records are lost for good (a Redis restart, eviction, a refused write):
    # regenerate = generate its prompt again in the same step and train it guided (up to
    # regenerate_attempts rounds, then dropped); unguided = train it without records
    # (round-to-nearest QAT, its own routing); drop = do not train it. Counted in
    # samples_regenerated / samples_unguided / samples_dropped_records. A sharded (torchrun)
    # trainer drops.
    lost_records: Literal["regenerate", "unguided", "drop"] = "regenerate"
    regenerate_attempts: int = 2  # lost_records=regenerate: rounds per step, then dropped

    def __post_init__(self) -> None:
        if self.regenerate_attempts < 1:
            raise ValueError(
                f"stores.regenerate_attempts must be >= 1, got {self.regenerate_attempts}"
            )
        if self.retry_seconds < 0:
            raise ValueError(f"stores.retry_seconds must be >= 0, got {self.retry_seconds}")
        if not 0 <= self.max_dropped_fraction <= 1:
            raise ValueError(
                f"stores.max_dropped_fraction must be in [0, 1], got {self.max_dropped_fraction}"
            )


def _default_dispatch() -> DispatchConfig:
    return DispatchConfig(wait_for_replicas_s=120.0)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One RL run: the loop's size, then one section per component."""

    run_id: str = "trace-run"  # names the run's records and checkpoints ([A-Za-z0-9_.-])
    mode: TrainMode = "trace"  # bf16 | fp4 | rtn | trace (docs/design.md, "Training modes")
    steps: int = 50  # RL steps
    prompts_per_step: int = 16
    group_size: int = 8  # completions per prompt (GRPO group)
    max_staleness: int = DEFAULT_MAX_STALENESS  # samples more versions behind are dropped
    # push each version in the background during the next step (with max_staleness >= 1)
    overlap_push: bool = True
    seed: int = 0  # weights' init, prompt stream and sampling
    task: TaskSection = field(default_factory=TaskSection)
    dataset: DatasetSection = field(default_factory=DatasetSection)
    reward: RewardSection = field(default_factory=RewardSection)
    eval: EvalSection = field(default_factory=EvalSection)
    model: ModelSection = field(default_factory=ModelSection)
    quant: QuantSection = field(default_factory=QuantSection)
    guidance: GuidanceSection = field(default_factory=GuidanceSection)
    # max_new_tokens left out of a recipe: the task's answer length + 1. seed: the run's.
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # The train step: lr, minibatches, clip_eps, tis_cap, weight_decay, grad_clip,
    # compute_dtype, activation_checkpointing. mode, temperature, routing_replay and
    # measure_records follow from the other sections.
    objective: LearnerConfig = field(default_factory=LearnerConfig)
    dispatch: DispatchConfig = field(default_factory=_default_dispatch)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    stores: StoresSection = field(default_factory=StoresSection)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", self.run_id):
            raise ValueError(f"run_id={self.run_id!r}: 1-128 of [A-Za-z0-9_.-]")
        if self.mode not in TRAIN_MODES:
            raise ValueError(f"mode={self.mode!r}: expected one of {TRAIN_MODES}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for GRPO, got {self.group_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.sampling.temperature <= 0:
            raise ValueError(
                f"sampling.temperature must be > 0 (log-probs are tempered), got "
                f"{self.sampling.temperature}"
            )
        if self.task.name == "dataset" and self.dataset.train is None:
            raise ConfigError('task.name = "dataset" needs dataset.train (a file or directory)')
        if self.task.name == "dataset" and self.eval.every and self.dataset.eval is None:
            raise ConfigError(
                f"eval.every = {self.eval.every} needs dataset.eval (the held-out split)"
            )
        o = self.objective
        if not (o.lr > 0 and o.tis_cap > 0 and 0 < o.clip_eps < 1):
            raise ValueError(
                f"objective: need lr > 0, tis_cap > 0, 0 < clip_eps < 1; got lr={o.lr}, "
                f"tis_cap={o.tis_cap}, clip_eps={o.clip_eps}"
            )
        # The derived keys (DERIVED) follow their sources.
        self.sampling = dataclasses.replace(self.sampling, seed=self.seed)
        self.objective = dataclasses.replace(
            o, mode=self.mode, temperature=self.sampling.temperature,
            routing_replay=self.guidance.routing_replay,
            measure_records=self.guidance.measure_records,
        )  # fmt: skip


# Keys of reused configs that follow from another key of the tree (a recipe must not set them).
DERIVED: dict[str, str] = {
    "sampling.seed": "seed",
    "objective.mode": "mode",
    "objective.temperature": "sampling.temperature",
    "objective.routing_replay": "guidance.routing_replay",
    "objective.measure_records": "guidance.measure_records",
}

# The environment variables that carried run keys before the recipe did, and the recipe key
# each became. Only read to refuse them with that key (`check_no_run_env`).
RETIRED_RUN_ENV: dict[str, str] = {
    "TRACE_RUN_ID": "run_id",
    "TRACE_MODE": "mode",
    "TRACE_STEPS": "steps",
    "TRACE_PROMPTS_PER_STEP": "prompts_per_step",
    "TRACE_GROUP_SIZE": "group_size",
    "TRACE_MAX_STALENESS": "max_staleness",
    "TRACE_OVERLAP_PUSH": "overlap_push",
    "TRACE_SEED": "seed",
    "TRACE_TASK": "task.name",
    "TRACE_TASK_DIFFICULTY": "task.difficulty",
    "TRACE_TOKENIZER": "task.tokenizer",
    "TRACE_MODEL": "model.name",
    "TRACE_INIT_WEIGHTS": "model.init_weights",
    "TRACE_QUANT_FORMAT": "quant.format",
    "TRACE_QUANT_SITES": "quant.sites",
    "TRACE_GUIDANCE_LAYERS": "guidance.layers",
    "TRACE_GUIDANCE_SITES": "guidance.sites",
    "TRACE_GUIDANCE_MODE": "guidance.mode",
    "TRACE_ROUTING_REPLAY": "guidance.routing_replay",
    "TRACE_MEASURE_RECORDS": "guidance.measure_records",
    "TRACE_TEMPERATURE": "sampling.temperature",
    "TRACE_MAX_NEW_TOKENS": "sampling.max_new_tokens",
    "TRACE_LR": "objective.lr",
    "TRACE_MINIBATCHES": "objective.minibatches",
    "TRACE_CLIP_EPS": "objective.clip_eps",
    "TRACE_TIS_CAP": "objective.tis_cap",
    "TRACE_COMPUTE_DTYPE": "objective.compute_dtype",
    "TRACE_ACTIVATION_CHECKPOINTING": "objective.activation_checkpointing",
    "TRACE_PROMPTS_PER_UNIT": "dispatch.prompts_per_unit",
    "TRACE_REPLICA_WAIT_SECONDS": "dispatch.wait_for_replicas_s",
    "TRACE_CHECKPOINT_EVERY": "checkpoint.every",
    "TRACE_CHECKPOINT_EXPORT": "checkpoint.export",
    "TRACE_STORE_RETRY_SECONDS": "stores.retry_seconds",
    "TRACE_MAX_DROPPED_FRACTION": "stores.max_dropped_fraction",
    "TRACE_LOST_RECORDS": "stores.lost_records",
    "TRACE_REGENERATE_ATTEMPTS": "stores.regenerate_attempts",
}
RETIRED_RECIPE_ENV = "TRACE_CONFIG"  # the recipe variable's old name (now RECIPE_ENV)


def run_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key a recipe may set (derived keys left out), e.g. "objective.lr"."""
    cls = RunConfig if cls is None else cls
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if not f.init or path in DERIVED:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            keys += run_keys(hints[f.name], f"{path}.")
        else:
            keys.append(path)
    return keys


def run_env_names() -> dict[str, str]:
    """Environment variable -> the recipe key it would name: the retired variables, and
    `TRACE_<KEY>` of every dotted key ("objective.lr" -> TRACE_OBJECTIVE_LR)."""
    names = {"TRACE_" + key.replace(".", "_").upper(): key for key in run_keys()}
    return {**names, **RETIRED_RUN_ENV}


def check_no_run_env(env: Mapping[str, str], *, settings: frozenset[str] = frozenset()) -> None:
    """Refuse run keys in the environment (`env`; `settings`: variables that are real settings
    of the service, never refused): a ConfigError naming each variable and the recipe key to
    set instead. A run is configured by its recipe only."""
    problems = [
        f"{name} (put `{key} = ...` in the recipe)"
        for name, key in sorted(run_env_names().items())
        if name in env and name not in settings
    ]
    if RETIRED_RECIPE_ENV in env and RETIRED_RECIPE_ENV not in settings:
        problems.append(f"{RETIRED_RECIPE_ENV} (renamed {RECIPE_ENV}: the run recipe file)")
    if problems:
        raise ConfigError(
            "run keys are not read from the environment; the run comes from its recipe "
            f"({RECIPE_ENV}=FILE or `trace-rl serve trainer --config FILE`). Set: "
            + "; ".join(problems)
        )


# ----------------------------------------------------------------------------- building


def read_recipe(path: pathlib.Path | str) -> dict[str, Any]:
    """A recipe file as a nested dict (TOML); a missing or malformed file is a ConfigError."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path}: not a file")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {path}: not valid TOML: {e}") from None


def merge(base: dict[str, Any], path: str, value: Any) -> None:
    """Set the dotted `path` ("objective.lr") of the nested dict `base` to `value`."""
    *sections, key = path.split(".")
    node = base
    for s in sections:
        node = node.setdefault(s, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{s}: a section, got {node!r}")
    node[key] = value


def load_run_config(
    recipe: pathlib.Path | str | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> RunConfig:
    """THE place a run's configuration is built: defaults, then the recipe file (its driver
    tables, `DRIVER_TABLES`, skipped), then `overrides` (dotted or nested keys, e.g.
    {"steps": 3, "objective.lr": 1e-4} or {"task": {"name": "sort"}}; values may be strings,
    as from a command line). Raises ConfigError naming the offending key and value."""
    raw: dict[str, Any] = read_recipe(recipe) if recipe is not None else {}
    for table in DRIVER_TABLES:
        raw.pop(table, None)
    for path, value in flatten(overrides or {}).items():
        merge(raw, path, value)
    source = f"recipe {recipe}" if recipe is not None else "run configuration"
    return build_run_config(raw, source=source)


# Keys whose value is a table of the user's names, not a section of the tree.
TABLE_KEYS = frozenset({"model.overrides", "dataset.columns", "reward.options"})


def flatten(run: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested and dotted keys as dotted keys: {"task": {"name": "sort"}, "objective.lr": 1e-4}
    -> {"task.name": "sort", "objective.lr": 1e-4}. `model.overrides` is a table-valued key
    and stays a table."""
    out: dict[str, Any] = {}
    for key, value in run.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and path != "model.overrides":
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def recipe_of(run: Mapping[str, Any] | RunConfig) -> dict[str, Any]:
    """A run as a nested dict a recipe holds: a RunConfig (`run_config_dict`) or dotted/nested
    keys (checked by building the tree: a ConfigError names a bad key or value)."""
    if isinstance(run, RunConfig):
        return run_config_dict(run)
    raw: dict[str, Any] = {}
    for path, value in flatten(run).items():
        if value is not None:  # None: unset (the default)
            merge(raw, path, str(value) if isinstance(value, pathlib.Path) else value)
    build_run_config(raw)
    return raw


def build_run_config(raw: Mapping[str, Any], *, source: str = "run configuration") -> RunConfig:
    """A RunConfig from a nested dict (a parsed recipe plus overrides)."""
    raw = dict(raw)
    sampling = dict(raw.get("sampling") or {})
    if sampling.get("max_new_tokens") in (None, 0, "0"):
        # Not set: long enough for the task's longest answer, plus EOS.
        from trace_common.tasks import make_task

        task = build_section(TaskSection, dict(raw.get("task") or {}), "task.", source)
        if task.name == "dataset":
            raise ConfigError(
                f"{source}: sampling.max_new_tokens must be set for a dataset task (the longest "
                "completion to sample)"
            )
        sampling["max_new_tokens"] = make_task(task.name, task.difficulty).max_answer_chars + 1
        raw["sampling"] = sampling
    return build_section(RunConfig, raw, "", source)


def build_section(cls: type, raw: Mapping[str, Any], prefix: str, source: str, **fixed: Any) -> Any:
    """Dataclass `cls` from the table `raw` (keys checked, values coerced to the declared
    types, nested dataclasses built likewise); `fixed` are passed as they are. `prefix` is the
    table's dotted path ("objective.") in error messages."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: {prefix or 'the run'} must be a table, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init and f.name not in fixed}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if path in DERIVED:
            raise ConfigError(
                f"{source}: {path} = {value!r} is derived from {DERIVED[path]}; set that instead"
            )
        if key not in names:
            known = sorted(n for n in names if f"{prefix}{n}" not in DERIVED)
            raise ConfigError(f"{source}: unknown key {path} = {value!r}; known here: {known}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_section(tp, value, f"{path}.", source)
        else:
            kwargs[key] = _coerce(value, tp, path, source)
    try:
        return cls(**kwargs, **fixed)
    except ConfigError as e:  # a section's own check: it names the key
        raise ConfigError(f"{source}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'run'}: {e}") from None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _coerce(value: Any, tp: Any, path: str, source: str) -> Any:
    """`value` as type `tp` (strings, as from a command line, are parsed); else ConfigError."""

    def bad(expected: str) -> ConfigError:
        where = f"{source}: " if source else ""
        return ConfigError(f"{where}{path} = {value!r}: expected {expected}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and value in (None, ""):
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, path, source)
            except ConfigError:
                pass
        raise bad(" or ".join(_type_name(a) for a in args))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise bad(f"one of {list(choices)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise bad("an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad("a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad("a string")
    if tp is pathlib.Path:
        if isinstance(value, (str, pathlib.Path)) and str(value):
            return pathlib.Path(value)
        raise bad("a path")
    if origin is tuple:
        (item, *_) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(v, item, path, source) for v in value)
        raise bad(f"a list of {_type_name(item)}")
    if origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise bad("a table")
    raise bad(_type_name(tp))  # a type this loader does not know: refuse rather than guess


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


# ----------------------------------------------------------------------------- writing


def run_config_dict(cfg: RunConfig) -> dict[str, Any]:
    """The tree as a nested dict of plain values, without the derived keys (a recipe that
    `build_run_config` reads back to an equal RunConfig)."""

    def walk(obj: Any, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            path = f"{prefix}{f.name}"
            if path in DERIVED or not f.init:
                continue
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                out[f.name] = walk(v, f"{path}.")
            elif v is not None:
                out[f.name] = (
                    str(v)
                    if isinstance(v, pathlib.Path)
                    else (list(v) if isinstance(v, tuple) else v)
                )
        return out

    return walk(cfg, "")


def dump_toml(data: Mapping[str, Any]) -> str:
    """A nested dict of str/int/float/bool/list values as TOML (enough for recipes)."""
    import json

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a valid TOML basic string
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        raise TypeError(f"cannot write {v!r} as TOML")

    def table(d: Mapping[str, Any], name: str) -> list[str]:
        lines = [f"[{name}]"] if name else []
        lines += [f"{k} = {scalar(v)}" for k, v in d.items() if not isinstance(v, Mapping)]
        for k, v in d.items():
            if isinstance(v, Mapping):
                lines += ["", *table(v, f"{name}.{k}" if name else k)]
        return lines

    return "\n".join(table(data, "")) + "\n"
