"""trace.rollout.v1.Rollout: generate groups of completions with the replica's current policy.

A request runs on one policy version from start to end (``trace_common.rollout.engine``), so
a weight swap never splits a request. Records go to quant-cache before
the completion that refers to them is streamed back: a completion the trainer receives has its
records stored, unless quant-cache refused them for good (full at its memory bound): then it
comes back with record_bytes 0, and the trainer's lost-records setting handles the group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from trace_common.clients.quant_cache import new_generation
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from trace_common.rollout.convert import completion_to_proto, sampling_from_proto
from trace_common.rollout.engine import (
    EngineHolder,
    PutRecord,
    RecordRefused,
    ReplicaBehind,
    RolloutRequest,
    run_request,
)
from trace_common.rollout.scheduler import CancelledError
from trace_common.rollout.types import SamplingConfig
from trace_common.service import Metrics, ServiceError, check_id, failed_precondition, invalid
from trace_common.service.errors import LONG_ID_RE

MAX_PROMPTS_PER_REQUEST = 4096
MAX_GROUP_SIZE = 1024
MAX_SEQUENCES_PER_REQUEST = 16384  # prompts x group_size
# Prompt tokens the request's sequences hold together (each prompt's tokens x group_size):
# an engine copies every prompt once per sequence, so a long prompt in a large group grows by
# group_size before any engine can measure it against its context. 8x the largest recipe's
# request (128 prompts x 8 x ~500 prompt tokens).
MAX_PROMPT_TOKENS_PER_REQUEST = 1 << 22


def record_writer(
    put: Callable[..., Any],
    audit: Callable[[str, int, str, bytes], Any] | None = None,
) -> PutRecord:
    """The replica's PutRecord over quant-cache's `put(run, version, sample_id, blob,
    generation=)`: each record is written under a fresh write generation, which the put
    returns (the completion carries it to the trainer, whose read refuses any other write of
    the key). A RESOURCE_EXHAUSTED answer (the store full at its memory bound, or the record
    over its size limit) becomes RecordRefused, so the completion goes back without its
    record; every other error fails the request as before. `audit` logs each stored record."""

    def put_record(run: str, version: int, sid: str, blob: bytes) -> bytes:
        generation = new_generation()
        try:
            put(run, version, sid, blob, generation=generation)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise RecordRefused(f"quant-cache: {exc.details()}") from exc
            raise
        if audit is not None:
            audit(run, version, sid, blob)
        return generation

    return put_record


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Serves Generate / Status for one replica."""

    def __init__(
        self,
        replica_id: str,
        holder: EngineHolder,
        put_record: PutRecord | None,
        *,
        vocab_size: int | None = None,
        metrics: Metrics | None = None,
        engine_name: str | Callable[[], str] = "native",
        quant_format: str = "",
    ) -> None:
        self.replica_id = replica_id
        self.holder = holder
        self.put_record = put_record
        self.vocab_size = vocab_size
        self.engine_name = engine_name
        self.quant_format = quant_format
        self._lock = threading.Lock()
        self._in_flight = 0
        self._completions = 0
        self._tokens = 0
        self._m = _RolloutMetrics(metrics or Metrics("rollout"))
        self.follower: Any = None  # services.rollout.weights.WeightFollower, once wired
        self.engine_stats: Callable[[], dict[str, float]] = dict  # the engine's counters

    def _validate(self, request: rollout_pb2.GenerateRequest) -> SamplingConfig:
        if not request.prompts:
            raise invalid("prompts is empty")
        if len(request.prompts) > MAX_PROMPTS_PER_REQUEST:
            raise invalid(f"{len(request.prompts)} prompts > max {MAX_PROMPTS_PER_REQUEST}")
        if not 1 <= request.group_size <= MAX_GROUP_SIZE:
            raise invalid(f"group_size={request.group_size} must be in [1, {MAX_GROUP_SIZE}]")
        n_seq = len(request.prompts) * request.group_size
        if n_seq > MAX_SEQUENCES_PER_REQUEST:
            raise invalid(f"{len(request.prompts)} prompts x group_size {request.group_size} = "
                          f"{n_seq} sequences > max {MAX_SEQUENCES_PER_REQUEST} per request")  # fmt: skip
        n_tok = sum(len(p.token_ids) for p in request.prompts)
        if n_tok * request.group_size > MAX_PROMPT_TOKENS_PER_REQUEST:
            raise invalid(f"prompts hold {n_tok} tokens x group_size {request.group_size} = "
                          f"{n_tok * request.group_size} prompt tokens > max "
                          f"{MAX_PROMPT_TOKENS_PER_REQUEST} per request")  # fmt: skip
        if request.min_policy_version < 0:
            raise invalid(f"min_policy_version={request.min_policy_version} must be >= 0")
        check_id("run_id", request.run_id)
        check_id("sample_id_prefix", request.sample_id_prefix, LONG_ID_RE)
        for i, p in enumerate(request.prompts):
            if not p.token_ids:
                raise invalid(f"prompts[{i}] has no tokens")
            if self.vocab_size is not None:
                bad = [t for t in p.token_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise invalid(
                        f"prompts[{i}] has token ids {bad[:5]} outside [0, {self.vocab_size})"
                    )
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as exc:
            raise invalid(f"sampling: {exc}") from exc
        if self.vocab_size is not None:
            bad = [t for t in sampling.stop_token_ids if t >= self.vocab_size]
            if bad:
                raise invalid(f"sampling: stop_token_ids {bad[:5]} outside [0, {self.vocab_size})")
        return sampling

    def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> Iterator[rollout_pb2.Completion]:
        sampling = self._validate(request)
        engine, version = self.holder.snapshot()
        if engine is None:
            # a precondition the trainer waits out, as a replica behind the minimum version
            raise failed_precondition("no policy weights loaded yet (version -1)")
        if request.write_records and self.put_record is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               "write_records requested but no quant-cache is configured")  # fmt: skip
        rollout_request = RolloutRequest(
            run_id=request.run_id,
            prompts=[tuple(p.token_ids) for p in request.prompts],
            group_size=request.group_size,
            sampling=sampling,
            sample_id_prefix=request.sample_id_prefix,
            min_policy_version=request.min_policy_version,
            write_records=request.write_records,
        )
        with self._lock:
            self._in_flight += 1
        self._m.in_flight.inc()
        try:
            with self._m.generate_seconds.time():
                completions = run_request(
                    engine, version, rollout_request, self.put_record, self.replica_id,
                    cancelled=None if context is None else (lambda: not context.is_active()),
                )  # fmt: skip
        except ReplicaBehind as exc:
            raise failed_precondition(str(exc)) from exc
        except CancelledError as exc:
            raise ServiceError(grpc.StatusCode.CANCELLED, str(exc)) from exc
        except ValueError as exc:  # the engine rejected the input
            raise invalid(str(exc)) from exc
        except ConnectionError as exc:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"quant-cache: {exc}") from exc
        finally:
            with self._lock:
                self._in_flight -= 1
            self._m.in_flight.dec()
        for c in completions:
            n_tok = len(c.sample.completion_tokens)
            with self._lock:
                self._completions += 1
                self._tokens += n_tok
            self._m.completions.inc()
            self._m.tokens.inc(n_tok)
            self._m.record_bytes.inc(c.record_bytes)
            if request.write_records and c.record_bytes == 0:
                self._m.records_refused.inc()
            yield completion_to_proto(c)

    def Status(
        self, request: rollout_pb2.RolloutStatusRequest, context: Any
    ) -> rollout_pb2.RolloutStatusResponse:
        fields = rollout_pb2.RolloutStatusResponse.DESCRIPTOR.fields_by_name
        return rollout_pb2.RolloutStatusResponse(
            **{k: v for k, v in self.status().items() if k in fields}
        )

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "replica_id": self.replica_id,
                "policy_version": self.holder.version,
                "ready": self.holder.version >= 0,
                "engine": self.engine_name() if callable(self.engine_name) else self.engine_name,
                "quant_format": self.quant_format,
                "requests_in_flight": self._in_flight,
                "completions_total": self._completions,
                "tokens_generated_total": self._tokens,
                "last_weight_pull_seconds": getattr(self.follower, "last_pull_seconds", 0.0),
                "weight_pulls_total": getattr(self.follower, "pulls", 0),
                # the last pull's transfer alone (bytes in, rebuilt, checked) and what it sent
                "last_weight_transfer_seconds": getattr(
                    self.follower, "last_transfer_seconds", 0.0
                ),
                "last_weight_pull": getattr(self.follower, "last_pull", {}),
                "weight_ipc_failures_total": getattr(self.follower, "ipc_failures", 0),
                "weight_broadcast_failures_total": getattr(self.follower, "broadcast_failures", 0),
                "engine_stats": self.engine_stats(),
            }


class _RolloutMetrics:
    def __init__(self, m: Metrics) -> None:
        self.in_flight = m.gauge("requests_in_flight", "Generate calls running now")
        self.completions = m.counter("completions", "completions generated")
        self.tokens = m.counter("generated_tokens", "completion tokens generated")
        self.record_bytes = m.counter("record_bytes", "record bytes written to quant-cache")
        self.records_refused = m.counter(
            "records_refused", "records quant-cache refused (full): completions sent without them"
        )
        self.generate_seconds = m.histogram("generate_seconds", "time of one Generate call")
