"""The trainer servicer in-process with hand-built messages and a fake app."""

from __future__ import annotations

import grpc
import pytest

from services.trainer.servicer import TrainerServicer
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2
from trace_common.service import ServiceError


class FakeApp:
    def __init__(self) -> None:
        self.state = "running"
        self.calls: list[str] = []

    def status(self) -> dict:
        return {
            "run_id": "r", "state": self.state, "step": 3, "total_steps": 10,
            "policy_version": 3, "rollout_replicas": 2, "detail": "",
            "last_metrics": {"reward_mean": 0.5, "failed_replicas": [], "nan": float("nan"),
                             "per": {"a": 1.0}},
        }  # fmt: skip

    def pause(self, reason: str) -> None:
        if self.state == "finished":
            raise RuntimeError("trainer is finished")
        self.calls.append(f"pause:{reason}")
        self.state = "paused"

    def resume(self) -> None:
        if self.state == "finished":
            raise RuntimeError("trainer is finished")
        self.calls.append("resume")
        self.state = "running"


def test_status_pause_resume() -> None:
    app = FakeApp()
    s = TrainerServicer(app)
    st = s.GetStatus(trainer_pb2.GetStatusRequest(), None)
    assert (st.state, st.step, st.policy_version, st.rollout_replicas) == (
        trainer_pb2.TRAINER_STATE_RUNNING, 3, 3, 2,
    )  # fmt: skip
    assert dict(st.last_metrics) == {"reward_mean": 0.5}  # only finite scalars travel
    assert s.Pause(trainer_pb2.PauseRequest(reason="ops"), None).state == (
        trainer_pb2.TRAINER_STATE_PAUSED
    )
    assert s.Resume(trainer_pb2.ResumeRequest(), None).state == trainer_pb2.TRAINER_STATE_RUNNING
    assert app.calls == ["pause:ops", "resume"]


def test_pause_after_finish_is_failed_precondition() -> None:
    app = FakeApp()
    app.state = "finished"
    s = TrainerServicer(app)
    for call in (
        lambda: s.Pause(trainer_pb2.PauseRequest(), None),
        lambda: s.Resume(trainer_pb2.ResumeRequest(), None),
    ):
        with pytest.raises(ServiceError, match="finished") as err:
            call()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_pause_reason_over_its_bound_is_invalid_argument() -> None:
    # a 60 MiB reason used to become the status detail every later status carried
    app = FakeApp()
    s = TrainerServicer(app)
    with pytest.raises(ServiceError, match="reason has 1025 characters > max 1024") as err:
        s.Pause(trainer_pb2.PauseRequest(reason="x" * 1025), None)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert app.calls == [] and app.state == "running"
    s.Pause(trainer_pb2.PauseRequest(reason="x" * 1024), None)
    assert app.calls == ["pause:" + "x" * 1024]
