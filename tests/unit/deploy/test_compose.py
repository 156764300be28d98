"""docker-compose.yml (+ the GPU override) against the strict offline compose-spec validator,
and its wiring against the project: real entry points, Prometheus targets, secrets, scaling."""

from __future__ import annotations

import importlib
import pathlib
import re
import tomllib

import compose_spec
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"
PROMETHEUS = ROOT / "deploy/prometheus/prometheus.yml"
TRACE_SERVICES = ("quant-cache", "weight-sync", "trainer", "rollout")
GPU_SERVICES = ("trainer", "rollout")

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}; `$$` is a literal `$`.
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def read_env_file(path: pathlib.Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution (what `docker compose config` does before validating)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$$"  # compose keeps `$$` until the container command; still a valid string
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise KeyError(f"compose would stop: {name} is required ({arg})")
        if op == ":-" and not value:
            return arg
        if op == "-" and value is None:
            return arg
        return value or ""

    return _VAR.sub(sub, text)


def load(path: pathlib.Path, env: dict[str, str]) -> dict:
    """Interpolate with `env`, then parse and validate with compose-spec (merge keys applied)."""
    project = compose_spec.PyOptions(apply_merge=True).from_yaml(interpolate(path.read_text(), env))
    project.validate()
    return project.to_dict()


def merge(base: dict, override: dict) -> dict:
    """Compose's override merge for the keys the GPU file uses (mappings merge, scalars replace)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def compose(env: dict[str, str]) -> dict:
    return load(COMPOSE, env)


def serve_targets() -> dict[str, str]:
    """`trace-rl serve X`: X -> module, from the CLI's own dispatch table."""
    import typer

    from trace_common import cli

    root = typer.main.get_command(cli.app)
    assert "serve" in getattr(root, "commands", {}), "trace-rl has no `serve` command"
    return dict(cli.SERVICES)


def test_compose_validates_strictly(compose: dict) -> None:
    assert set(compose["services"]) == {*TRACE_SERVICES, "redis", "prometheus", "grafana"}


def test_compose_rejects_what_docker_would(env: dict[str, str]) -> None:
    """The validator is strict: an unknown key or a secret that is not declared fails."""
    text = COMPOSE.read_text()
    bad_key = text.replace("  init: true\n", "  init: true\n  inti: true\n", 1)
    assert bad_key != text
    with pytest.raises(ValueError, match="inti"):
        compose_spec.PyOptions(apply_merge=True).from_yaml(interpolate(bad_key, env)).validate()
    bad_secret = text.replace("- trace_auth_token\n", "- no_such_secret\n", 1)
    assert bad_secret != text
    with pytest.raises(ValueError, match="no_such_secret"):
        compose_spec.PyOptions(apply_merge=True).from_yaml(interpolate(bad_secret, env)).validate()


def test_missing_secret_stops_compose(env: dict[str, str]) -> None:
    without = {k: v for k, v in env.items() if k != "REDIS_PASSWORD"}
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        load(COMPOSE, without)


def test_images_run_the_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("trace-rl") == "trace_common.cli:app"
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / "deploy/docker" / dockerfile).read_text()
        assert 'ENTRYPOINT ["trace-rl"]' in text, dockerfile


@pytest.mark.parametrize(
    "name",
    [
        "quant-cache",
        "weight-sync",
        "trainer",
        "rollout",
    ],
)
def test_every_service_runs_a_real_entry_point(compose: dict, name: str) -> None:
    """The container command is `trace-rl serve <name>` and the CLI runs a real `main()`."""
    command = compose["services"][name]["command"]
    assert command == ["serve", name], command
    targets = serve_targets()
    assert name in targets, f"`trace-rl serve {name}` is not a serve target: {sorted(targets)}"
    module = importlib.import_module(targets[name])
    assert callable(getattr(module, "main", None)), f"{targets[name]} has no main()"


def test_rollout_scales(compose: dict) -> None:
    rollout = compose["services"]["rollout"]
    assert "container_name" not in rollout
    assert "ports" not in rollout, "fixed host ports would break --scale rollout=N"
    assert "hostname" not in rollout


def test_ports_agree_with_prometheus_and_healthchecks(compose: dict) -> None:
    scrape = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    for name in TRACE_SERVICES:
        svc = compose["services"][name]
        env = svc["environment"]
        http, grpc = int(env["TRACE_HTTP_PORT"]), int(env["TRACE_GRPC_PORT"])
        assert {http, grpc} <= {int(p) for p in svc["expose"]}, name
        job = jobs[f"trace-{name}"]
        if name == "rollout":
            (sd,) = job["dns_sd_configs"]
            assert sd["names"] == ["rollout"] and sd["type"] == "A" and sd["port"] == http
        else:
            assert job["static_configs"][0]["targets"] == [f"{name}:{http}"]
    for client in ("trainer", "rollout"):
        env = compose["services"][client]["environment"]
        for var, name in (
            ("TRACE_QUANT_CACHE_ADDRESS", "quant-cache"),
            ("TRACE_WEIGHT_SYNC_ADDRESS", "weight-sync"),
        ):
            port = compose["services"][name]["environment"]["TRACE_GRPC_PORT"]
            assert env[var] == f"{name}:{port}", (client, var)
    # Replicas dial weight-sync's bulk data plane at weight-sync:<TRACE_DATA_PLANE_PORT>.
    ws = compose["services"]["weight-sync"]
    assert int(ws["environment"]["TRACE_DATA_PLANE_PORT"]) in {int(p) for p in ws["expose"]}


def test_services_bind_every_interface_explicitly(compose: dict) -> None:
    """Containers are reached by their service name, so each binds 0.0.0.0 for gRPC and
    HTTP (weight-sync's data plane binds the gRPC host), set here rather than left to a
    default: local launchers bind 127.0.0.1."""
    for name in TRACE_SERVICES:
        env = compose["services"][name]["environment"]
        assert env.get("TRACE_GRPC_HOST") == "0.0.0.0", name
        assert env.get("TRACE_HTTP_HOST") == "0.0.0.0", name


def settings_class(name: str) -> type:
    """The pydantic-settings class of `trace-rl serve <name>` (services/<pkg>/config.py)."""
    from trace_common.service.config import ServiceSettings

    package = serve_targets()[name].rsplit(".", 1)[0]
    config = importlib.import_module(f"{package}.config")
    classes = [
        c
        for c in vars(config).values()
        if isinstance(c, type)
        and issubclass(c, ServiceSettings)
        and c.__module__ == config.__name__
    ]  # the service's own class, not the bases it builds on
    assert len(classes) == 1, f"{package}.config: expected one settings class, got {classes}"
    return classes[0]


@pytest.mark.parametrize(
    "name",
    [
        "quant-cache",
        "weight-sync",
        "trainer",
        "rollout",
    ],
)
def test_every_trace_variable_is_a_real_setting(compose: dict, name: str) -> None:
    """A misspelt TRACE_* variable would be ignored silently (extra="ignore"): each one the
    compose file sets must be a field of that service's settings."""
    svc = compose["services"][name]
    names = {k for k in svc["environment"] if k.startswith("TRACE_")}
    names |= set(re.findall(r"\b(TRACE_[A-Z0-9_]+)=", " ".join(svc.get("entrypoint", []))))
    unknown = sorted(names - settings_class(name).env_names())
    assert not unknown, f"{name}: not settings of {settings_class(name).__name__}: {unknown}"


def test_rollout_advertises_its_own_address(compose: dict) -> None:
    """Each replica reads its container IP at start, so N replicas register N addresses."""
    entrypoint = compose["services"]["rollout"]["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-c"] and entrypoint[-1] == "trace-rl"
    assert 'TRACE_ADVERTISE_HOST="$$(hostname -i' in entrypoint[2]
    assert entrypoint[2].endswith('exec trace-rl "$$@"')


def test_redis_is_a_bounded_password_protected_cache(compose: dict) -> None:
    redis = compose["services"]["redis"]
    cmd = " ".join(redis["command"])
    assert "requirepass" in cmd and "/run/secrets/redis_password" in cmd
    assert "--maxmemory 2gb" in cmd and "--maxmemory-policy volatile-ttl" in cmd
    assert "--save ''" in cmd and "--appendonly no" in cmd
    url = compose["services"]["quant-cache"]["environment"]["TRACE_REDIS_URL"]
    assert url.startswith("redis://:") and url.endswith("@redis:6379/0")


def test_no_secret_is_hard_coded(compose: dict, env: dict[str, str]) -> None:
    """Secrets come from .env (interpolated) and reach TRACE services as Docker secrets."""
    text = COMPOSE.read_text()
    for name in ("TRACE_AUTH_TOKEN", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD"):
        assert env[name].startswith("replace"), f".env.example must not ship a real {name}"
        assert compose["secrets"][
            {
                "TRACE_AUTH_TOKEN": "trace_auth_token",
                "REDIS_PASSWORD": "redis_password",
                "GRAFANA_ADMIN_PASSWORD": "grafana_admin_password",
            }[name]
        ] == {"environment": name}
    assert "TRACE_AUTH_TOKEN:" not in text and "TRACE_AUTH_TOKEN=" not in text
    for name in TRACE_SERVICES:
        svc = compose["services"][name]
        assert "trace_auth_token" in svc["secrets"], name
        assert svc["environment"]["TRACE_AUTH_TOKEN_FILE"] == "/run/secrets/trace_auth_token"
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()


def test_bind_mounts_exist(compose: dict) -> None:
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":", 1)[0] if isinstance(vol, str) else vol.get("source", "")
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"


def test_the_trainer_runs_a_mounted_recipe(compose: dict, env: dict[str, str]) -> None:
    """The run is a recipe file of the host (TRACE_TRAINER_RECIPE, default recipes/deploy.toml)
    mounted read-only into the trainer and named by TRACE_RECIPE; the trainer accepts it. No
    run key is a variable of any service or of .env.example (the trainer would refuse it)."""
    from trace_common.config import check_no_run_env, load_run_config

    svc = compose["services"]["trainer"]
    target = svc["environment"]["TRACE_RECIPE"]
    mounts = [
        v.split(":") if isinstance(v, str) else [v["source"], v["target"], "ro" * v["read_only"]]
        for v in svc["volumes"]
    ]
    (source,) = [m[0] for m in mounts if m[1] == target and m[2:] == ["ro"]]
    assert source == env["TRACE_TRAINER_RECIPE"] == "./recipes/deploy.toml"
    run = load_run_config(ROOT / source)
    assert (run.model.name, run.task.name, run.steps) == ("debug", "addition", 50)
    for s in compose["services"].values():
        check_no_run_env(s.get("environment") or {})
    check_no_run_env(env)


def test_gpu_override(compose: dict, env: dict[str, str]) -> None:
    override = load(COMPOSE_GPU, env)
    assert set(override["services"]) == set(GPU_SERVICES)
    merged = merge(compose, override)
    for name in GPU_SERVICES:
        svc = merged["services"][name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda", name
        assert svc["command"] == compose["services"][name]["command"]
        # the device: cpu in the base file, cuda with the GPU override (each container's GPU)
        assert compose["services"][name]["environment"]["TRACE_DEVICE"] == "cpu", name
        assert svc["environment"]["TRACE_DEVICE"] == "cuda", name
    # The base file alone reserves no GPU: it runs on a CPU host.
    for svc in compose["services"].values():
        assert "deploy" not in svc


def test_ranks_override_runs_the_trainer_under_torchrun(compose: dict, env: dict[str, str]) -> None:
    """docker-compose.ranks.yml: the trainer container runs TRACE_TRAINER_RANKS learner ranks
    under torchrun (`trace-rl serve trainer` as each rank's program), with a larger /dev/shm;
    nothing else changes."""
    override = load(ROOT / "docker-compose.ranks.yml", env)
    assert set(override["services"]) == {"trainer"}
    gpu = merge(compose, load(COMPOSE_GPU, env))
    svc = merge(gpu, override)["services"]["trainer"]
    ranks = env["TRACE_TRAINER_RANKS"]
    assert svc["entrypoint"] == [
        "torchrun", "--standalone", f"--nproc-per-node={ranks}", "--no-python", "trace-rl",
    ]  # fmt: skip
    assert svc["command"] == ["serve", "trainer"]  # each rank: trace-rl serve trainer
    assert svc["shm_size"] == "8gb"
    assert svc["environment"]["TRACE_DEVICE"] == "cuda"
