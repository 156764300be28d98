"""The reward pool: rewards run in worker processes; one that raises, hangs, dies or returns
nonsense scores 0 with its status and never stops the others."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest

from trace_common.rewards import RewardError, RewardPool, RewardPoolConfig, load_reward

HERE = pathlib.Path(__file__).parent


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))  # custom_rewards, as a user's module on sys.path


def pool(name: str, **kw) -> RewardPool:
    return RewardPool(RewardPoolConfig(name=name, **kw))


def test_custom_rewards_get_their_options_and_fields() -> None:
    with pool("custom_rewards:length", options={"per_char": 0.5}) as p:
        assert p.fields == ("prompt",)
        assert [p.submit({}, "abcd").result().value for _ in range(3)] == [2.0, 2.0, 2.0]


def test_rewards_run_in_parallel_across_workers() -> None:
    with pool("custom_rewards:sleepy", workers=4, timeout_s=10) as p:
        p.submit({}, "warm").result()  # every worker started and imported
        t0 = time.perf_counter()
        outcomes = [f.result() for f in [p.submit({"sleep": 0.5}, "x") for _ in range(4)]]
        wall = time.perf_counter() - t0
    assert all(o.status == "ok" and o.value == 1.0 for o in outcomes)
    assert wall < 1.5, f"4 calls of 0.5 s on 4 workers took {wall:.2f} s"


def test_a_reward_that_raises_scores_zero_and_the_others_go_on() -> None:
    with pool("custom_rewards:raises") as p:
        o = p.submit({}, "abc").result()
        assert (o.value, o.status) == (0.0, "error")
        assert "RuntimeError: cannot score 'abc'" in o.detail
        assert p.submit({}, "again").result().status == "error"  # the worker lives on


def test_a_reward_past_its_timeout_is_killed_and_its_worker_replaced() -> None:
    with pool("custom_rewards:sleepy", workers=1, timeout_s=0.5) as p:
        t0 = time.perf_counter()
        slow = p.submit({"sleep": 30}, "x").result()
        assert time.perf_counter() - t0 < 5
        assert (slow.value, slow.status) == (0.0, "timeout")
        fast = p.submit({"sleep": 0}, "x").result()  # a new worker took over
        assert (fast.value, fast.status) == (1.0, "ok")


def test_a_timed_out_reward_leaves_no_process_behind(tmp_path: pathlib.Path) -> None:
    before = _sleepers()
    with pool("custom_rewards:spawns", workers=1, timeout_s=1.0) as p:
        assert p.submit({}, "x").result().status == "timeout"
    time.sleep(0.3)
    assert _sleepers() - before == set(), "the reward's child outlived the killed worker"


def _sleepers() -> set[int]:
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd[:2] == [b"sleep", b"300"]:
                out.add(int(pid))
    return out


def test_a_worker_that_dies_mid_call_scores_zero_and_is_replaced() -> None:
    with pool("custom_rewards:dies", workers=1) as p:
        o = p.submit({}, "x").result()
        assert (o.value, o.status) == (0.0, "error") and "exited (code 3)" in o.detail
        assert p.submit({}, "x").result().status == "error"  # and again, with a new worker


def test_what_a_reward_prints_does_not_corrupt_its_answers() -> None:
    with pool("custom_rewards:chatty", workers=1) as p:
        assert [p.submit({}, "x").result().value for _ in range(3)] == [0.25] * 3


def test_a_reward_that_returns_no_number_is_an_error() -> None:
    with pool("custom_rewards:not_a_number") as p:
        o = p.submit({}, "x").result()
        assert o.status == "error" and "expected a finite float" in o.detail


def test_an_unknown_reward_names_the_known_ones() -> None:
    with pytest.raises(
        RewardError, match=r"unknown reward 'f1'; known: \['code', 'exact_match', 'math'\]"
    ):
        load_reward("f1")


def test_a_custom_reward_that_does_not_import_gives_the_import_error() -> None:
    with pytest.raises(RewardError, match="importing module 'no_such_module' failed: "
                       "ModuleNotFoundError: No module named 'no_such_module'"):  # fmt: skip
        pool("no_such_module:score")
    with pytest.raises(RewardError, match="module 'custom_rewards' has no function 'nope'"):
        pool("custom_rewards:nope")


def test_options_that_do_not_fit_the_reward_are_named() -> None:
    with pytest.raises(
        RewardError, match=r"options \['per_token'\] do not fit.*takes \['per_char'\]"
    ):
        load_reward("custom_rewards:length", {"per_token": 1})


def test_workers_import_what_the_trainer_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker sees the trainer's sys.path (a user's module next to the recipe)."""
    assert str(HERE) in sys.path
    with pool("custom_rewards:length") as p:
        assert p.submit({}, "xyz").result().value == 3.0
