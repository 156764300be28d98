"""The rollout servicer in-process with hand-built messages and a fake engine."""

from __future__ import annotations

import grpc
import pytest

from services.rollout.servicer import RolloutServicer, record_writer
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2
from trace_common.rollout import EngineHolder, GeneratedSample
from trace_common.rollout.engine import RecordRefused
from trace_common.service import ServiceError


class FakeEngine:
    name = "fake"

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.calls = []

    def generate(self, prompts, group_size, sampling, *, with_records):
        self.calls.append((list(map(list, prompts)), group_size, sampling))
        return [
            GeneratedSample(
                prompt_index=i,
                group_index=j,
                completion_tokens=[self.tag, 2],
                logprobs=[-0.1, -0.2],
                finish_reason="stop" if j % 2 == 0 else "length",
                records=f"r{self.tag}-{i}-{j}".encode() if with_records else None,
            )
            for i in range(len(prompts))
            for j in range(group_size)
        ]


def request(**kw) -> rollout_pb2.GenerateRequest:
    base = dict(
        prompts=[rollout_pb2.Prompt(token_ids=[1, 4, 5]), rollout_pb2.Prompt(token_ids=[1, 6])],
        group_size=2,
        sampling=rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=4, seed=3),
        min_policy_version=0,
        run_id="run1",
        sample_id_prefix="s0-u0-a0",
        write_records=True,
    )
    base.update(kw)
    return rollout_pb2.GenerateRequest(**base)


def make(holder=None):
    holder = holder or EngineHolder()
    stored = {}
    servicer = RolloutServicer(
        "rep-a", holder, lambda r, v, s, b: stored.__setitem__((r, v, s), b), vocab_size=17
    )
    return servicer, holder, stored


def test_generate_streams_completions_and_stores_records_first() -> None:
    servicer, holder, stored = make()
    holder.swap(FakeEngine(7), 3)
    out = list(servicer.Generate(request(), None))
    assert [(c.prompt_index, c.group_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out[0].sample_id == "s0-u0-a0-0-0"
    assert all(c.policy_version == 3 for c in out)
    assert out[1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH
    assert list(out[0].token_ids) == [7, 2]
    assert stored[("run1", 3, "s0-u0-a0-1-1")] == b"r7-1-1"
    assert out[3].record_bytes == len(b"r7-1-1")
    st = servicer.Status(rollout_pb2.RolloutStatusRequest(), None)
    assert (st.policy_version, st.ready, st.completions_total, st.tokens_generated_total) == (
        3, True, 4, 8,
    )  # fmt: skip


def test_version_swap_between_requests() -> None:
    servicer, holder, _ = make()
    holder.swap(FakeEngine(7), 0)
    gen = servicer.Generate(request(), None)
    first = next(gen)  # the request has taken its snapshot (version 0) ...
    holder.swap(FakeEngine(8), 1)  # ... a swap now must not affect it
    rest = list(gen)
    assert {c.policy_version for c in [first, *rest]} == {0}
    assert {c.token_ids[0] for c in [first, *rest]} == {7}
    assert {c.policy_version for c in servicer.Generate(request(), None)} == {1}
    with pytest.raises(ValueError, match="not newer"):
        holder.swap(FakeEngine(9), 1)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prompts": []}, "prompts is empty"),
        ({"group_size": 0}, "group_size=0"),
        (
            {"prompts": [rollout_pb2.Prompt(token_ids=[1] * (1 << 13))], "group_size": 1024},
            r"prompts hold 8192 tokens x group_size 1024 = 8388608 prompt tokens > max 4194304",
        ),
        (
            {"sampling": rollout_pb2.SamplingParams(temperature=1e-30, max_new_tokens=2)},
            r"temperature must be 0 \(greedy\) or >= 0.01",
        ),
        ({"run_id": "bad id!"}, "run_id='bad id!'"),
        ({"sample_id_prefix": ""}, "sample_id_prefix=''"),
        ({"prompts": [rollout_pb2.Prompt(token_ids=[1, 99])]}, r"token ids \[99\] outside"),
        ({"prompts": [rollout_pb2.Prompt(token_ids=[])]}, "prompts.0. has no tokens"),
        ({"sampling": rollout_pb2.SamplingParams(max_new_tokens=0)}, "max_new_tokens must be >= 1"),
        ({"sampling": rollout_pb2.SamplingParams(temperature=-1, max_new_tokens=2)}, "temperature"),
        ({"min_policy_version": -2}, "min_policy_version=-2"),
        (
            {"sampling": rollout_pb2.SamplingParams(temperature=float("nan"), max_new_tokens=2)},
            "temperature must be finite",
        ),
        (
            {"sampling": rollout_pb2.SamplingParams(temperature=float("inf"), max_new_tokens=2)},
            "temperature must be finite",
        ),
        ({"sampling": rollout_pb2.SamplingParams(top_p=float("nan"), max_new_tokens=2)}, "top_p"),
        (
            {"sampling": rollout_pb2.SamplingParams(max_new_tokens=2, stop_token_ids=[3, 17])},
            r"stop_token_ids \[17\] outside \[0, 17\)",
        ),
    ],
)
def test_bad_requests_are_invalid_argument(kw, message) -> None:
    servicer, holder, _ = make()
    holder.swap(FakeEngine(7), 0)
    with pytest.raises(ServiceError, match=message) as err:
        list(servicer.Generate(request(**kw), None))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_no_or_old_weights_are_failed_precondition() -> None:
    servicer, holder, _ = make()
    with pytest.raises(ServiceError, match="no policy weights") as err:
        list(servicer.Generate(request(), None))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    holder.swap(FakeEngine(7), 2)
    with pytest.raises(ServiceError, match="holds version 2 < minimum 5") as err:
        list(servicer.Generate(request(min_policy_version=5), None))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_stop_token_ids_reach_the_engine() -> None:
    servicer, holder, _ = make()
    engine = FakeEngine(7)
    holder.swap(engine, 0)
    sp = rollout_pb2.SamplingParams(temperature=0.5, top_k=3, max_new_tokens=4,
                                    stop_token_ids=[5, 9], seed=11)  # fmt: skip
    list(servicer.Generate(request(sampling=sp), None))
    sampling = engine.calls[0][2]
    assert sampling.stop_token_ids == (5, 9)
    assert (sampling.temperature, sampling.top_k, sampling.seed) == (0.5, 3, 11)


class CancellableEngine(FakeEngine):
    """Stops as soon as the caller is gone, as the CUDA engine does."""

    cancellable = True

    def generate(self, prompts, group_size, sampling, *, with_records, cancelled=None):
        from trace_common.rollout.scheduler import CancelledError

        self.saw_cancelled = cancelled
        if cancelled is not None and cancelled():
            raise CancelledError("the caller cancelled the request")
        return super().generate(prompts, group_size, sampling, with_records=with_records)


class Context:
    def __init__(self, active: bool) -> None:
        self.active = active

    def is_active(self) -> bool:
        return self.active


def test_a_gone_caller_cancels_the_engine_work() -> None:
    servicer, holder, stored = make()
    engine = CancellableEngine(7)
    holder.swap(engine, 0)
    assert len(list(servicer.Generate(request(), Context(True)))) == 4
    with pytest.raises(ServiceError) as err:
        list(servicer.Generate(request(run_id="run2"), Context(False)))
    assert err.value.code == grpc.StatusCode.CANCELLED
    assert not [k for k in stored if k[0] == "run2"], "a cancelled request stores no records"
    plain = FakeEngine(8)  # an engine without `cancellable` is called as before
    holder.swap(plain, 1)
    assert len(list(servicer.Generate(request(), Context(True)))) == 4


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"{self._code.name} from the store"


def test_a_record_the_full_store_refuses_comes_back_without_its_record() -> None:
    """quant-cache full (RESOURCE_EXHAUSTED): the other records are stored and every completion
    is streamed, the refused one with record_bytes 0 (the trainer's lost-records path)."""
    stored: dict = {}
    audited: list = []

    def put(run, version, sid, blob, *, generation):
        if sid.endswith("-1-0"):
            raise _Rpc(grpc.StatusCode.RESOURCE_EXHAUSTED)
        stored[sid] = generation

    writer = record_writer(put, lambda r, v, s, b: audited.append(s))
    servicer = RolloutServicer("rep-a", EngineHolder(), writer, vocab_size=17)
    servicer.holder.swap(FakeEngine(7), 3)
    out = list(servicer.Generate(request(), None))
    assert len(out) == 4
    by_id = {c.sample_id: c.record_bytes for c in out}
    assert by_id["s0-u0-a0-1-0"] == 0
    assert all(n > 0 for sid, n in by_id.items() if sid != "s0-u0-a0-1-0")
    assert sorted(stored) == sorted(audited) == sorted(s for s in by_id if by_id[s] > 0)
    # each stored record's write generation reaches the trainer with its completion
    gens = {c.sample_id: c.record_generation for c in out}
    assert gens["s0-u0-a0-1-0"] == b""
    assert all(gens[sid] == g and len(g) == 16 for sid, g in stored.items())
    assert len(set(stored.values())) == len(stored), "a fresh generation per write"


@pytest.mark.parametrize(
    "code,raised",
    [
        (grpc.StatusCode.UNAVAILABLE, grpc.RpcError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, RecordRefused),
    ],
)
def test_only_a_full_store_becomes_a_refused_record(code, raised) -> None:
    def put(run, version, sid, blob, *, generation):
        raise _Rpc(code)

    with pytest.raises(raised) as err:
        record_writer(put)("run1", 3, "s", b"x")
    if raised is grpc.RpcError:  # every other store error fails the request as before
        assert err.value.code() == code
