"""The Dockerfiles without a Docker engine: multi-stage, non-root, pinned dependencies that
cover the project's runtime requirements, torch handled per variant, build context complete."""

from __future__ import annotations

import fnmatch
import importlib.util
import pathlib
import re
import sys
import tomllib
import types

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOCKER = ROOT / "deploy/docker"
LOCK = DOCKER / "requirements.lock"
IMAGE_EXTRAS = ("hf", "data")  # what deploy/docker/lock_requirements.py locks by default
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and heredoc bodies dropped."""
    out: list[tuple[str, str]] = []
    lines = (DOCKER / name).read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        heredoc = re.search(r"<<'?(\w+)'?", line)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_non_root(name: str) -> None:
    ins = instructions(name)
    froms = [args for word, args in ins if word == "FROM"]
    assert len(froms) >= 2 and froms[0].endswith("AS build") and froms[-1].endswith("AS runtime")
    final_stage = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    users = [args for word, args in final_stage if word == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0"), users
    assert ("ARG", "TRACE_UID=10001") in final_stage
    assert any(w == "COPY" and a.startswith("--from=build /opt/venv") for w, a in final_stage)
    assert ("ENTRYPOINT", '["trace-rl"]') in ins


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_context_has_what_the_images_copy(name: str) -> None:
    """Every COPY source exists and is not excluded by .dockerignore."""
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]

    def included(path: str) -> bool:
        keep = True  # last matching pattern wins, `!` re-includes
        for pat in patterns:
            neg = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            if (
                fnmatch.fnmatch(path, pat)
                or path.startswith(pat + "/")
                or fnmatch.fnmatch(path, pat + "/*")
            ):
                keep = neg
        return keep

    for word, args in instructions(name):
        if word != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for src in sources:
            src = src.rstrip("/")
            assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
            assert included(src), f"{name}: COPY {src} is excluded by .dockerignore"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_carry_the_run_recipes(name: str) -> None:
    """`trace-rl serve trainer --config /opt/trace/recipes/<name>.toml` works in the image."""
    ins = instructions(name)
    final_stage = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    assert ("COPY", "recipes/ /opt/trace/recipes/") in final_stage


def test_cpu_image_pins_the_cpu_torch() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert "https://download.pytorch.org/whl/cpu" in text
    assert "-c constraints/cpu.txt" in text
    assert "torch==2.13.0" in (ROOT / "constraints/cpu.txt").read_text()


def test_cuda_image_never_replaces_its_torch() -> None:
    ins = instructions("Dockerfile.cuda")
    assert re.fullmatch(
        r"BASE_IMAGE=pytorch/pytorch:[\w.]+-cuda[\d.]+-cudnn\d+-runtime",
        next(a for w, a in ins if w == "ARG"),
    )
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert "pip list --format=freeze" in runs and "-c /tmp/base-constraints.txt" in runs
    assert "--system-site-packages" in runs
    assert "diff - /tmp/torch-before.txt" in runs, "the build must prove torch is unchanged"
    for w, a in ins:
        if w == "RUN" and "pip install" in a:
            assert not re.search(r"pip install[^&]*\btorch\b", a), f"installs torch: {a}"


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"unpinned line in requirements.lock: {line!r}"
            assert canonicalize_name(name) not in pins, f"duplicate pin {name}"
            pins[canonicalize_name(name)] = version
    return pins


def test_lock_pins_every_runtime_dependency() -> None:
    """Each requirement of trace-rl[hf] (but torch) is pinned at a version that satisfies it.
    Regenerate with: .venv/bin/python deploy/docker/lock_requirements.py"""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in IMAGE_EXTRAS:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    pins = _lock()
    assert "torch" not in pins
    problems = []
    for req in reqs:
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        if name not in pins:
            problems.append(f"{req} is not pinned")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{req} but the lock pins {pins[name]}")
    assert not problems, [*problems, "run .venv/bin/python deploy/docker/lock_requirements.py"]


def _lock_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "lock_requirements", DOCKER / "lock_requirements.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lock_equals_the_installed_closure() -> None:
    """The lock is exactly what `make` installed: the same lines lock_requirements.py writes
    from this venv. The CPU venv is built against the lock (`-c requirements.lock`), so a
    difference means the lock was edited by hand or the venv predates it.
    Regenerate with `make lock`."""
    marker = pathlib.Path(sys.prefix) / ".trace-lock"
    if not marker.exists():
        pytest.skip(
            "this venv was not built against the lock (`make GPU=1` keeps the system's "
            "packages, or it was made by hand); `make test` on CPU checks it"
        )
    if marker.read_text() != LOCK.read_text():
        pytest.fail("the venv was built from an older lock: rerun `make venv`")
    lock = _lock_module()
    expected = lock.render(lock.closure(lock.PROJECT, IMAGE_EXTRAS), IMAGE_EXTRAS)
    assert LOCK.read_text() == expected, "requirements.lock differs from the venv: `make lock`"
