from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class Prompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Iterable[int] | None = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "seed", "stop_token_ids", "temperature", "top_k", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(
        self,
        temperature: float | None = ...,
        top_p: float | None = ...,
        top_k: int | None = ...,
        max_new_tokens: int | None = ...,
        stop_token_ids: _Iterable[int] | None = ...,
        seed: int | None = ...,
    ) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = (
        "group_size",
        "min_policy_version",
        "prompts",
        "run_id",
        "sample_id_prefix",
        "sampling",
        "write_records",
    )
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    WRITE_RECORDS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    group_size: int
    sampling: SamplingParams
    min_policy_version: int
    run_id: str
    sample_id_prefix: str
    write_records: bool
    def __init__(
        self,
        prompts: _Iterable[Prompt | _Mapping] | None = ...,
        group_size: int | None = ...,
        sampling: SamplingParams | _Mapping | None = ...,
        min_policy_version: int | None = ...,
        run_id: str | None = ...,
        sample_id_prefix: str | None = ...,
        write_records: bool | None = ...,
    ) -> None: ...

class Completion(_message.Message):
    __slots__ = (
        "finish_reason",
        "group_index",
        "logprobs",
        "policy_version",
        "prompt_index",
        "record_bytes",
        "sample_id",
        "token_ids",
    )
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_index: int
    group_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    finish_reason: FinishReason
    record_bytes: int
    def __init__(
        self,
        sample_id: str | None = ...,
        prompt_index: int | None = ...,
        group_index: int | None = ...,
        token_ids: _Iterable[int] | None = ...,
        logprobs: _Iterable[float] | None = ...,
        policy_version: int | None = ...,
        finish_reason: FinishReason | str | None = ...,
        record_bytes: int | None = ...,
    ) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatusResponse(_message.Message):
    __slots__ = (
        "completions_total",
        "engine",
        "policy_version",
        "quant_format",
        "ready",
        "replica_id",
        "requests_in_flight",
        "tokens_generated_total",
    )
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    QUANT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    policy_version: int
    ready: bool
    engine: str
    quant_format: str
    requests_in_flight: int
    completions_total: int
    tokens_generated_total: int
    def __init__(
        self,
        replica_id: str | None = ...,
        policy_version: int | None = ...,
        ready: bool | None = ...,
        engine: str | None = ...,
        quant_format: str | None = ...,
        requests_in_flight: int | None = ...,
        completions_total: int | None = ...,
        tokens_generated_total: int | None = ...,
    ) -> None: ...
