"""The trainer fails loudly: a run that drops most of its samples ends "failed" (not
"finished"), sets trace_trainer_run_failed, and /healthz answers 503 so liveness restarts it.
The loop runs for real; its step, the publisher and the directory are small fakes."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient

from services.trainer.app import TrainerApp
from services.trainer.config import TrainerSettings
from trace_common.service import Metrics
from trace_common.service.http import build_app

REQUIRED = dict(weight_sync_address="127.0.0.1:1", quant_cache_address="127.0.0.1:2")


class _Publisher:
    def __init__(self) -> None:
        self.latest = -1

    def latest_version(self) -> int:
        return self.latest


def _app(dropped_per_step: list[int], samples: int = 8, **run: Any) -> TrainerApp:
    settings = TrainerSettings(
        **REQUIRED, auth_token="t", run={"steps": len(dropped_per_step), **run}
    )
    app = TrainerApp(settings, Metrics("trainer"))
    publisher = _Publisher()
    app.publisher = publisher  # type: ignore[assignment]
    app.directory.pull_seconds = dict  # type: ignore[method-assign]

    def publish() -> float:
        app.core.version += 1
        publisher.latest = app.core.version
        return 0.0

    def step() -> dict[str, Any]:
        app.core.step_index += 1
        publish()
        dropped = dropped_per_step[app.core.step_index - 1]
        return {
            "step": app.core.step_index, "policy_version": app.core.version,
            "reward_mean": 0.0, "samples": samples, "samples_trained": samples - dropped,
            "samples_dropped_records": dropped, "samples_dropped_stale": 0,
            "redispatched_units": 0, "time_rollout_s": 0.0, "time_records_s": 0.0,
            "time_train_s": 0.0, "time_push_s": 0.0, "step_time_s": 0.0,
        }  # fmt: skip

    app.core.publish = publish  # type: ignore[method-assign]
    app.core.step = step  # type: ignore[method-assign]
    return app


def _gauge(app: TrainerApp) -> float:
    return app.metrics.failed._value.get()  # type: ignore[attr-defined]


def test_a_run_that_drops_every_sample_fails_and_liveness_says_so() -> None:
    app = _app([8, 8, 8])
    app._run_safely()
    assert app.state == "failed" and app.core.step_index == 1  # stops at the first bad step
    assert "8 of 8 samples dropped" in app.detail
    assert "stores.max_dropped_fraction=0.5" in app.detail
    assert _gauge(app) == 1
    http = build_app("trainer", Metrics("t2"), lambda: True, app.status,
                     live=lambda: app.state != "failed")  # fmt: skip
    with TestClient(http) as client:
        reply = client.get("/healthz")
        assert reply.status_code == 503 and reply.json()["status"] == "failed"


def test_a_few_drops_under_the_limit_finish() -> None:
    app = _app([2, 0, 4], **{"stores.max_dropped_fraction": 0.5})  # 6 of 24 samples
    app._run_safely()
    assert (app.state, app.core.step_index, _gauge(app)) == ("finished", 3, 0)


def test_the_limit_is_over_the_whole_run_so_far() -> None:
    app = _app([0, 0, 8, 8], **{"stores.max_dropped_fraction": 0.4})  # 16/32 = 0.5 after step 4
    app._run_safely()
    assert app.state == "failed" and app.core.step_index == 4, app.detail


def test_healthz_is_200_while_live() -> None:
    http = build_app("x", Metrics("x"), lambda: True, dict)
    with TestClient(http) as client:
        reply = client.get("/healthz")
        assert reply.status_code == 200 and reply.json() == {"status": "ok", "component": "x"}


def test_finished_only_once_the_last_version_is_pushed() -> None:
    """With the push overlapped (a background thread), the run reports "finished" only after
    the last version's push has completed: the state seen when each push ends is "running"."""
    app = TrainerApp(TrainerSettings(**REQUIRED, auth_token="t", run={"steps": 2}),
                     Metrics("trainer_overlap"))  # fmt: skip
    seen: list[tuple[int, str]] = []

    class SlowPublisher(_Publisher):
        def publish(self, version: int, tensors: Any, metadata: Any) -> None:
            time.sleep(0.3)
            self.latest = version
            seen.append((version, app.state))

    pub = SlowPublisher()
    app.publisher = app.core.publisher = pub  # type: ignore[assignment]
    app.directory.pull_seconds = dict  # type: ignore[method-assign]
    assert app.core.config.pushes_in_background

    def step() -> dict[str, Any]:
        app.core.step_index += 1
        app.core.publish(background=True)
        return {
            "step": app.core.step_index, "policy_version": app.core.version,
            "reward_mean": 0.0, "samples": 8, "samples_trained": 8,
            "samples_dropped_records": 0, "samples_dropped_stale": 0,
            "redispatched_units": 0, "time_rollout_s": 0.0, "time_records_s": 0.0,
            "time_train_s": 0.0, "time_push_s": 0.0, "step_time_s": 0.0,
        }  # fmt: skip

    app.core.step = step  # type: ignore[method-assign]
    app._run_safely()
    assert app.state == "finished", app.detail
    assert [v for v, _ in seen] == [0, 1, 2]
    status = app.status()
    assert (status["policy_version"], status["policy_version_pushed"]) == (2, 2)
    assert all(state != "finished" for _, state in seen), seen
