"""The trainer loop and the dispatcher, with fakes recording the order of events."""

from __future__ import annotations

import math
import threading

import pytest
from fakes import EventLog, FakeLearner, FakePublisher, FakeRecordStore, FakeReplica

from trace_common.rl.core import FunctionScorer, TrainerConfig, TrainerCore, as_scorer
from trace_common.rl.dispatch import DispatchConfig, Dispatcher, StaticDirectory
from trace_common.rollout.types import SamplingConfig
from trace_common.tasks import CharTokenizer, PromptStream, exact_match_reward, make_task

TOK = CharTokenizer()


def scorer(sample, problem) -> float:
    return exact_match_reward(sample.completion_tokens, problem.answer, TOK)


def make_core(
    replicas, log, store, *, mode="trace", prompts=4, group=2, units=1, max_staleness=3,
    lost_records="regenerate", overlap_push=False,
):  # fmt: skip
    stream = PromptStream(make_task("reverse", 1), TOK, seed=0)
    # reverse of 1 digit is the digit itself: build each prompt's right answer tokens
    answers = {i: [*TOK.encode(stream.problem(i).answer)] for i in range(64)}
    for r in replicas:
        r.answers = answers
    cfg = TrainerConfig(
        run_id="r1",
        prompts_per_step=prompts,
        group_size=group,
        mode=mode,
        max_staleness=max_staleness,
        sampling=SamplingConfig(max_new_tokens=4),
        lost_records=lost_records,
        overlap_push=overlap_push,
    )
    disp = Dispatcher(
        StaticDirectory(replicas),
        DispatchConfig(prompts_per_unit=units, retry_failed_after_s=0.0),
        on_event=log,
    )
    publisher = FakePublisher(log, replicas)
    learner = FakeLearner(log)
    core = TrainerCore(
        cfg,
        prompts=stream,
        dispatcher=disp,
        scorer=scorer,
        records=FakeRecordStore(store, log),
        learner=learner,
        publisher=publisher,
        on_event=log,
    )
    return core, learner, publisher


def test_step_runs_components_in_order() -> None:
    log, store = EventLog(), {}
    core, learner, publisher = make_core([FakeReplica("a", store=store)], log, store, units=4)
    core.publish()
    m = core.step()
    kinds = [k for k in log.kinds() if k not in ("dispatch", "done")]
    assert kinds == [
        "learner.export", "publish", "push",  # version 0
        "prompts", "rollout", "score", "fetch", "records", "learner.train", "train",
        "learner.export", "publish", "push",  # version 1
    ]  # fmt: skip
    assert m["step"] == 1 and m["policy_version"] == 1
    assert m["reward_mean"] == pytest.approx(0.5)  # even group indices are right
    assert m["samples"] == 8 and m["samples_trained"] == 8 and m["samples_dropped_stale"] == 0
    assert publisher.pushed[-1] == (1, {"format": "fake", "step": 1, "mode": "trace"})
    seen = learner.seen[0]
    assert [ts.advantage for ts in seen[:2]] == pytest.approx([1.0, -1.0], abs=1e-4)
    # the learner got exactly the blobs the replica wrote for those samples
    assert all(ts.records == store[("r1", 0, ts.rollout.sample_id)] for ts in seen)


class GatedPublisher(FakePublisher):
    """Pushes block until the test opens the gate; `fail` makes the next push raise."""

    def __init__(self, log, replicas) -> None:
        super().__init__(log, replicas)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.threads: list[str] = []
        self.fail: Exception | None = None

    def publish(self, version, tensors, metadata) -> None:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        super().publish(version, tensors, metadata)


def gated_core(max_staleness: int = 1):
    log, store = EventLog(), {}
    replica = FakeReplica("a", store=store)
    core, learner, _ = make_core([replica], log, store, max_staleness=max_staleness,
                                 overlap_push=True)  # fmt: skip
    core.publisher = pub = GatedPublisher(log, [replica])
    pub.gate.set()
    core.publish()  # version 0, in the caller's thread
    pub.gate.clear()
    return core, learner, pub, replica, log


def test_overlapped_push_runs_beside_the_next_step_in_version_order() -> None:
    core, learner, pub, replica, _ = gated_core()
    m1 = core.step()  # exports version 1, pushes it in the background (held at the gate)
    assert pub.started.wait(5) and m1["weight_push_in_background"] is True
    assert core.version == 1 and core.pushed_version == 0 and replica.version == 0
    pub.started.clear()
    waiter = threading.Thread(target=core.step)  # step 2 rolls out on version 0 (staleness 1)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive(), "step 2 must wait for version 1's push before pushing version 2"
    assert len(learner.seen) == 2, "step 2 trains while version 1 is being pushed"
    pub.gate.set()
    waiter.join(10)
    core.close()
    assert [v for v, _ in pub.pushed] == [0, 1, 2] and core.pushed_version == 2
    assert pub.threads[0] == threading.current_thread().name
    assert all(t.startswith("weight-push") for t in pub.threads[1:])
    assert core.last_push_seconds > 0


def test_a_failed_background_push_fails_the_next_step() -> None:
    core, _, pub, _, _ = gated_core()
    core.step()
    pub.fail = RuntimeError("weight-sync refused version 1")
    pub.gate.set()
    with pytest.raises(RuntimeError, match="refused version 1"):
        core.step()  # at its start, or at its publish, which waits for the push
    assert core.pushed_version == 0


def test_no_overlap_without_staleness_room() -> None:
    core, _, pub, _, _ = gated_core(max_staleness=0)
    pub.gate.set()
    m = core.step()
    assert m["weight_push_in_background"] is False and core.pushed_version == 1
    assert pub.threads == [threading.current_thread().name] * 2


def test_no_records_fetched_outside_trace_mode() -> None:
    log, store = EventLog(), {}
    core, learner, _ = make_core([FakeReplica("a", store=store)], log, store, mode="rtn")
    core.publish()
    core.step()
    assert "fetch" not in log.kinds() and store == {}
    assert all(ts.records is None for ts in learner.seen[0])


def test_failed_replica_work_is_redispatched_without_loss_or_duplicates() -> None:
    log, store = EventLog(), {}
    bad = FakeReplica("bad", store=store, fail_on_calls=[1, 2, 3])
    good = FakeReplica("good", store=store)
    core, learner, _ = make_core([bad, good], log, store, prompts=6, group=2, units=1)
    core.publish()
    m = core.step()
    seen = learner.seen[0]
    assert sorted((ts.rollout.prompt_id, ts.rollout.group_index) for ts in seen) == [
        (p, j) for p in range(6) for j in range(2)
    ]
    assert m["redispatched_units"] >= 1 and m["failed_replicas"] == ["bad"]
    # re-dispatched units carry a new attempt number in their sample ids
    assert any("-a0-" not in ts.rollout.sample_id for ts in seen)
    assert len({ts.rollout.sample_id for ts in seen}) == 12
    assert m["samples"] == 12


def test_behind_replica_is_retried_not_failed() -> None:
    log, store = EventLog(), {}
    r = FakeReplica("a", store=store, behind_on_calls=[1])
    core, _, _ = make_core([r], log, store, prompts=2, units=2)
    core.publish()
    m = core.step()
    assert m["failed_replicas"] == [] and m["samples"] == 4
    assert any(e.startswith("behind") for e in log.events)


def test_stale_groups_are_dropped_and_counted() -> None:
    log, store = EventLog(), {}
    r = FakeReplica("a", store=store)
    core, learner, publisher = make_core([r], log, store, max_staleness=1)
    publisher.replicas = []  # the replica never updates: it stays on version 0
    core.publish()
    m1 = core.step()  # version 0 samples train version 0
    m2 = core.step()  # version 0 samples, trainer at 1: staleness 1, kept
    assert (m1["staleness_max"], m2["staleness_max"]) == (0, 1)
    core.dispatcher.run = _wrap_min_version(core.dispatcher.run)
    m3 = core.step()  # trainer at 2: gap 2 > 1 -> every group dropped
    assert m3["samples_dropped_stale"] == 8 and m3["samples_trained"] == 0
    assert len(learner.seen) == 2  # nothing trained at step 3


def _wrap_min_version(run):
    """The fake replica ignores min_policy_version; pretend the trainer asked for 0."""

    def wrapped(*args, **kwargs):
        kwargs["min_policy_version"] = 0
        return run(*args, **kwargs)

    return wrapped


def test_step_before_publish_is_an_error() -> None:
    log, store = EventLog(), {}
    core, _, _ = make_core([FakeReplica("a", store=store)], log, store)
    with pytest.raises(RuntimeError, match="no policy version published"):
        core.step()


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown training mode 'fp8'"):
        TrainerConfig(mode="fp8")
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        TrainerConfig(group_size=1)


def test_min_version_never_reaches_before_this_runs_first_publish() -> None:
    log, store = EventLog(), {}
    r = FakeReplica("a", store=store)
    core, _, _ = make_core([r], log, store, max_staleness=3)
    core.version = 6  # weight-sync already held versions 0..6 of another run
    seen = []
    run = core.dispatcher.run

    def spy(*args, **kwargs):
        seen.append(kwargs["min_policy_version"])
        return run(*args, **kwargs)

    core.dispatcher.run = spy
    core.publish()  # this run's first version: 7
    core.step()
    core.step()
    assert core.version_floor == 7 and seen == [7, 7]


def test_dead_replica_backs_off_exponentially() -> None:
    import time as _time

    store: dict = {}

    class Slow(FakeReplica):
        def generate(self, call):
            _time.sleep(0.05)
            return super().generate(call)

    dead = FakeReplica("dead", store=store, fail_on_calls=range(1, 1000))
    good = Slow("good", store=store)
    disp = Dispatcher(
        StaticDirectory([dead, good]),
        DispatchConfig(prompts_per_unit=1, retry_failed_after_s=0.05),
    )
    stream = PromptStream(make_task("reverse", 1), TOK, seed=0)
    t0 = _time.monotonic()
    samples, stats = disp.run(
        stream.next_batch(10), run_id="r", step=0, group_size=2,
        sampling=SamplingConfig(max_new_tokens=2), min_policy_version=0, write_records=False,
    )  # fmt: skip
    elapsed = _time.monotonic() - t0
    assert len(samples) == 20 and stats.failed_replicas == ["dead"]
    # rests of 0.05, 0.1, 0.2, ... s: call k comes no earlier than 0.05 * (2**(k-1) - 1) s
    # (a fixed 0.05 s rest would allow elapsed / 0.05 calls, ~10 or more)
    bound = 1 + math.log2(elapsed / 0.05 + 1)
    assert 1 <= dead.calls <= bound, (dead.calls, elapsed)
    assert stats.redispatched_units == dead.calls


def test_group_with_a_missing_record_is_dropped_and_counted() -> None:
    log, store = EventLog(), {}
    core, learner, _ = make_core(
        [FakeReplica("a", store=store)], log, store, units=4, lost_records="drop"
    )

    class Evicting(FakeRecordStore):
        def fetch(self, run_id, policy_version, sample_ids, *, generations=None):
            got = super().fetch(run_id, policy_version, sample_ids)
            got.pop(sample_ids[3])  # e.g. evicted at quant-cache's memory bound
            return got

    core.records = Evicting(store, log)
    core.publish()
    m = core.step()
    assert m["samples_dropped_records"] == 2  # the whole group of that sample (group_size 2)
    assert m["samples_trained"] == 6 and len(learner.seen[0]) == 6
    assert all(ts.records is not None for ts in learner.seen[0])


def test_hung_replica_dropped_from_directory_loses_its_unit_to_another() -> None:
    import threading

    store: dict = {}
    release = threading.Event()

    class Hung(FakeReplica):
        def generate(self, call):
            release.wait(10)  # hangs (e.g. SIGSTOP) until the test releases it
            return super().generate(call)

    class Directory:
        def __init__(self) -> None:
            self.listed = [hung, good]
            self.t0 = None

        def replicas(self):
            return list(self.listed)

    hung, good = Hung("hung", store=store), FakeReplica("good", store=store)
    directory = Directory()
    disp = Dispatcher(directory, DispatchConfig(prompts_per_unit=1, abandon_grace_s=0.1))
    stream = PromptStream(make_task("reverse", 1), TOK, seed=0)
    timer = threading.Timer(0.5, lambda: directory.listed.remove(hung))  # heartbeats stop
    timer.start()
    samples, stats = disp.run(
        stream.next_batch(3), run_id="r", step=0, group_size=2,
        sampling=SamplingConfig(max_new_tokens=2), min_policy_version=0, write_records=True,
    )  # fmt: skip
    release.set()
    assert sorted((s.prompt_id, s.group_index) for s in samples) == [
        (p, j) for p in range(3) for j in range(2)
    ]
    assert {s.replica_id for s in samples} == {"good"}
    assert stats.failed_replicas == ["hung"] and stats.redispatched_units == 1
    assert any("-a1-" in s.sample_id for s in samples)  # the lost unit's next attempt


def test_republish_pushes_the_same_version_with_the_same_weights() -> None:
    log = EventLog()
    core, _learner, publisher = make_core([FakeReplica("a")], log, {}, mode="bf16")
    with pytest.raises(RuntimeError, match="no policy version"):
        core.republish()
    core.publish()
    core.step()
    version = core.version
    core.republish()
    assert core.version == version  # the number does not move
    (v1, meta1), (v2, meta2) = publisher.pushed[-2:]
    assert v1 == v2 == version and meta1 == meta2  # same step, same export
    assert log.events[-1] == f"republish version={version}"


class Losing(FakeRecordStore):
    """Loses the records of the samples whose ids match `lost` (a Redis restart wiped them)."""

    def __init__(self, store, log, lost) -> None:
        super().__init__(store, log)
        self.lost = lost

    def fetch(self, run_id, policy_version, sample_ids, *, generations=None):
        got = super().fetch(run_id, policy_version, sample_ids)
        return {k: v for k, v in got.items() if not self.lost(k)}


def test_lost_records_are_regenerated_in_the_same_step_and_counted() -> None:
    log, store = EventLog(), {}
    core, learner, _ = make_core([FakeReplica("a", store=store)], log, store, units=1)
    # prompt 1's group (unit 1 of the first round) loses one record
    core.records = Losing(store, log, lambda sid: sid == "s0-u1-a0-0-1")
    core.publish()
    m = core.step()
    assert m["samples_regenerated"] == 2 and m["samples_dropped_records"] == 0, m
    assert m["samples_unguided"] == 0 and m["samples_trained"] == m["samples"] == 8
    kinds = log.kinds()
    i = kinds.index("regenerate")
    assert "dispatch" in kinds[i:] and kinds.index("learner.train") > i  # before training
    seen = learner.seen[0]
    assert all(ts.records is not None and not ts.unguided for ts in seen)
    assert sorted(ts.rollout.prompt_id for ts in seen) == sorted([0, 0, 1, 1, 2, 2, 3, 3])
    again = [ts.rollout.sample_id for ts in seen if ts.rollout.prompt_id == 1]
    assert again == ["s0-u4-a0-0-0", "s0-u4-a0-0-1"]  # a fresh unit id: fresh sample ids


def test_regeneration_is_bounded_then_the_group_is_dropped() -> None:
    log, store = EventLog(), {}
    core, _, _ = make_core([FakeReplica("a", store=store)], log, store, units=1)
    core.records = Losing(store, log, lambda sid: sid.endswith("-0-1") and "-u0-" not in sid)
    core.publish()  # every group but unit 0's, and each regenerated one, loses a record
    m = core.step()
    assert core.config.regenerate_attempts == 2
    assert m["samples_regenerated"] == 2 * 6, m  # 3 groups of 2, twice
    assert m["samples_dropped_records"] == 6 and m["samples_trained"] == 2, m
    assert log.kinds().count("regenerate") == 2


def test_lost_records_trained_unguided_when_configured() -> None:
    log, store = EventLog(), {}
    core, learner, _ = make_core(
        [FakeReplica("a", store=store)], log, store, units=1, lost_records="unguided"
    )
    core.records = Losing(store, log, lambda sid: sid == "s0-u2-a0-0-0")
    core.publish()
    m = core.step()
    assert m["samples_unguided"] == 2 and m["samples_regenerated"] == 0, m
    assert m["samples_trained"] == 8 and m["samples_dropped_records"] == 0
    unguided = [ts for ts in learner.seen[0] if ts.unguided]
    assert {ts.rollout.prompt_id for ts in unguided} == {2}
    assert all(ts.records is None for ts in unguided)
    assert all(ts.records is not None for ts in learner.seen[0] if not ts.unguided)


def test_config_rejects_unknown_lost_records() -> None:
    with pytest.raises(ValueError, match="lost_records"):
        TrainerConfig(lost_records="retry")
    with pytest.raises(ValueError, match="regenerate_attempts"):
        TrainerConfig(regenerate_attempts=0)


class PullingLearner(FakeLearner):
    """A sharded learner as TrainerCore sees it: its ranks pull the records themselves
    (`pulls_records`), so rank 0 asks it which groups lack one (`check_records`)."""

    pulls_records = True

    def __init__(self, log, records) -> None:
        super().__init__(log)
        self.records = records

    def check_records(self, samples):
        self.log(f"learner.check n={len(samples)}")
        lacking = set()
        for ts in samples:
            got = self.records.fetch("r1", ts.rollout.policy_version, [ts.rollout.sample_id])
            if ts.rollout.sample_id not in got:
                lacking.add(ts.rollout.prompt_id)
        return lacking


class NoFetch:
    def fetch(self, *args, **kwargs):
        raise AssertionError("rank 0 fetched records its learner's ranks pull")


def test_lost_records_are_regenerated_when_the_learner_ranks_pull_them() -> None:
    log, store = EventLog(), {}
    core, _, _ = make_core([FakeReplica("a", store=store)], log, store, units=1)
    learner = PullingLearner(log, Losing(store, log, lambda sid: sid == "s0-u1-a0-0-1"))
    core.learner, core.records = learner, NoFetch()
    core.publish()
    m = core.step()
    assert m["samples_regenerated"] == 2 and m["samples_dropped_records"] == 0, m
    assert m["samples_trained"] == 8
    kinds = log.kinds()
    assert kinds.index("learner.check") < kinds.index("regenerate") < kinds.index("learner.train")
    assert kinds.count("learner.check") == 2  # the step's samples, then the regenerated group
    seen = learner.seen[0]
    assert all(ts.records is None for ts in seen)  # the ranks attach them
    again = [ts.rollout.sample_id for ts in seen if ts.rollout.prompt_id == 1]
    assert again == ["s0-u4-a0-0-0", "s0-u4-a0-0-1"]


def test_rewards_that_fail_score_zero_and_the_step_trains_every_sample() -> None:
    """A reward that raises on some samples: they score 0 and are counted; the step trains
    all of them, the others scored as usual."""
    log, store = EventLog(), {}
    core, learner, _ = make_core([FakeReplica("a", store=store)], log, store, units=2)

    def flaky(sample, problem) -> float:
        if sample.group_index == 0:
            raise RuntimeError("the verifier crashed")
        return 1.0

    core.scorer = as_scorer(flaky)
    core.publish()
    m = core.step()
    assert m["samples_trained"] == 8 and m["reward_errors"] == 4 and m["reward_timeouts"] == 0
    rewards = {(ts.rollout.prompt_id, ts.rollout.group_index): ts.reward for ts in learner.seen[0]}
    assert all(r == (0.0 if gi == 0 else 1.0) for (_, gi), r in rewards.items())


def test_each_unit_is_scored_as_it_arrives_while_others_are_generated() -> None:
    """Scores are submitted from the dispatcher's accept callback, unit by unit, before the
    rollout phase ends."""
    log, store = EventLog(), {}
    core, _, _ = make_core([FakeReplica("a", store=store)], log, store, units=1)
    order: list[str] = []

    class Recording:
        def submit(self, sample, problem):
            order.append(f"score p{sample.prompt_id}")
            return FunctionScorer(scorer).submit(sample, problem)

    core.scorer = Recording()
    original = core.dispatcher._on_event

    def on_event(e: str) -> None:
        if e.startswith("done unit="):
            order.append(e.split()[1])
        original(e)

    core.dispatcher._on_event = on_event
    core.publish()
    core.step()
    first_score = order.index("score p0")
    assert order[:first_score] == ["unit=0"], order  # unit 0 scored before unit 1 finished
    assert order.count("unit=3") == 1 and order.index("unit=3") > first_score
