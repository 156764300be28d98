from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINER_STATE_UNSPECIFIED: _ClassVar[TrainerState]
    TRAINER_STATE_STARTING: _ClassVar[TrainerState]
    TRAINER_STATE_RUNNING: _ClassVar[TrainerState]
    TRAINER_STATE_PAUSED: _ClassVar[TrainerState]
    TRAINER_STATE_FINISHED: _ClassVar[TrainerState]
    TRAINER_STATE_FAILED: _ClassVar[TrainerState]

TRAINER_STATE_UNSPECIFIED: TrainerState
TRAINER_STATE_STARTING: TrainerState
TRAINER_STATE_RUNNING: TrainerState
TRAINER_STATE_PAUSED: TrainerState
TRAINER_STATE_FINISHED: TrainerState
TRAINER_STATE_FAILED: TrainerState

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = (
        "detail",
        "last_metrics",
        "policy_version",
        "rollout_replicas",
        "run_id",
        "state",
        "step",
        "total_steps",
    )
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: str | None = ..., value: float | None = ...) -> None: ...

    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: TrainerState
    step: int
    total_steps: int
    policy_version: int
    rollout_replicas: int
    last_metrics: _containers.ScalarMap[str, float]
    detail: str
    def __init__(
        self,
        run_id: str | None = ...,
        state: TrainerState | str | None = ...,
        step: int | None = ...,
        total_steps: int | None = ...,
        policy_version: int | None = ...,
        rollout_replicas: int | None = ...,
        last_metrics: _Mapping[str, float] | None = ...,
        detail: str | None = ...,
    ) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: str | None = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
