from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed")
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
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "group_size", "sampling", "min_policy_version", "run_id", "sample_id_prefix", "write_records")
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
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., run_id: _Optional[str] = ..., sample_id_prefix: _Optional[str] = ..., write_records: _Optional[bool] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("sample_id", "prompt_index", "group_index", "token_ids", "logprobs", "policy_version", "finish_reason", "record_bytes", "record_generation")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECORD_GENERATION_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_index: int
    group_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    finish_reason: FinishReason
    record_bytes: int
    record_generation: bytes
    def __init__(self, sample_id: _Optional[str] = ..., prompt_index: _Optional[int] = ..., group_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., record_bytes: _Optional[int] = ..., record_generation: _Optional[bytes] = ...) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatusResponse(_message.Message):
    __slots__ = ("replica_id", "policy_version", "ready", "engine", "quant_format", "requests_in_flight", "completions_total", "tokens_generated_total", "last_weight_pull_seconds", "weight_pulls_total")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    QUANT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_WEIGHT_PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_PULLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    policy_version: int
    ready: bool
    engine: str
    quant_format: str
    requests_in_flight: int
    completions_total: int
    tokens_generated_total: int
    last_weight_pull_seconds: float
    weight_pulls_total: int
    def __init__(self, replica_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., ready: _Optional[bool] = ..., engine: _Optional[str] = ..., quant_format: _Optional[str] = ..., requests_in_flight: _Optional[int] = ..., completions_total: _Optional[int] = ..., tokens_generated_total: _Optional[int] = ..., last_weight_pull_seconds: _Optional[float] = ..., weight_pulls_total: _Optional[int] = ...) -> None: ...
