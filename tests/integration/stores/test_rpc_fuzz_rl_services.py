"""Every RPC of the rollout and trainer services (real subprocesses of a local cluster: Redis,
quant-cache, weight-sync, the trainer and a rollout replica serving the trainer's first
policy, plus a second replica that never gets weights) driven with malformed bytes and with
random, well-formed but hostile messages: huge strings, negative and 2**63-1 numbers, empty
and many-times repeated fields. Nothing gets INTERNAL or UNKNOWN, the services stay up, and
their memory stays bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from trace_common.launch.cluster import ClusterConfig, LocalCluster
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.process import LocalService
from trace_common.tasks import load_tokenizer

pytestmark = pytest.mark.timeout(600)

SERVICES = {
    "rollout": rollout_pb2.DESCRIPTOR.services_by_name["Rollout"],
    "trainer": trainer_pb2.DESCRIPTOR.services_by_name["Trainer"],
}
NEVER = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
# The codes these two services document: a bad request, a precondition (no weights yet, a
# replica behind the minimum version, a finished trainer), a missing dependency, a request
# over a bound, and the client's own deadline (a slow CPU generation).
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
MALFORMED = [b"\x08", b"\x0f\x01", b"\x0a\x7f\x01", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]
CALL_TIMEOUT_S = 30.0
# The channel sends messages up to the services' own limit (64 MiB), so the services' bounds
# are what a huge message meets, not the client's.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                   ("grpc.max_receive_message_length", 64 << 20)]  # fmt: skip
# Resident memory a service may gain over the whole fuzzing, after a warm-up at the largest
# legal request. The services keep nothing per request (the trainer keeps one pause reason,
# the rollout counters): what grows is allocator caches and the heap high-water mark of the
# largest messages parsed (a few copies of up to 8 MiB each); measured growth is 10-50 MiB.
# A leak of ~200 KiB per call over the ~600 calls here, or an RPC that allocates by a size
# it was sent (a long prompt in a large group once took 12 GiB), goes past it.
RSS_GROWTH_BOUND_BYTES = 100 << 20

I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
U64_MAX = 2**64 - 1
VOCAB_SIZE = load_tokenizer("char").vocab_size  # the run's tokenizer: the policy's token ids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("fuzz-cluster")
    cfg = ClusterConfig(
        replicas=1,
        run={
            "task": {"name": "reverse", "difficulty": 2, "tokenizer": "char"},
            "prompts_per_step": 2,
            "group_size": 2,
            "steps": 1000,
            "run_id": "fuzz",
        },
        trainer_env={"TRACE_START_PAUSED": "true"},
    )
    with LocalCluster(cfg, root / "logs") as c:
        # A replica whose weight-sync address has nothing behind it: it never loads weights.
        bare = LocalService(
            "rollout-bare", "services.rollout",
            {"TRACE_AUTH_TOKEN": cfg.token, "TRACE_WEIGHT_SYNC_ADDRESS": "127.0.0.1:9",
             "TRACE_QUANT_CACHE_ADDRESS": "127.0.0.1:9", "TRACE_REPLICA_ID": "rollout-bare"},
            root / "logs",
        ).launch().wait_ports()  # fmt: skip
        c.bare = bare  # type: ignore[attr-defined]
        try:
            yield c
        finally:
            bare.stop()


def _meta(c: LocalCluster) -> tuple[tuple[str, str]]:
    return ((AUTH_HEADER, f"Bearer {c.config.token}"),)


def _targets(c: LocalCluster) -> dict[str, LocalService]:
    assert c.trainer is not None
    return {"rollout": c.rollouts[0], "rollout-bare": c.bare, "trainer": c.trainer}  # type: ignore[attr-defined]


def _channel(svc: LocalService) -> grpc.Channel:
    return grpc.insecure_channel(svc.grpc_address, options=CHANNEL_OPTIONS)


def _code(fn) -> grpc.StatusCode:
    try:
        reply = fn()
        if isinstance(reply, Iterator):
            for _ in reply:
                pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _raw_call(c: LocalCluster, target: str, method, raw: bytes) -> grpc.StatusCode:
    service = "trainer" if target == "trainer" else "rollout"
    path = f"/{SERVICES[service].full_name}/{method.name}"
    with _channel(_targets(c)[target]) as ch:
        call = (ch.unary_stream if method.server_streaming else ch.unary_unary)(path)
        return _code(lambda: call(raw, metadata=_meta(c), timeout=CALL_TIMEOUT_S))


def _rss(svc: LocalService) -> int:
    assert svc.proc is not None
    return psutil.Process(svc.proc.pid).memory_info().rss


def _serving(svc: LocalService, *, ready: bool = True) -> bool:
    """The process is alive and answers its health check (SERVING where it holds weights)."""
    with _channel(svc) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    want = {health_pb2.HealthCheckResponse.SERVING}
    if not ready:
        want.add(health_pb2.HealthCheckResponse.NOT_SERVING)
    return svc.alive() and reply.status in want


def _generate(**kw) -> rollout_pb2.GenerateRequest:
    sampling = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=4)
    base = {"prompts": [rollout_pb2.Prompt(token_ids=[5, 6, 7])], "group_size": 2,
            "run_id": "r", "sample_id_prefix": "s", "sampling": sampling}  # fmt: skip
    return rollout_pb2.GenerateRequest(**{**base, **kw})


# ------------------------------------------------------------------------------ strategies

# Strings: empty, ids that pass the services' id rules, odd unicode, and huge ones.
HUGE = st.sampled_from([1 << 10, 1 << 16, 1 << 20, 8 << 20]).map(lambda n: "x" * n)
TEXT = st.one_of(
    st.just(""),
    st.from_regex(r"[A-Za-z0-9_.-]{1,24}", fullmatch=True),
    st.text(max_size=40),
    HUGE,
)
ID = st.from_regex(r"[A-Za-z0-9_.-]{1,24}", fullmatch=True)
SMALL_TOKENS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)
# Token lists: odd ids, and the same id many times over (up to 2**20 entries, 4+ MiB).
HOSTILE_TOKENS = st.one_of(
    st.just([]),
    st.lists(st.sampled_from([I32_MIN, -1, 0, 1, 255, 256, 1 << 20, I32_MAX]), min_size=1,
             max_size=6),
    st.sampled_from([1 << 12, 1 << 16, 1 << 20]).map(lambda n: [1] * n),
)  # fmt: skip
FLOAT32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-45, 1e-38, 1e-30, 1e-6, 3.4e38, -1.0, -0.0]),
)
# A valid request's fields, and for each a hostile replacement.
VALID = {
    "n_prompts": st.integers(1, 3),
    "tokens": SMALL_TOKENS,
    "group_size": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.0, 0.9, 1.0]),
    "top_k": st.sampled_from([0, 1, 5]),
    "max_new_tokens": st.integers(1, 4),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "seed": st.integers(0, 1000),
    "min_policy_version": st.just(0),
    "run_id": ID,
    "sample_id_prefix": ID,
    "write_records": st.booleans(),
}
HOSTILE = {
    "n_prompts": st.sampled_from([4097, 20000, 0]),  # past the bound: 4096 is the warm-up's
    "tokens": HOSTILE_TOKENS,
    "group_size": st.sampled_from([I32_MIN, -1, 0, 1025, I32_MAX]),
    "temperature": FLOAT32,
    "top_p": FLOAT32,
    "top_k": st.sampled_from([I32_MIN, -1, 1 << 20, I32_MAX]),
    "max_new_tokens": st.sampled_from([I32_MIN, -1, 0, 4096, 1 << 20, I32_MAX]),
    "stop_token_ids": HOSTILE_TOKENS,
    "seed": st.sampled_from([2**32, I64_MAX, U64_MAX]),
    "min_policy_version": st.sampled_from([I64_MIN, -1, 1, 1000, I64_MAX]),
    "run_id": TEXT,
    "sample_id_prefix": TEXT,
    "write_records": st.booleans(),
}


@st.composite
def generate_requests(draw) -> rollout_pb2.GenerateRequest:
    """A valid GenerateRequest with some of its fields (none, one, a few, or all) replaced by
    hostile values. The work a valid one asks for (sequences x new tokens) is small, so the
    CPU replica answers each well within the call timeout."""
    # mostly zero to two hostile fields (so many requests get past validation), at times all
    n_hostile = draw(st.sampled_from([1, 0, 2, 0, 1, len(VALID)]))
    hostile = draw(st.lists(st.sampled_from(sorted(VALID)), min_size=n_hostile,
                            max_size=n_hostile, unique=True))  # fmt: skip
    f = {k: draw(HOSTILE[k] if k in hostile else VALID[k]) for k in VALID}
    n, tokens = f["n_prompts"], f["tokens"]
    if n > 3:  # thousands of prompts: one short prompt, repeated
        prompts = [rollout_pb2.Prompt(token_ids=tokens[:12])] * n
    else:  # a few prompts, the first of them maybe hostile
        rest = [rollout_pb2.Prompt(token_ids=draw(SMALL_TOKENS)) for _ in range(n - 1)]
        prompts = [rollout_pb2.Prompt(token_ids=tokens), *rest][:n]
    sampling = rollout_pb2.SamplingParams(
        temperature=f["temperature"], top_p=f["top_p"], top_k=f["top_k"],
        max_new_tokens=f["max_new_tokens"], stop_token_ids=f["stop_token_ids"], seed=f["seed"],
    )  # fmt: skip
    return rollout_pb2.GenerateRequest(
        prompts=prompts, group_size=f["group_size"], sampling=sampling,
        min_policy_version=f["min_policy_version"], run_id=f["run_id"],
        sample_id_prefix=f["sample_id_prefix"], write_records=f["write_records"],
    )  # fmt: skip


# ------------------------------------------------------------------------------ tests


WARM_UP_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def baseline_rss(cluster: LocalCluster) -> dict[str, int]:
    """Each service's RSS after a warm-up that reaches each one's high-water mark of legal
    work: the rollout generates the largest batch a request may ask for (4096 prompts x 4 =
    MAX_SEQUENCES_PER_REQUEST sequences, one new token each), and the trainer runs one RL
    step (its first step allocates gradients and optimizer state). The fuzzing then measures
    growth past what any valid request may take, which is where a leak shows."""
    meta = _meta(cluster)
    with _channel(cluster.rollouts[0]) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        largest = _generate(
            prompts=[rollout_pb2.Prompt(token_ids=[5, 6, 7])] * 4096, group_size=4,
            sampling=rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=1),
            write_records=True,
        )  # fmt: skip
        got = list(stub.Generate(largest, metadata=meta, timeout=WARM_UP_TIMEOUT_S))
        assert len(got) == 4096 * 4 and all(c.policy_version >= 0 for c in got)
    with _channel(cluster.trainer) as ch:
        trainer = trainer_pb2_grpc.TrainerStub(ch)
        trainer.Resume(trainer_pb2.ResumeRequest(), metadata=meta, timeout=10)
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        while cluster.trainer_status()["step"] < 1:
            assert time.monotonic() < deadline, cluster.trainer_status()
            time.sleep(0.2)
        trainer.Pause(trainer_pb2.PauseRequest(reason="warm-up"), metadata=meta, timeout=10)
    return {name: _rss(svc) for name, svc in _targets(cluster).items()}


RAW_TARGETS = (
    [("rollout", m) for m in SERVICES["rollout"].methods]
    + [("rollout-bare", m) for m in SERVICES["rollout"].methods]
    + [("trainer", m) for m in SERVICES["trainer"].methods]
)


@pytest.mark.parametrize(("target", "method"), RAW_TARGETS, ids=lambda x: getattr(x, "name", x))
@pytest.mark.parametrize("raw", MALFORMED)
def test_a_message_that_does_not_parse_is_invalid_argument(
    cluster, baseline_rss, target, method, raw
) -> None:
    code = _raw_call(cluster, target, method, raw)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{target} {method.name} {raw!r}: {code}"


def _fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples, deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large],
    )  # fmt: skip


@_fuzz(120)
@given(target=st.sampled_from(RAW_TARGETS), raw=st.binary(max_size=64))
def test_random_bytes_never_get_internal_or_unknown(cluster, baseline_rss, target, raw) -> None:
    name, method = target
    code = _raw_call(cluster, name, method, raw)
    assert code not in NEVER, f"{name} {method.name} {raw!r}: {code}"


@_fuzz(250)
@given(request=generate_requests(), bare=st.booleans())
# logits / 1e-45 overflowed float32: sampling drew from NaN probabilities (UNKNOWN)
@example(
    request=_generate(sampling=rollout_pb2.SamplingParams(temperature=1e-45, max_new_tokens=4)),
    bare=False,
)
# a 1M-token prompt in a group of 1024: the replica grew past 12 GiB before any length check
@example(
    request=_generate(prompts=[rollout_pb2.Prompt(token_ids=[1] * (1 << 20))], group_size=1024),
    bare=False,
)
def test_generate_answers_a_documented_code(cluster, baseline_rss, request, bare) -> None:
    svc = cluster.bare if bare else cluster.rollouts[0]  # type: ignore[attr-defined]
    with _channel(svc) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        code = _code(
            lambda: stub.Generate(request, metadata=_meta(cluster), timeout=CALL_TIMEOUT_S)
        )
    event(f"{'bare' if bare else 'loaded'} {code.name}")
    shown = str(request)[:600]
    assert code in DOCUMENTED, f"{'bare' if bare else 'loaded'} Generate -> {code}: {shown}"
    if bare:
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), code


CONTROL = ["GetStatus", "Pause", "Resume", "Status"]


def _control(c: LocalCluster, name: str, reason: str) -> grpc.StatusCode:
    """One control RPC: the trainer's GetStatus, Pause (with `reason`) or Resume, or the
    rollout's Status."""
    meta = _meta(c)
    svc = c.rollouts[0] if name == "Status" else c.trainer
    assert svc is not None
    with _channel(svc) as ch:
        if name == "Status":
            stub = rollout_pb2_grpc.RolloutStub(ch)
            return _code(
                lambda: stub.Status(rollout_pb2.RolloutStatusRequest(), metadata=meta, timeout=10)
            )
        trainer = trainer_pb2_grpc.TrainerStub(ch)
        request = {
            "GetStatus": trainer_pb2.GetStatusRequest(),
            "Pause": trainer_pb2.PauseRequest(reason=reason),
            "Resume": trainer_pb2.ResumeRequest(),
        }[name]
        return _code(lambda: getattr(trainer, name)(request, metadata=meta, timeout=10))


@_fuzz(120)
@given(calls=st.lists(st.tuples(st.sampled_from(CONTROL), TEXT), min_size=1, max_size=4))
# a 60 MiB pause reason became the detail every later status carried
@example(calls=[("Pause", "x" * (60 << 20)), ("GetStatus", "")])
def test_status_pause_resume_answer_a_documented_code(cluster, baseline_rss, calls) -> None:
    """Random sequences of the control RPCs; each ends paused, so the 1000-step run takes at
    most a step between examples."""
    for name, reason in [*calls, ("Pause", "")]:
        code = _control(cluster, name, reason)
        event(f"{name} {code.name}")
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.FAILED_PRECONDITION), (name, len(reason), code)  # fmt: skip


# What the fuzzing found, each answered now with INVALID_ARGUMENT naming the field, at once.
FOUND = {
    "tiny-temperature": _generate(
        sampling=rollout_pb2.SamplingParams(temperature=1e-45, max_new_tokens=4)
    ),
    "long-prompt-large-group": _generate(
        prompts=[rollout_pb2.Prompt(token_ids=[1] * (1 << 20))], group_size=1024
    ),
}


@pytest.mark.parametrize(
    ("name", "field"),
    [("tiny-temperature", "temperature"), ("long-prompt-large-group", "prompt tokens")],
)
def test_what_the_fuzzing_found_is_invalid_argument(cluster, baseline_rss, name, field) -> None:
    with _channel(cluster.rollouts[0]) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(FOUND[name], metadata=_meta(cluster), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert field in err.value.details()


def test_a_huge_pause_reason_is_invalid_argument(cluster, baseline_rss) -> None:
    with _channel(cluster.trainer) as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Pause(
                trainer_pb2.PauseRequest(reason="x" * (60 << 20)),
                metadata=_meta(cluster),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "reason has 62914560 characters" in err.value.details()
        status = stub.GetStatus(trainer_pb2.GetStatusRequest(), metadata=_meta(cluster), timeout=10)
    assert len(status.detail) < 2048


def test_services_survive_the_fuzzing_with_bounded_memory(cluster, baseline_rss) -> None:
    targets = _targets(cluster)
    for name, svc in targets.items():
        assert _serving(svc, ready=name != "rollout-bare"), name
    grown = {name: _rss(svc) - baseline_rss[name] for name, svc in targets.items()}
    print(
        f"RSS growth over the fuzzing (MiB): { {k: round(v / 2**20, 1) for k, v in grown.items()} }"
    )
    for name, delta in grown.items():
        assert delta < RSS_GROWTH_BOUND_BYTES, (
            f"{name} RSS grew {delta / 2**20:.1f} MiB over the fuzzing "
            f"(bound {RSS_GROWTH_BOUND_BYTES >> 20} MiB): {grown}"
        )
