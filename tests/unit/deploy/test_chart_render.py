"""The Helm chart rendered by a real `helm template` (helm v3.17.1, installed by
deploy/tools/install-helm.sh, which `make test` runs) under several value sets. Every manifest is
parsed strictly (no duplicate keys), validated against the Kubernetes 1.27 and 1.34 JSON schemas
(kubernetes-validate, strict: unknown fields fail), and checked for what the chart promises:
real `trace-rl serve` targets with real settings, hardening, GPUs, probes, discovery, the
embedded dashboard and rules. No cluster is needed; installing into one is not tested here."""

from __future__ import annotations

import importlib
import json
import pathlib
import shutil
import subprocess
from collections.abc import Iterator

import kubernetes_validate
import pytest
import yaml

from trace_common import cli
from trace_common.config import load_run_config
from trace_common.service.config import ServiceSettings

ROOT = pathlib.Path(__file__).resolve().parents[3]
CHART = ROOT / "charts/trace"
HELM_LOCAL = ROOT / ".tmp/tools/bin/helm"
# Chart.yaml says kubeVersion >= 1.27 (gRPC probes are GA there); check the oldest and a recent one.
K8S_VERSIONS = ("1.27.0", "1.34.0")
K8S_VERSION = K8S_VERSIONS[-1]
HELM_TIMEOUT_S = 60
TOKEN = "0123456789abcdef0123456789abcdef"
TRACE = ("quant-cache", "weight-sync", "trainer", "rollout")
GPU = ("trainer", "rollout")

VALUE_SETS: dict[str, list[str]] = {
    # helm install with inline secrets, everything else default (GPU cluster).
    "defaults": ["--set", f"auth.token={TOKEN}", "--set", f"redis.password={TOKEN}"],
    # Existing secrets, external Redis, autoscaled rollout, operator objects, no PVC, CPU only.
    "all-options": [
        "--set", "auth.existingSecret=my-token",
        "--set", "redis.enabled=false",
        "--set", "redis.external.existingSecret=my-redis-url",
        "--set", "rollout.autoscaling.enabled=true",
        "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "metrics.podMonitor.enabled=true",
        "--set", "metrics.prometheusRule.enabled=true",
        "--set", "trainer.persistence.enabled=false",
        "--set", "trainer.gpus=0",
        "--set", "rollout.gpus=0",
        "--set", "image.tag=cpu",
        "--set-json", 'rollout.env={"TRACE_TORCH_THREADS":"4"}',
        "--set-json", 'rollout.nodeSelector={"nvidia.com/gpu.product":"NVIDIA-H200"}',
    ],
}  # fmt: skip


def helm() -> str:
    """helm on PATH or from deploy/tools/install-helm.sh; missing fails, it never skips."""
    path = shutil.which("helm") or (str(HELM_LOCAL) if HELM_LOCAL.exists() else None)
    if path is None:
        pytest.fail("helm not found: run `bash deploy/tools/install-helm.sh` (`make test` does)")
    return path


def helm_template(*args: str, release: str = "trace") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm(), "template", release, str(CHART), "--namespace", "trace", *args],
        capture_output=True,
        text=True,
        timeout=HELM_TIMEOUT_S,
    )


class _StrictLoader(yaml.SafeLoader):
    """Rejects duplicate mapping keys (which the API server's decoder rejects too)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ValueError(f"duplicate key {key!r} at {key_node.start_mark}")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    res = helm_template(*VALUE_SETS[request.param])
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.load_all(res.stdout, Loader=_StrictLoader) if d]
    return request.param, docs


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def _trace_container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _trace_containers(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    """(component, its container) of each TRACE service's workload."""
    for w in _workloads(docs):
        comp = _component(w)
        if comp in TRACE:
            yield comp, _trace_container(w)


def test_manifests_validate_against_kubernetes_schemas(rendered: tuple[str, list[dict]]) -> None:
    _, docs = rendered
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # operator CRDs: no bundled schema; checked below
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 10


def test_schema_validation_can_fail() -> None:
    """The validation above rejects what the API server would (strict: unknown fields)."""
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_every_component_is_deployed(rendered: tuple[str, list[dict]]) -> None:
    name, docs = rendered
    kinds = {_component(w): w["kind"] for w in _workloads(docs)}
    assert kinds["trainer"] == "StatefulSet"
    assert all(kinds[c] == "Deployment" for c in ("quant-cache", "weight-sync", "rollout"))
    assert ("redis" in kinds) == (name == "defaults")
    for w in _workloads(docs):  # selectors select their own pods
        selector = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), w["metadata"]["name"]


def test_containers_run_real_services_with_real_settings(rendered: tuple[str, list[dict]]) -> None:
    """`trace-rl serve X` for X in the CLI's table; every TRACE_* variable (env and ConfigMap)
    is a field of X's settings, so none is silently ignored."""
    _, docs = rendered
    configmap = next(
        d for d in docs if d["kind"] == "ConfigMap" and "-config" in d["metadata"]["name"]
    )
    for comp, c in _trace_containers(docs):
        assert c["args"] == ["serve", comp] and comp in cli.SERVICES, c["args"]
        config = importlib.import_module(cli.SERVICES[comp].rsplit(".", 1)[0] + ".config")
        (settings,) = [
            v
            for v in vars(config).values()
            if isinstance(v, type)
            and issubclass(v, ServiceSettings)
            and v.__module__ == config.__name__
        ]  # the service's own class, not the bases it builds on
        names = {e["name"] for e in c["env"]} | set(configmap["data"])
        unknown = sorted(
            n for n in names if n.startswith("TRACE_") and n not in settings.env_names()
        )
        assert not unknown, f"{comp}: not settings of {settings.__name__}: {unknown}"
        assert {"TRACE_AUTH_TOKEN_FILE", "TRACE_GRPC_PORT", "TRACE_HTTP_PORT"} <= names
        # Pods are reached through their Service: gRPC, HTTP and weight-sync's data plane
        # (which binds the gRPC host) listen on every interface, set explicitly.
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env.get("TRACE_GRPC_HOST") == env.get("TRACE_HTTP_HOST") == "0.0.0.0", comp


def test_pods_are_hardened(rendered: tuple[str, list[dict]]) -> None:
    _, docs = rendered
    for w in _workloads(docs):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]


def _check_data_plane_port(comp: str, c: dict, ports: dict, service: dict) -> None:
    """Replicas dial weight-sync's bulk data plane at its Service name (the gRPC host) and
    the port its container listens on; only weight-sync has one."""
    env = {e["name"]: e.get("value") for e in c["env"]}
    if comp != "weight-sync":
        assert "data" not in ports and "TRACE_DATA_PLANE_PORT" not in env, comp
        return
    assert env["TRACE_DATA_PLANE_PORT"] == str(ports["data"]) == "50062"
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports["data"]["port"] == ports["data"]
    assert service_ports["data"]["targetPort"] == "data"


def test_probes_ports_and_gpus(rendered: tuple[str, list[dict]]) -> None:
    name, docs = rendered
    services = {_component(s): s for s in _by_kind(docs, "Service").values()}
    for comp, c in _trace_containers(docs):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["readinessProbe"]["grpc"]["port"] == ports["grpc"]
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        _check_data_plane_port(comp, c, ports, services[comp])
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        if comp in GPU and name == "defaults":
            assert gpus == 1, comp
        else:
            assert gpus is None, (comp, gpus)


def test_compute_components_get_their_device(rendered: tuple[str, list[dict]]) -> None:
    """TRACE_DEVICE: cuda where the pod requests a GPU (each rollout replica its own), cpu
    where it requests none; the stores compute nothing and get none."""
    name, docs = rendered
    for comp, c in _trace_containers(docs):
        env = {e["name"]: e.get("value") for e in c["env"]}
        if comp not in GPU:
            assert "TRACE_DEVICE" not in env, comp
        else:
            assert env["TRACE_DEVICE"] == ("cuda" if name == "defaults" else "cpu"), comp


def test_rollout_discovery_and_scaling(rendered: tuple[str, list[dict]]) -> None:
    name, docs = rendered
    services = _by_kind(docs, "Service")
    (rollout_svc,) = [s for s in services.values() if _component(s) == "rollout"]
    assert rollout_svc["spec"]["clusterIP"] == "None"
    (rollout,) = [w for w in _workloads(docs) if _component(w) == "rollout"]
    env = {e["name"]: e.get("value") for e in _trace_container(rollout)["env"]}
    assert env["TRACE_ADVERTISE_HOST"] == "$(POD_IP)" and env["TRACE_REPLICA_ID"] == "$(POD_NAME)"
    selector = rollout["spec"]["selector"]["matchLabels"]
    (spread,) = rollout["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname", spread
    assert spread["labelSelector"] == {"matchLabels": selector}  # only the rollout pods
    (pdb,) = _by_kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert pdb["spec"]["maxUnavailable"] == 1
    hpas = _by_kind(docs, "HorizontalPodAutoscaler")
    if name == "all-options":
        (hpa,) = hpas.values()
        # GPU replicas scale on their queue depth (a Pods metric through a Prometheus
        # adapter), not on CPU
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods", metric
        assert metric["pods"]["metric"]["name"] == "trace_rollout_requests_in_flight"
        assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "2"}
        assert hpa["spec"]["scaleTargetRef"]["name"] == rollout["metadata"]["name"]
        assert "replicas" not in rollout["spec"], "the HPA owns the replica count"
        assert env["TRACE_TORCH_THREADS"] == "4"
        assert rollout["spec"]["template"]["spec"]["nodeSelector"] == {
            "nvidia.com/gpu.product": "NVIDIA-H200"
        }
    else:
        assert not hpas and rollout["spec"]["replicas"] == 2


def test_secrets_and_redis(rendered: tuple[str, list[dict]]) -> None:
    name, docs = rendered
    secrets = _by_kind(docs, "Secret")
    (qc,) = [w for w in _workloads(docs) if _component(w) == "quant-cache"]
    env = {e["name"]: e for e in _trace_container(qc)["env"]}
    token_volume = next(
        v for v in qc["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth-token"
    )
    if name == "defaults":
        assert token_volume["secret"]["secretName"] in secrets
        redis = next(w for w in _workloads(docs) if _component(w) == "redis")
        cmd = " ".join(_trace_container(redis)["args"])
        assert "--maxmemory 4gb" in cmd and "--maxmemory-policy volatile-ttl" in cmd
        assert env["TRACE_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@trace-redis:6379/0"
    else:
        assert not secrets, "existing secrets: the chart must not create its own"
        assert token_volume["secret"]["secretName"] == "my-token"
        ref = env["TRACE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "my-redis-url", "key": "redis-url"}
    (trainer,) = [w for w in _workloads(docs) if _component(w) == "trainer"]
    assert bool(trainer["spec"].get("volumeClaimTemplates")) == (name == "defaults")


def test_dashboard_configmap_embeds_the_dashboard(rendered: tuple[str, list[dict]]) -> None:
    _, docs = rendered
    (cm,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    embedded = json.loads(cm["data"]["trace-rl.json"])
    assert embedded == json.loads((ROOT / "deploy/grafana/dashboards/trace-rl.json").read_text())


def test_operator_objects(rendered: tuple[str, list[dict]], tmp_path: pathlib.Path) -> None:
    """ServiceMonitor selects the TRACE Services on a port they have; PodMonitor likewise;
    the PrometheusRule's groups are the rules file's and pass `promtool check rules`."""
    name, docs = rendered
    monitors = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    if name != "all-options":
        assert not monitors
        return
    kinds = {d["kind"]: d for d in monitors}
    assert set(kinds) == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    sm = kinds["ServiceMonitor"]
    selected = [
        s
        for s in _by_kind(docs, "Service").values()
        if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        and _component(s) in sm["spec"]["selector"]["matchExpressions"][0]["values"]
    ]
    assert {_component(s) for s in selected} == set(TRACE)
    for s in selected:
        assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in s["spec"]["ports"]}
    rules = kinds["PrometheusRule"]["spec"]
    assert rules == yaml.safe_load((ROOT / "deploy/prometheus/rules/trace.rules.yml").read_text())
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: `apt-get install -y prometheus`")
    path = tmp_path / "rule.yml"
    path.write_text(yaml.safe_dump(rules))
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "auth.token must be set"),
        (["--set", f"auth.token={TOKEN}"], "redis.password must be set"),
        (
            ["--set", f"auth.token={TOKEN}", "--set", "redis.enabled=false"],
            "set redis.external.url or redis.external.existingSecret",
        ),
        (
            [
                "--set", f"auth.token={TOKEN}", "--set", f"redis.password={TOKEN}",
                "--set", "securityContext.readOnlyRootFilesystem=false",
            ],
            "readOnlyRootFilesystem",
        ),
        (
            ["--set", f"auth.token={TOKEN}", "--set", f"redis.password={TOKEN}", "--set", "rollout.replicas=-1"],
            "replicas",
        ),
        (
            ["--set", f"auth.token={TOKEN}", "--set", f"redis.password={TOKEN}",
             "--set", "rollout.autoscaling.minReplicas=9", "--set", "rollout.autoscaling.maxReplicas=4"],
            "rollout.autoscaling.minReplicas (9) must be <= rollout.autoscaling.maxReplicas (4)",
        ),
        (
            ["--set", f"auth.token={TOKEN}", "--set", f"redis.password={TOKEN}",
             "--set", "rollout.resources.requests.memory=32GB"],
            "rollout.resources.requests.memory",
        ),
        (
            ["--set", f"auth.token={TOKEN}", "--set", f"redis.password={TOKEN}",
             "--set", "trainer.run.stepz=3"],
            "stepz",
        ),
        (
            ["--set", f"auth.token={TOKEN}", "--set", f"redis.password={TOKEN}",
             "--set", "trainer.run.task.name=chess"],
            "trainer.run.task.name",
        ),
    ],
)  # fmt: skip
def test_bad_values_fail_with_a_clear_message(args: list[str], message: str) -> None:
    res = helm_template(*args)
    assert res.returncode != 0, "helm accepted bad values"
    assert message in res.stderr, res.stderr


def test_the_trainer_gets_its_run_from_the_values_as_a_recipe(tmp_path: pathlib.Path) -> None:
    """trainer.run becomes recipe.toml in a ConfigMap mounted into the trainer pod, TRACE_RECIPE
    names it, and the trainer reads exactly the values' run from it (`--set` floats arrive as
    strings and are parsed); a changed run changes the pod's checksum (the trainer restarts)."""
    res = helm_template(
        *VALUE_SETS["defaults"],
        "--set", "trainer.run.steps=7",
        "--set", "trainer.run.task.name=sort",
        "--set", "trainer.run.objective.lr=1e-4",
        "--set", "trainer.run.stores.max_dropped_fraction=0.25",
        "--set", "trainer.run.guidance.layers=2\\,3",
        "--set-json", 'trainer.run.model.overrides={"num_layers": 4}',
        "--set-string", 'trainer.run.task.tokenizer=/models/a "b"',
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.load_all(res.stdout, Loader=_StrictLoader) if d]
    configmap = _by_kind(docs, "ConfigMap")["trace-trainer-recipe"]
    path = tmp_path / "recipe.toml"
    path.write_text(configmap["data"]["recipe.toml"])
    run = load_run_config(path)
    assert (run.run_id, run.steps, run.task.name, run.task.tokenizer) == (
        "trace-run", 7, "sort", '/models/a "b"',
    )  # fmt: skip
    assert (run.objective.lr, run.stores.max_dropped_fraction) == (1e-4, 0.25)
    assert (run.guidance.layers, run.model.overrides) == ("2,3", {"num_layers": 4})
    (trainer,) = [w for w in _workloads(docs) if _component(w) == "trainer"]
    container = _trace_container(trainer)
    env = {e["name"]: e.get("value") for e in container["env"]}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "recipe"]
    assert env["TRACE_RECIPE"] == f"{mount['mountPath']}/recipe.toml" and mount["readOnly"]
    volumes = {v["name"]: v for v in trainer["spec"]["template"]["spec"]["volumes"]}
    assert volumes["recipe"]["configMap"]["name"] == configmap["metadata"]["name"]
    defaults = [d for d in yaml.safe_load_all(helm_template(*VALUE_SETS["defaults"]).stdout) if d]
    (default_trainer,) = [w for w in _workloads(defaults) if _component(w) == "trainer"]
    annotations = "spec", "template", "metadata", "annotations"

    def checksum(w: dict) -> str:
        for key in annotations:
            w = w[key]
        return w["checksum/recipe"]

    assert checksum(trainer) != checksum(default_trainer)
    default_run = _by_kind(defaults, "ConfigMap")["trace-trainer-recipe"]["data"]["recipe.toml"]
    path.write_text(default_run)
    assert (load_run_config(path).steps, load_run_config(path).model.name) == (50, "debug")
    for w in _workloads(defaults):  # only the trainer has a run
        if _component(w) != "trainer" and _component(w) in TRACE:
            assert "TRACE_RECIPE" not in {e["name"] for e in _trace_container(w)["env"]}


def test_trainer_ranks_run_under_torchrun_one_gpu_each() -> None:
    """trainer.ranks = 4: the trainer pod runs 4 learner ranks under torchrun (standalone
    rendezvous in the pod, rank 0 serves), requests 4 GPUs and gets a larger /dev/shm; the
    rollout is untouched, and the default (1) keeps the plain `serve trainer`."""
    base = VALUE_SETS["defaults"]
    res = helm_template(*base, "--set", "trainer.ranks=4", "--set", "trainer.gpus=4")
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.load_all(res.stdout, Loader=_StrictLoader) if d]
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    workloads = {_component(w): w for w in _workloads(docs)}
    trainer = _trace_container(workloads["trainer"])
    assert trainer["command"] == ["torchrun"]
    assert trainer["args"] == [
        "--standalone", "--nproc-per-node=4", "--no-python", "trace-rl", "serve", "trainer",
    ]  # fmt: skip
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trainer["volumeMounts"]
    volumes = {v["name"]: v for v in workloads["trainer"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    rollout = _trace_container(workloads["rollout"])
    assert "command" not in rollout and rollout["args"] == ["serve", "rollout"]
    single = helm_template(*base)
    one = {_component(w): w for w in _workloads(list(yaml.safe_load_all(single.stdout)))}
    assert _trace_container(one["trainer"])["args"] == ["serve", "trainer"]
    assert "command" not in _trace_container(one["trainer"])


def test_trainer_ranks_need_one_gpu_each() -> None:
    res = helm_template(
        *VALUE_SETS["defaults"], "--set", "trainer.ranks=4", "--set", "trainer.gpus=2"
    )
    assert res.returncode != 0, "helm accepted 4 ranks on 2 GPUs"
    assert "trainer.ranks=4 needs trainer.gpus=4" in res.stderr, res.stderr


def test_the_trainer_exposes_its_broadcast_store_at_its_pod_ip(
    rendered: tuple[str, list[dict]],
) -> None:
    """Replicas on other nodes reach the trainer's broadcast store (TRACE_BROADCAST_PORT) at
    the trainer pod's IP, on a named container port; no other component opens one."""
    _, docs = rendered
    for comp, c in _trace_containers(docs):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        env = {e["name"]: e.get("value") for e in c["env"]}
        if comp == "trainer":
            assert ports["broadcast"] == int(env["TRACE_BROADCAST_PORT"]) == 29510
            assert env["TRACE_BROADCAST_HOST"] == "$(POD_IP)"
            names = [e["name"] for e in c["env"]]
            assert names.index("POD_IP") < names.index("TRACE_BROADCAST_HOST")  # expanded
        else:
            assert "broadcast" not in ports and "TRACE_BROADCAST_PORT" not in env, comp
    moved = helm_template(*VALUE_SETS["defaults"], "--set", "trainer.broadcastPort=70000")
    assert moved.returncode != 0 and "broadcastPort" in moved.stderr
