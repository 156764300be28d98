from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    __slots__ = ("run_id", "state", "step", "total_steps", "policy_version", "rollout_replicas", "last_metrics", "detail")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
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
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[TrainerState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., rollout_replicas: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., detail: _Optional[str] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
