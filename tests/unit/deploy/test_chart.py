"""The Helm chart's sources: values against values.schema.json, the schema's hardening
constraints, template structure, references to values, and the files the chart embeds.
test_chart_render.py checks what `helm template` makes of them."""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
import re
import sys

import jsonschema
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
CHART = ROOT / "charts/trace"
TEMPLATES = CHART / "templates"
COMPONENTS = {
    "quantCache": "quant-cache",
    "weightSync": "weight-sync",
    "trainer": "trainer",
    "rollout": "rollout",
}


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_values_validate(values: dict, validator: jsonschema.Draft7Validator) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(values)]
    assert not errors, errors


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("podSecurityContext", "runAsNonRoot"), False),
        (("securityContext", "readOnlyRootFilesystem"), False),
        (("securityContext", "allowPrivilegeEscalation"), True),
        (("securityContext", "capabilities", "drop"), ["NET_RAW"]),
        (("rollout", "replicas"), -1),
        (("rollout", "grpcPort"), 70000),
        (("rollout", "gpus"), "1"),
        (("redis", "maxmemoryPolicy"), "lru"),
        (("redis", "external", "url"), "http://redis:6379"),
        (("config",), {"not a var": "x"}),
        (("rollout", "typo"), 1),
        (("rollout", "resources", "requests", "memory"), "32GB"),
        (("rollout", "resources", "requests", "cpu"), "four"),
        (("trainer", "resources", "limits", "memory"), "-1Gi"),
        (("redis", "resources", "requests", "memory"), "4.5 Gi"),
        (("rollout", "autoscaling", "customMetric", "targetAverageValue"), "2 per pod"),
        (("rollout", "podDisruptionBudget", "maxUnavailable"), 0),
        (("rollout", "topologySpreadConstraints"), [{"maxSkew": 1}]),
        (("trainer", "run", "stepz"), 3),
        (("trainer", "run", "steps"), "many"),
        (("trainer", "run", "task"), {"name": "chess"}),
        (("trainer", "run", "objective"), {"mode": "bf16"}),  # derived from run.mode
        (("trainer", "run", "objective"), {"lr": "fast"}),
    ],
)
def test_schema_rejects_bad_values(
    values: dict, validator: jsonschema.Draft7Validator, path: tuple[str, ...], bad: object
) -> None:
    broken = copy.deepcopy(values)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    assert list(validator.iter_errors(broken)), f"schema accepted {path}={bad!r}"


def test_gpu_components_request_gpus(values: dict) -> None:
    assert values["trainer"]["gpus"] >= 1 and values["rollout"]["gpus"] >= 1
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    assert '"nvidia.com/gpu"' in helpers


_BLOCK_OPEN = re.compile(r"\{\{-?\s*(if|range|with|define|block)\b")
_BLOCK_END = re.compile(r"\{\{-?\s*end\s*-?\}\}")
_VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
_COMPONENT_VAR = re.compile(r"\$c\s*:=\s*\.Values\.([A-Za-z]+)")
_COMPONENT_REF = re.compile(r"\$c((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _templates() -> list[pathlib.Path]:
    return sorted(p for p in TEMPLATES.iterdir() if p.suffix in (".yaml", ".tpl", ".txt"))


@pytest.mark.parametrize("path", _templates(), ids=lambda p: p.name)
def test_template_blocks_balance(path: pathlib.Path) -> None:
    text = path.read_text()
    assert text.count("{{") == text.count("}}"), path.name
    assert len(_BLOCK_OPEN.findall(text)) == len(_BLOCK_END.findall(text)), path.name


def _lookup(values: dict, dotted: str) -> bool:
    node: object = values
    for key in dotted.strip(".").split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


HELPER_OPTIONAL = (".gpus", ".dataPlanePort", ".ranks", ".broadcastPort")


@pytest.mark.parametrize("path", _templates(), ids=lambda p: p.name)
def test_templates_reference_existing_values(values: dict, path: pathlib.Path) -> None:
    """`.Values.a.b` and `$c.x` (with `$c := .Values.<component>`) name keys in values.yaml."""
    text = path.read_text()
    missing = [ref for ref in _VALUES_REF.findall(text) if not _lookup(values, ref)]
    bound = _COMPONENT_VAR.findall(text)
    # Helpers take any component as $c: check against all four (gpus and ranks are read with
    # a default, dataPlanePort and broadcastPort with `with`: only weight-sync has one, only
    # the trainer ranks and broadcasts).
    components = bound or (list(COMPONENTS) if path.suffix == ".tpl" else [])
    for ref in _COMPONENT_REF.findall(text):
        for comp in components:
            if not _lookup(values[comp], ref) and not (
                path.suffix == ".tpl" and ref in HELPER_OPTIONAL
            ):
                missing.append(f"{comp}{ref}")
    assert not missing, f"{path.name} references values that do not exist: {missing}"


def _dashboard_module():
    spec = importlib.util.spec_from_file_location(
        "trace_dashboard", ROOT / "deploy/grafana/dashboard.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_dashboard_configmap_embeds_the_dashboard() -> None:
    """The chart's ConfigMap embeds files/trace-rl.json, identical to the compose dashboard,
    both equal to what deploy/grafana/dashboard.py generates."""
    generated = _dashboard_module().render()
    compose_copy = (ROOT / "deploy/grafana/dashboards/trace-rl.json").read_text()
    chart_copy = (CHART / "files/trace-rl.json").read_text()
    assert compose_copy == generated, "stale: run .venv/bin/python deploy/grafana/dashboard.py"
    assert chart_copy == generated, "stale: run .venv/bin/python deploy/grafana/dashboard.py"
    cm = (TEMPLATES / "grafana-dashboard.yaml").read_text()
    assert '.Files.Get "files/trace-rl.json"' in cm
    assert "toYaml .Values.grafanaDashboard.labels" in cm


def test_prometheus_rule_embeds_the_rules() -> None:
    assert (CHART / "files/trace.rules.yml").read_text() == (
        ROOT / "deploy/prometheus/rules/trace.rules.yml"
    ).read_text(), "copy deploy/prometheus/rules/trace.rules.yml to charts/trace/files/"
    assert '.Files.Get "files/trace.rules.yml"' in (TEMPLATES / "monitoring.yaml").read_text()


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "trace"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])


def test_dashboard_queries_follow_the_namespace_job_and_run_variables() -> None:
    """Every series a panel reads is scoped by $namespace and $job, the trainer's also by the
    instances of the chosen $run (hidden $trainer, from trace_trainer_run_info)."""
    dash = json.loads(_dashboard_module().render())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"datasource", "namespace", "job", "run", "trainer"}
    for name in ("namespace", "job", "run", "trainer"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    assert "trace_trainer_run_info" in variables["run"]["definition"]
    assert "$run" in variables["trainer"]["definition"]
    selector = re.compile(r"\b(trace_[a-z0-9_]+|up)(\{[^}]*\})?")
    n = 0
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            for name, labels in selector.findall(target["expr"]):
                n += 1
                assert 'namespace=~"$namespace"' in labels and 'job=~"$job"' in labels, target
                if name.startswith("trace_trainer_"):
                    assert 'instance=~"$trainer"' in labels, target
    assert n > 40


@pytest.mark.parametrize("quantity", ["500m", "4", 4, 0.5, "32Gi", "1e3", "1.5G", "128974848"])
def test_schema_accepts_resource_quantities(
    values: dict, validator: jsonschema.Draft7Validator, quantity: object
) -> None:
    good = copy.deepcopy(values)
    good["rollout"]["resources"]["requests"]["memory"] = quantity
    assert not list(validator.iter_errors(good)), quantity


def test_schema_of_the_run_is_the_run_config_tree() -> None:
    """trainer.run's schema is generated from RunConfig: a key added to the tree must reach
    the chart (`.venv/bin/python deploy/tools/chart_run_schema.py` rewrites it)."""
    spec = importlib.util.spec_from_file_location(
        "chart_run_schema", ROOT / "deploy/tools/chart_run_schema.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    schema = json.loads((CHART / "values.schema.json").read_text())
    got = schema["properties"]["trainer"]["properties"]["run"]
    assert got == tool.run_schema(), "run deploy/tools/chart_run_schema.py"
    assert {"steps", "task", "objective", "stores"} <= set(got["properties"])
    assert "mode" not in got["properties"]["objective"]["properties"]  # derived
