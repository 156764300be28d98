"""The reward pool: rewards run in worker processes beside the trainer.

Each of `workers` slots owns one worker process (`trace_common.rewards.worker`) and feeds it
calls from one queue, so rewards of a step run in parallel with each other and, as the
trainer submits each work unit's samples when the unit arrives, with the rest of the rollout.
A call that raises scores 0 with status "error"; one that runs past `timeout_s` scores 0 with
status "timeout", and its worker is killed with its process group and replaced; a worker that
dies mid-call scores 0 with status "error". Nothing a reward does fails the step: the caller
counts the statuses (metrics.jsonl ``reward_errors`` / ``reward_timeouts``, Prometheus
``trace_trainer_reward_failures_total{reason}``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from trace_common.rewards.frames import HEADER, MAX_FRAME_BYTES, write_frame
from trace_common.rewards.registry import RewardError, load_reward

log = logging.getLogger(__name__)

EXIT_WAIT_S = 1.0  # how long a worker whose pipe closed is given to exit, for its code

STARTUP_TIMEOUT_S = 60.0  # a worker that does not import its reward in this long has failed


@dataclass(frozen=True, slots=True)
class RewardOutcome:
    """One reward call's result: the score, and what happened."""

    value: float
    # truncated: not scored, the completion had no EOS (the trainer's reward.truncated = zero)
    status: Literal["ok", "error", "timeout", "truncated"] = "ok"
    detail: str = ""


@dataclass(kw_only=True, slots=True, frozen=True)
class RewardPoolConfig:
    """The reward and how it runs."""

    name: str = "exact_match"
    options: Mapping[str, Any] = field(default_factory=dict)
    workers: int = 2
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 256:
            raise ValueError(f"reward workers must be in [1, 256], got {self.workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {self.timeout_s}")


@dataclass(slots=True)
class _Call:
    row: Mapping[str, Any]
    completion: str
    future: Future[RewardOutcome]


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and the channel to it."""

    def __init__(self, cfg: RewardPoolConfig) -> None:
        env = dict(os.environ)
        # The worker imports what this process can: the project, and a custom reward's module.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trace_common.rewards.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            start_new_session=True,  # its own process group: a kill takes its children too
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in = self.proc.stdin
        self._out_fd = self.proc.stdout.fileno()
        try:
            write_frame(self._in, (cfg.name, dict(cfg.options)))
            status, _, detail = self.recv(STARTUP_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        if status != "ready":
            self.kill()
            raise RewardError(f"reward {cfg.name!r} failed to load in its worker: {detail}")

    def call(self, row: Mapping[str, Any], completion: str, timeout_s: float) -> RewardOutcome:
        try:
            write_frame(self._in, (dict(row), completion))
        except (BrokenPipeError, OSError) as e:
            raise _WorkerDied(f"reward worker gone: {e}") from None
        status, value, detail = self.recv(timeout_s)
        return RewardOutcome(value=float(value), status=status, detail=detail)

    def recv(self, timeout_s: float) -> tuple[str, float, str]:
        """One answer; TimeoutError past `timeout_s`, _WorkerDied on a closed channel."""
        import pickle

        deadline = time.monotonic() + timeout_s
        header = self._read(HEADER.size, deadline)
        (n,) = HEADER.unpack(header)
        if n > MAX_FRAME_BYTES:
            raise _WorkerDied(f"reward worker sent a frame of {n} bytes")
        return pickle.loads(self._read(n, deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        buf = b""
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self._out_fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(self._out_fd, n - len(buf))
            if not chunk:
                # The pipe closes as the process exits, a moment before it can be reaped.
                try:
                    code = self.proc.wait(timeout=EXIT_WAIT_S)
                except subprocess.TimeoutExpired:
                    code = None
                raise _WorkerDied(f"reward worker exited (code {code})")
            buf += chunk
        return buf

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class RewardPool:
    """`submit(row, completion)` -> a Future of the RewardOutcome; `close()` stops the
    workers. The reward is loaded here first, so a bad name, option or import fails at once
    with its error (RewardError)."""

    def __init__(self, cfg: RewardPoolConfig) -> None:
        self.cfg = cfg
        self.reward = load_reward(cfg.name, cfg.options)
        self._calls: queue.Queue[_Call | None] = queue.Queue()
        self._closed = False
        first = _Worker(cfg)  # the reward imports in a worker too (else: RewardError now)
        self._slots = [
            threading.Thread(
                target=self._serve, args=(first if i == 0 else None,),
                name=f"reward-slot-{i}", daemon=True,
            )
            for i in range(cfg.workers)
        ]  # fmt: skip
        for t in self._slots:
            t.start()

    @property
    def fields(self) -> tuple[str, ...]:
        return self.reward.fields

    def submit(self, row: Mapping[str, Any], completion: str) -> Future[RewardOutcome]:
        if self._closed:
            raise RuntimeError("reward pool is closed")
        fut: Future[RewardOutcome] = Future()
        self._calls.put(_Call(row=row, completion=completion, future=fut))
        return fut

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._slots:
            self._calls.put(None)
        for t in self._slots:
            t.join(timeout=self.cfg.timeout_s + 5)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, worker: _Worker | None) -> None:
        try:
            while True:
                call = self._calls.get()
                if call is None:
                    return
                try:
                    if worker is None:
                        worker = _Worker(self.cfg)
                    outcome = worker.call(call.row, call.completion, self.cfg.timeout_s)
                except TimeoutError:
                    log.warning("reward %r timed out after %.1fs: worker replaced",
                                self.cfg.name, self.cfg.timeout_s)  # fmt: skip
                    outcome = RewardOutcome(0.0, "timeout", f"over {self.cfg.timeout_s:g}s")
                    worker = self._drop(worker)
                except (_WorkerDied, RewardError, OSError, EOFError) as e:
                    log.warning("reward worker failed: %s: replaced", e)
                    outcome = RewardOutcome(0.0, "error", str(e))
                    worker = self._drop(worker)
                if outcome.status == "error":
                    log.info("reward %r raised: %s", self.cfg.name, outcome.detail)
                call.future.set_result(outcome)
        finally:
            self._drop(worker)

    @staticmethod
    def _drop(worker: _Worker | None) -> None:
        if worker is not None:
            worker.kill()
        return None
