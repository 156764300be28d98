"""trace.trainer.v1.Trainer: status, pause and resume of the running trainer."""

from __future__ import annotations

import math
from typing import Any, Protocol

from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from trace_common.service import failed_precondition, invalid

# A pause reason is kept as the trainer's status detail and sent with every status after it:
# an operator's note, not a payload.
MAX_PAUSE_REASON_CHARS = 1024

STATE_TO_PROTO = {
    "starting": trainer_pb2.TRAINER_STATE_STARTING,
    "running": trainer_pb2.TRAINER_STATE_RUNNING,
    "paused": trainer_pb2.TRAINER_STATE_PAUSED,
    "finished": trainer_pb2.TRAINER_STATE_FINISHED,
    "failed": trainer_pb2.TRAINER_STATE_FAILED,
}


class Controllable(Protocol):
    def status(self) -> dict[str, Any]: ...

    def pause(self, reason: str) -> None: ...

    def resume(self) -> None: ...


def status_to_proto(st: dict[str, Any]) -> trainer_pb2.TrainerStatus:
    scalars = {
        k: float(v)
        for k, v in (st.get("last_metrics") or {}).items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    return trainer_pb2.TrainerStatus(
        run_id=st["run_id"],
        state=STATE_TO_PROTO[st["state"]],
        step=st["step"],
        total_steps=st["total_steps"],
        policy_version=st["policy_version"],
        rollout_replicas=st["rollout_replicas"],
        last_metrics=scalars,
        detail=st.get("detail", ""),
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, app: Controllable) -> None:
        self.app = app

    def GetStatus(
        self, request: trainer_pb2.GetStatusRequest, context: Any
    ) -> trainer_pb2.TrainerStatus:
        return status_to_proto(self.app.status())

    def Pause(self, request: trainer_pb2.PauseRequest, context: Any) -> trainer_pb2.TrainerStatus:
        if len(request.reason) > MAX_PAUSE_REASON_CHARS:
            raise invalid(
                f"reason has {len(request.reason)} characters > max {MAX_PAUSE_REASON_CHARS}"
            )
        try:
            self.app.pause(request.reason)
        except RuntimeError as exc:
            raise failed_precondition(str(exc)) from exc
        return status_to_proto(self.app.status())

    def Resume(self, request: trainer_pb2.ResumeRequest, context: Any) -> trainer_pb2.TrainerStatus:
        try:
            self.app.resume()
        except RuntimeError as exc:
            raise failed_precondition(str(exc)) from exc
        return status_to_proto(self.app.status())
