"""A sandbox for untrusted Python (a model's completion) run against unit tests.

`run_tests(code, tests, limits)` runs `code`, then each test snippet, in a fresh isolated
interpreter (``python -I -S``, standard library only) and counts the tests that ran without
an exception. What contains it, layer by layer:

- **its own directory**: a new temporary directory is its working directory, HOME and TMPDIR,
  deleted afterwards; the environment holds nothing of the caller's (no tokens, no keys).
- **no network**: a new network namespace (only a down loopback) where the kernel lets this
  process make one, and in any case the harness's audit hook refuses every socket call.
- **no files outside**: the audit hook refuses opening files outside the directory (the
  standard library and /dev/null, /dev/urandom may be read) and changing any file outside.
- **no processes**: the audit hook refuses fork, exec, spawn, system, subprocess and kill;
  the interpreter leads its own session, and the whole process group is killed (SIGKILL) at
  the end, so nothing it started survives. It also dies with its parent (PR_SET_PDEATHSIG).
- **limits**: RLIMIT_AS (memory), RLIMIT_FSIZE (file size), RLIMIT_NOFILE, no core dumps,
  RLIMIT_CPU as a backstop, and a wall-clock timeout after which the group is killed.

Results come back on a pipe, not stdout, one JSON line per test stamped with a random nonce
(the job file that carried it is deleted before the code runs): printing a fake result, or
exiting early with status 0, earns nothing. Residual risks, stated plainly:
- the code runs in the harness's interpreter, so a completion that walks the harness's
  frames (``sys._getframe``, which the standard library itself needs and so stays allowed)
  can reach the nonce and forge results; RL can find such hacks, so watch for rewards that
  jump without the code improving;
- this is process-level isolation in Python, not a security boundary against a determined
  adversary (a gap in CPython's audit events would be a way out): run untrusted code at scale
  in a container or VM as well.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

HARNESS = pathlib.Path(__file__).with_name("_sandbox_harness.py")
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
MAX_TESTS = 1000
MAX_RESULT_BYTES = 1 << 20  # result lines kept from the pipe


@dataclass(kw_only=True, slots=True, frozen=True)
class SandboxLimits:
    """What a sandboxed run may use."""

    timeout_s: float = 10.0  # wall clock of the whole run
    memory_bytes: int = 512 * 2**20  # address space (RLIMIT_AS)
    file_size_bytes: int = 16 * 2**20  # largest file it may write (RLIMIT_FSIZE)
    max_open_files: int = 64
    max_output_bytes: int = 64 * 2**10  # stdout/stderr kept for `detail`

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"sandbox timeout_s must be in (0, 3600], got {self.timeout_s}")
        if self.memory_bytes < 64 * 2**20:
            raise ValueError(f"sandbox memory_bytes must be >= 64 MiB, got {self.memory_bytes}")
        if self.file_size_bytes < 0 or self.max_open_files < 16 or self.max_output_bytes < 0:
            raise ValueError(
                f"sandbox limits out of range: file_size_bytes={self.file_size_bytes}, "
                f"max_open_files={self.max_open_files}, max_output_bytes={self.max_output_bytes}"
            )


@dataclass(kw_only=True, slots=True, frozen=True)
class SandboxResult:
    """How a run ended: tests passed of `total`, and why it stopped."""

    passed: int
    total: int
    # ok: every test ran; error: the code raised before the tests; memory: over the memory
    # limit; timeout: over the wall clock (tests reported before it count); crashed: the
    # interpreter died (a signal, an exit) before reporting every test.
    status: Literal["ok", "error", "memory", "timeout", "crashed"]
    detail: str
    seconds: float


def _network_namespace_flags() -> int:
    """The unshare() flags that give this process a new network namespace, or 0 if none can
    be had (checked once, in a throwaway child)."""
    global _NETNS_FLAGS
    if _NETNS_FLAGS is None:
        _NETNS_FLAGS = 0
        for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
            pid = os.fork()
            if pid == 0:  # the child tries, and says by its exit code
                code = ctypes.CDLL(None, use_errno=True).unshare(flags)
                os._exit(0 if code == 0 else 1)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) == 0:
                _NETNS_FLAGS = flags
                break
    return _NETNS_FLAGS


_NETNS_FLAGS: int | None = None


def network_isolated() -> bool:
    """Whether sandboxed runs get their own network namespace here (else only the hook)."""
    return _network_namespace_flags() != 0


def _child_setup(limits: SandboxLimits, netns_flags: int) -> None:
    """Runs in the forked child before exec: namespaces, limits, death with the parent."""
    libc = ctypes.CDLL(None, use_errno=True)
    if netns_flags:
        libc.unshare(netns_flags)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    cpu = int(limits.timeout_s) + 2  # a backstop: the wall clock normally ends it first
    for res, value in (
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
        (resource.RLIMIT_NOFILE, limits.max_open_files),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, cpu),
    ):
        resource.setrlimit(res, (value, value))


def run_tests(
    code: str, tests: Sequence[str], limits: SandboxLimits | None = None, *,
    python: str = sys.executable,
) -> SandboxResult:  # fmt: skip
    """Run `code` and then each of `tests` in the sandbox; a test passes when it runs without
    an exception."""
    limits = limits or SandboxLimits()
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    tests = list(tests)
    if not tests or len(tests) > MAX_TESTS or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"tests must be 1-{MAX_TESTS} strings, got {tests!r:.200}")
    t0 = time.monotonic()
    netns = _network_namespace_flags()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="trace-sandbox-"))
    nonce = secrets.token_hex(16)
    job = workdir / "job.json"
    job.write_text(json.dumps({"nonce": nonce, "code": code, "tests": tests}))
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir),
           "TMPDIR": str(workdir), "PYTHONHASHSEED": "0"}  # fmt: skip
    try:
        with tempfile.TemporaryFile() as output:
            raw, timed_out, returncode = _run(python, job, workdir, env, output, limits, netns,
                                              t0)  # fmt: skip
            output.seek(0)
            tail = output.read()[-limits.max_output_bytes :].decode(errors="replace")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _result(raw, nonce, len(tests), timed_out, returncode, tail, time.monotonic() - t0)


def _run(python: str, job: pathlib.Path, workdir: pathlib.Path, env: dict[str, str],
         output: Any, limits: SandboxLimits, netns: int, t0: float) -> tuple[bytes, bool, int]:  # fmt: skip
    """Start the harness, read its results until it exits or the wall clock ends, then kill
    its process group: (results, timed out, exit status)."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [python, "-I", "-S", "-B", str(HARNESS), str(job), str(write_fd)],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=output,
            stderr=subprocess.STDOUT, pass_fds=(write_fd,), start_new_session=True,
            preexec_fn=lambda: _child_setup(limits, netns),
        )  # fmt: skip
    finally:
        os.close(write_fd)
    try:
        raw, timed_out = _read_until_eof(read_fd, t0 + limits.timeout_s)
    finally:
        os.close(read_fd)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running; itself on timeout
        returncode = proc.wait()
    return raw, timed_out, returncode


def _read_until_eof(fd: int, deadline: float) -> tuple[bytes, bool]:
    """What the harness writes until it closes the pipe (it exits), or the deadline."""
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return b"".join(chunks), True
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), False
        if size < MAX_RESULT_BYTES:
            chunks.append(chunk)
            size += len(chunk)


def _result(raw: bytes, nonce: str, total: int, timed_out: bool, returncode: int, tail: str,
            seconds: float) -> SandboxResult:  # fmt: skip
    passed: set[int] = set()
    ended = None
    detail = ""
    for line in raw.decode(errors="replace").splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(msg, dict) or msg.get("nonce") != nonce:
            continue  # not the harness's
        event = msg.get("event")
        if event == "test" and msg.get("ok") is True and isinstance(msg.get("index"), int):
            passed.add(msg["index"])
        elif event in ("done", "error", "memory"):
            ended = event
            detail = str(msg.get("detail", ""))
    n = len([i for i in passed if 0 <= i < total])
    if timed_out:
        status, detail = "timeout", "over the wall-clock limit"
    elif ended == "done":
        status = "ok"
    elif ended in ("error", "memory"):
        status = ended
    else:
        status = "crashed"
        detail = f"exit status {returncode}: {tail[-300:]}"
    return SandboxResult(passed=n, total=total, status=status, detail=detail, seconds=seconds)
