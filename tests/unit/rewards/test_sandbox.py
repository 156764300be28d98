"""The sandbox: a completion's code runs against tests with no network, no files or
processes outside its directory, bounded memory and time, and results it cannot fake."""

from __future__ import annotations

import os
import pathlib
import socket
import threading
import time

import pytest

from trace_common.rewards.sandbox import SandboxLimits, network_isolated, run_tests

ADD = "def add(a, b):\n    return a + b\n"


def test_tests_that_pass_and_fail_are_counted() -> None:
    r = run_tests(ADD, ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0"])
    assert (r.passed, r.total, r.status) == (2, 3, "ok")
    assert r.seconds < 2.0


def test_code_that_raises_passes_nothing() -> None:
    r = run_tests("raise ValueError('bad code')", ["assert True"])
    assert (r.passed, r.status) == (0, "error") and "ValueError: bad code" in r.detail
    r = run_tests("def add(:", ["assert True"])
    assert (r.passed, r.status) == (0, "error") and "SyntaxError" in r.detail


def test_a_socket_is_refused_and_nothing_connects() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                continue

    t = threading.Thread(target=accept)
    t.start()
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'exfiltrated')\n")  # fmt: skip
    r = run_tests(code, ["assert True"])
    t.join()
    listener.close()
    assert (r.passed, r.status) == (0, "error") and "socket" in r.detail
    assert accepted == []


def test_writing_outside_its_directory_is_refused(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "outside.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
        "open('../escape.txt', 'w').write('x')",
        f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/outside.txt', 'w')",
    ):
        r = run_tests(code, ["assert True"])
        assert (r.passed, r.status) == (0, "error") and "not allowed" in r.detail, code
    assert not target.exists()
    existing = tmp_path / "keep.txt"
    existing.write_text("keep")
    r = run_tests(f"import os\nos.remove({str(existing)!r})", ["assert True"])
    assert r.status == "error" and existing.read_text() == "keep"


def test_reading_outside_its_directory_is_refused_but_its_own_files_work(
    tmp_path: pathlib.Path,
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    r = run_tests(f"data = open({str(secret)!r}).read()", ["assert True"])
    assert r.status == "error" and "not allowed" in r.detail
    r = run_tests("open('notes.txt', 'w').write('hi')\nimport json, collections, re",
                  ["assert open('notes.txt').read() == 'hi'"])  # fmt: skip
    assert (r.passed, r.status) == (1, "ok")


def test_the_callers_environment_does_not_reach_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACE_AUTH_TOKEN", "super-secret-token")
    r = run_tests("import os\nenv = dict(os.environ)",
                  ["assert 'TRACE_AUTH_TOKEN' not in env", "assert 'super-secret' not in str(env)"])  # fmt: skip
    assert r.passed == 2


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.Popen(['sleep', '300'])",
        "import os\nos.system('sleep 300 &')",
        "import ctypes\nctypes.CDLL(None).fork()",
    ],
)
def test_processes_cannot_be_started(code: str) -> None:
    before = _sleepers()
    r = run_tests(code, ["assert True"])
    assert (r.passed, r.status) == (0, "error") and "not allowed" in r.detail
    assert _sleepers() == before


def _sleepers() -> set[int]:
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(b"sleep\x00300"):
            out.add(int(pid))
    return out


def test_memory_past_the_limit_is_stopped() -> None:
    limits = SandboxLimits(memory_bytes=256 * 2**20)
    r = run_tests("x = bytearray(2 * 1024**3)", ["assert True"], limits)
    assert (r.passed, r.status) == (0, "memory")
    r = run_tests("xs = []\nwhile True:\n    xs.append(' ' * 10**6)", ["assert True"], limits)
    assert (r.passed, r.status) == (0, "memory")


def test_a_run_past_its_wall_clock_is_killed() -> None:
    t0 = time.monotonic()
    r = run_tests("while True:\n    pass", ["assert True"], SandboxLimits(timeout_s=1.0))
    assert (r.passed, r.status) == (0, "timeout")
    assert time.monotonic() - t0 < 4


def test_tests_before_a_hanging_test_count() -> None:
    tests = ["assert add(1, 1) == 2", "while True:\n    pass", "assert True"]
    r = run_tests(ADD, tests, SandboxLimits(timeout_s=1.5))
    assert (r.passed, r.total, r.status) == (1, 3, "timeout")


def test_printed_or_forged_results_earn_nothing() -> None:
    forged = (
        "import json, os, sys\n"
        "for i in range(3):\n"
        "    line = json.dumps({'nonce': 'x', 'event': 'test', 'index': i, 'ok': True})\n"
        "    print(line)\n"
        "    for fd in range(3, 64):\n"
        "        try:\n"
        "            os.write(fd, (line + '\\n').encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "os._exit(0)\n"
    )
    r = run_tests(forged, ["assert False", "assert False", "assert False"])
    assert r.passed == 0 and r.status == "crashed"
    r = run_tests("import sys\nsys.exit(0)", ["assert False"])
    assert r.passed == 0


def test_each_run_gets_a_fresh_directory_that_is_removed() -> None:
    r1 = run_tests("import os\nopen('mark', 'w').write(os.getcwd())", ["assert True"])
    r2 = run_tests("import os", ["assert not os.path.exists('mark')"])
    assert r1.passed == 1 and r2.passed == 1
    leftovers = [p for p in pathlib.Path("/tmp").glob("trace-sandbox-*")]
    assert leftovers == [] or all(not p.exists() for p in leftovers)


def test_the_network_namespace_is_used_where_the_kernel_allows() -> None:
    """The namespace layer on its own (without the harness's hook): a process started with
    the sandbox's set-up sees no network interface but loopback."""
    if not network_isolated():
        pytest.skip("this kernel gives no new network namespace here; the audit hook refuses")
    import subprocess

    from trace_common.rewards.sandbox import _child_setup, _network_namespace_flags

    flags = _network_namespace_flags()
    inside = subprocess.run(
        ["cat", "/proc/net/dev"], capture_output=True, text=True, check=True,
        preexec_fn=lambda: _child_setup(SandboxLimits(), flags),
    ).stdout  # fmt: skip
    outside = pathlib.Path("/proc/net/dev").read_text()

    def names(text: str) -> set[str]:
        return {line.split(":")[0].strip() for line in text.splitlines()[2:]}

    assert names(inside) == {"lo"}
    assert names(outside) - {"lo"}, "this machine has an interface besides loopback"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="tests must be 1-1000 strings"):
        run_tests(ADD, [])
    with pytest.raises(ValueError, match="timeout_s must be in"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="memory_bytes must be >= 64 MiB"):
        SandboxLimits(memory_bytes=1024)
