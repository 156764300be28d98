"""The continuous-batching scheduler on a fake step backend (orchestration only: slots,
prefill and decode phases, stopping, records rows, the weight-swap barrier, cancellation,
per-sequence seeds). The CUDA backend's numerics are tested on the GPU (tests/unit/gpu)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from trace_common.rollout.scheduler import (
    CancelledError,
    SlotScheduler,
    sample_rows,
    sequence_seed,
    uniforms,
)
from trace_common.rollout.types import SamplingConfig

V = 32
EOS = 2
PAD = 0
MARGIN = 30.0  # fake logits: the favoured token leads by this much (greedy is certain)


def favoured(token: int, pos: int, version: int) -> int:
    """The fake model's next token after `token` at `pos`."""
    return (token * 7 + pos + 3 + 11 * version) % V


class FakeBackend:
    """Logits favour `favoured(token, pos)`; every fed (token, pos) is written into the slot's
    record history, so `records` proves which rows the scheduler asks for. `prefill_tokens`
    > 0 gives it a batched prefill."""

    def __init__(self, batch: int, capacity: int, *, step_sleep: float = 0.0,
                 prefill_tokens: int = 0) -> None:  # fmt: skip
        self.batch, self.capacity, self.vocab = batch, capacity, V
        self.prefill_tokens = prefill_tokens
        self.hist = np.full((batch, capacity, 2), -1, dtype=np.int64)
        self.version = 0
        self.step_sleep = step_sleep
        self.steps = 0
        self.prefills: list[int] = []  # tokens per prefill call
        self.copies: list[tuple[int, tuple[int, ...], int]] = []  # (src, dsts, n) per copy_prefix
        self.busy = threading.Lock()

    def _logits(self, t: int, p: int) -> torch.Tensor:
        row = torch.zeros(V)
        row[favoured(t, p, self.version)] = MARGIN
        return row

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        with self.busy:
            if self.step_sleep:
                time.sleep(self.step_sleep)
            logits = torch.zeros(self.batch, V)
            for b in range(self.batch):
                t, p = int(tokens[b]), int(pos[b])
                assert 0 <= p < self.capacity, f"slot {b} fed at position {p}"
                logits[b] = self._logits(t, p)
                self.hist[b, p] = (t, p)
            self.steps += 1
            return logits

    def prefill(self, slots, starts, chunks) -> torch.Tensor:
        with self.busy:
            n = sum(map(len, chunks))
            assert 0 < n <= self.prefill_tokens
            self.prefills.append(n)
            out = []
            for slot, start, chunk in zip(slots, starts, chunks, strict=True):
                for i, t in enumerate(chunk):
                    self.hist[slot, start + i] = (t, start + i)
                out.append(self._logits(chunk[-1], start + len(chunk) - 1))
            return torch.stack(out)

    def copy_prefix(self, src: int, dsts, n: int) -> None:
        with self.busy:
            assert src not in dsts and 0 < n <= self.capacity
            self.hist[list(dsts), :n] = self.hist[src, :n]
            self.copies.append((src, tuple(dsts), n))

    def sync(self) -> None:
        pass

    def records(self, slot: int, rows: int, tokens: Sequence[int], prompt_len: int) -> bytes:
        return json.dumps(self.hist[slot, :rows].tolist()).encode()

    def load(self, version: int) -> None:
        assert self.busy.acquire(blocking=False), "weights loaded while a step runs"
        self.version = version
        self.busy.release()


def reference(prompt: Sequence[int], max_new: int, version: int = 0) -> tuple[list[int], str]:
    """What greedy decoding of the fake model gives."""
    toks, out = list(prompt), []
    while True:
        t = favoured(toks[-1], len(toks) - 1, version)
        out.append(t)
        toks.append(t)
        if t == EOS:
            return out, "stop"
        if len(out) == max_new:
            return out, "length"


@pytest.fixture
def sched_factory():
    made = []

    def make(batch: int = 3, capacity: int = 64, **kw) -> tuple[SlotScheduler, FakeBackend]:
        be = FakeBackend(batch, capacity, **kw)
        s = SlotScheduler(be, eos_id=EOS, pad_id=PAD, device="cpu", version=0)
        made.append(s)
        return s, be

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("prefill_tokens", [0, 5])
def test_greedy_continuous_batching_matches_reference_and_records_rows(
    sched_factory, prefill_tokens: int
) -> None:
    sched, be = sched_factory(batch=3, prefill_tokens=prefill_tokens)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, V, size=int(n))) for n in (1, 5, 2, 9, 3, 4, 7)]
    sp = SamplingConfig(temperature=0.0, max_new_tokens=12)
    samples, version = sched.generate(prompts, 2, sp, with_records=True)
    assert version == 0 and len(samples) == 14
    reasons = set()
    for s in samples:
        prompt = prompts[s.prompt_index]
        want, reason = reference(prompt, 12)
        assert s.completion_tokens == want, (s.prompt_index, s.group_index)
        assert s.finish_reason == reason
        reasons.add(reason)
        assert len(s.logprobs) == len(want) and max(s.logprobs) <= 0.0
        rows = json.loads(s.records)  # (token fed, position) per row, one per token but the last
        full = prompt + want
        assert rows == [[t, i] for i, t in enumerate(full[:-1])]
    assert reasons == {"stop", "length"}, "the prompts should exercise both finish reasons"
    # 14 sequences on 3 slots: far fewer steps than running them one at a time
    fed = sum(len(prompts[s.prompt_index]) + len(s.completion_tokens) - 1 for s in samples)
    assert be.steps < fed
    if prefill_tokens:  # prompts went through the batched prefill, chunked to its budget,
        # or were copied from the slot of the group's other member
        shared = sched.stats()["shared_prompt_tokens_total"]
        assert sum(be.prefills) + shared == 2 * sum(map(len, prompts)) and max(be.prefills) <= 5
        assert shared == sum(n for _, dsts, n in be.copies for _ in dsts) > 0
        assert be.steps <= fed - sum(be.prefills) - shared + 1


def test_a_group_prefills_its_prompt_once_and_samples_as_if_each_prefilled_it(
    sched_factory,
) -> None:
    """The completions of one prompt: one member prefills it, the others copy its positions
    and sample their first token from its logits. Tokens, log-probs and records equal those
    of a backend without batched prefill (each sequence feeds its own prompt); a member that
    takes a slot after every member holding the prompt has finished prefills it again."""
    global MARGIN
    prompt = [5, 9, 11, 4, 7, 3, 8, 6, 10]
    sp = SamplingConfig(temperature=1.0, max_new_tokens=3, seed=11)
    old, MARGIN = MARGIN, 1.0  # sampled first tokens differ between the members
    try:
        shared, be = sched_factory(batch=4, prefill_tokens=4)
        got, _ = shared.generate([prompt, prompt[:5]], 5, sp, with_records=True)
        alone, _ = sched_factory(batch=4)[0].generate([prompt, prompt[:5]], 5, sp,
                                                      with_records=True)  # fmt: skip
    finally:
        MARGIN = old
    key = lambda ss: [(s.prompt_index, s.group_index, s.completion_tokens, s.logprobs,  # noqa: E731
                       s.records) for s in ss]  # fmt: skip
    assert key(got) == key(alone)
    assert len({tuple(s.completion_tokens) for s in got}) > 2, "the members should differ"
    stats = shared.stats()
    prefilled, copied = stats["prefill_tokens_total"], stats["shared_prompt_tokens_total"]
    assert prefilled == sum(be.prefills) and prefilled + copied == 5 * (9 + 5)
    assert copied >= 3 * 9, "the first slots' members should copy the first prompt"
    assert prefilled > 9 + 5, "10 members on 4 slots: some prompt is prefilled again"
    assert all(n == len(prompt) or n == 5 for _, _, n in be.copies)


def test_prompt_sharing_under_random_load_equals_no_sharing(sched_factory) -> None:
    """12 random workloads: requests (group sizes 1-6, prompts 1-13 tokens, lengths 1-9,
    sampled) sent at once from several threads onto 2-5 slots, with a prefill budget of 1-6
    tokens. Every sample equals the same request on a backend that feeds prompts token by
    token, and prompts were copied (not only prefilled) in these workloads."""
    global MARGIN
    key = lambda ss: [(s.prompt_index, s.group_index, s.completion_tokens, s.logprobs,  # noqa: E731
                       s.finish_reason, s.records) for s in ss]  # fmt: skip
    copied = 0
    old, MARGIN = MARGIN, 1.0
    try:
        for seed in range(12):
            rng = np.random.default_rng(seed)
            batch, budget = int(rng.integers(2, 6)), int(rng.integers(1, 7))
            requests = []
            for r in range(int(rng.integers(2, 5))):
                prompts = [list(rng.integers(3, V, size=int(rng.integers(1, 14))))
                           for _ in range(int(rng.integers(1, 4)))]  # fmt: skip
                sp = SamplingConfig(temperature=1.0, max_new_tokens=int(rng.integers(1, 10)),
                                    seed=seed * 100 + r)  # fmt: skip
                requests.append((prompts, int(rng.integers(1, 7)), sp))
            results = {}
            for name, prefill in (("shared", budget), ("stepped", 0)):
                sched, _ = sched_factory(batch=batch, prefill_tokens=prefill)
                out: dict[int, list] = {}
                threads = [threading.Thread(target=lambda i=i, rq=rq, o=out, sc=sched: o.setdefault(
                    i, sc.generate(rq[0], rq[1], rq[2], with_records=True)[0]))
                    for i, rq in enumerate(requests)]  # fmt: skip
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert len(out) == len(requests), f"seed {seed} {name}: a request did not finish"
                results[name] = out
                if prefill:
                    copied += sched.stats()["shared_prompt_tokens_total"]
            for i in range(len(requests)):
                assert key(results["shared"][i]) == key(results["stepped"][i]), (seed, i)
    finally:
        MARGIN = old
    assert copied > 0, "no workload copied a prompt"


def test_stop_token_ids_end_a_sequence(sched_factory) -> None:
    sched, _ = sched_factory()
    prompt = [5, 6]
    want, _ = reference(prompt, 10)
    stop = want[2]
    samples, _ = sched.generate([prompt], 1, SamplingConfig(
        temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,)), with_records=False)  # fmt: skip
    first = want.index(stop) + 1
    assert samples[0].completion_tokens == want[:first]
    assert samples[0].finish_reason == "stop"


def test_sampling_depends_on_the_sequence_not_the_slot(sched_factory) -> None:
    """A request sampled alone and again beside other load gives the same completions."""
    sched, _ = sched_factory(batch=4)
    be_margin = [[9, 4, 11], [3, 3]]
    sp = SamplingConfig(temperature=1.0, max_new_tokens=6, seed=123)
    global MARGIN
    old, MARGIN = MARGIN, 1.0  # make sampling actually random
    try:
        alone, _ = sched.generate(be_margin, 3, sp, with_records=False)
        result: dict[str, list] = {}
        other = threading.Thread(target=lambda: result.setdefault("x", sched.generate(
            [[7] * 5] * 3, 2, SamplingConfig(temperature=1.0, max_new_tokens=9, seed=5),
            with_records=False)))  # fmt: skip
        other.start()
        again, _ = sched.generate(be_margin, 3, sp, with_records=False)
        other.join()
        reseeded, _ = sched.generate(be_margin, 3, SamplingConfig(
            temperature=1.0, max_new_tokens=6, seed=124), with_records=False)  # fmt: skip
    finally:
        MARGIN = old
    key = lambda ss: [(s.prompt_index, s.group_index, s.completion_tokens) for s in ss]  # noqa: E731
    assert key(alone) == key(again)
    assert key(alone) != key(reseeded)
    assert len({tuple(s.completion_tokens) for s in alone}) > 1, "samples should differ"


def test_swap_waits_for_admitted_requests_and_never_mixes_versions(sched_factory) -> None:
    sched, be = sched_factory(batch=2, step_sleep=0.002)
    prompts = [[4, 5, 6]] * 3
    sp = SamplingConfig(temperature=0.0, max_new_tokens=20)
    out: dict[str, tuple] = {}
    first = threading.Thread(target=lambda: out.setdefault("a", sched.generate(
        prompts, 2, sp, with_records=False)))  # fmt: skip
    first.start()
    while sched.active_slots == 0:
        time.sleep(0.001)
    swapper = threading.Thread(target=lambda: sched.swap(lambda: be.load(1), 1))
    swapper.start()
    time.sleep(0.01)
    second = threading.Thread(target=lambda: out.setdefault("b", sched.generate(
        prompts, 1, sp, with_records=False)))  # fmt: skip
    second.start()
    for t in (first, swapper, second):
        t.join(timeout=30)
    a, va = out["a"]
    b, vb = out["b"]
    assert (va, vb) == (0, 1)
    assert all(s.policy_version == 0 for s in a) and all(s.policy_version == 1 for s in b)
    for s in a:
        assert s.completion_tokens == reference(prompts[0], 20, 0)[0]
    for s in b:
        assert s.completion_tokens == reference(prompts[0], 20, 1)[0]


def test_cancelled_request_frees_its_slots(sched_factory) -> None:
    sched, _ = sched_factory(batch=2, step_sleep=0.001)
    flag = threading.Event()
    err: dict[str, BaseException] = {}

    def run() -> None:
        try:
            sched.generate(
                [[3] * 3] * 8, 4, SamplingConfig(temperature=0.0, max_new_tokens=50),
                with_records=False, cancelled=flag.is_set)  # fmt: skip
        except CancelledError as exc:
            err["e"] = exc

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.05)
    flag.set()
    t.join(timeout=10)
    assert "e" in err
    samples, _ = sched.generate([[3]], 1, SamplingConfig(temperature=0.0, max_new_tokens=2),
                                with_records=False)  # fmt: skip
    assert len(samples) == 1 and sched.active_slots == 0


def test_rejects_prompts_that_do_not_fit(sched_factory) -> None:
    sched, _ = sched_factory(capacity=16)
    with pytest.raises(ValueError, match="max_context"):
        sched.generate([[3] * 10], 1, SamplingConfig(max_new_tokens=8), with_records=False)
    with pytest.raises(ValueError, match=r"token ids \[40\]"):
        sched.generate([[3, 40]], 1, SamplingConfig(max_new_tokens=2), with_records=False)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        sched.generate([[]], 1, SamplingConfig(max_new_tokens=2), with_records=False)


def test_a_failing_step_fails_requests_and_the_engine() -> None:
    class Broken(FakeBackend):
        def step(self, tokens, pos):
            raise RuntimeError("device lost")

    sched = SlotScheduler(Broken(2, 16), eos_id=EOS, pad_id=PAD, device="cpu")
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            sched.generate([[3]], 1, SamplingConfig(max_new_tokens=2), with_records=False)
        with pytest.raises(RuntimeError, match="failed earlier"):
            sched.generate([[3]], 1, SamplingConfig(max_new_tokens=2), with_records=False)
    finally:
        sched.close()


def _truncated_probs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """The distribution sample_next draws from, written out from its definition."""
    x = logits.double() / t
    if k:
        kth = torch.topk(x, k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    acc = 0.0
    for i in order.tolist():
        if acc >= p or probs[i] == 0:
            break
        keep[i] = True
        acc += float(probs[i])
    probs = probs * keep
    return probs / probs.sum()


@pytest.mark.parametrize(("t", "k", "p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                           (1.0, 8, 0.6)])  # fmt: skip
def test_sample_rows_draws_the_truncated_distribution(t: float, k: int, p: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 24) * 2
    want = _truncated_probs(logits[0], t, k, p)
    n = 20000
    seeds = np.array([sequence_seed(7, i) for i in range(n)], dtype=np.uint64)
    u = torch.from_numpy(uniforms(seeds, np.zeros(n, dtype=np.uint64)))
    rows = logits.expand(n, -1)
    tok, logp = sample_rows(rows, torch.full((n,), t), torch.full((n,), k), torch.full((n,), p),
                            u, filtered=bool(k or p < 1))  # fmt: skip
    counts = torch.bincount(tok, minlength=24).double() / n
    assert float((counts - want).abs().sum()) / 2 < 0.02, (counts, want)
    assert bool((want[tok] > 0).all()), "drew a token outside the truncated support"
    torch.testing.assert_close(logp.double(), want[tok].log(), atol=1e-4, rtol=0)


def test_greedy_rows_take_argmax_with_untempered_logprob() -> None:
    logits = torch.randn(3, 10)
    tok, logp = sample_rows(logits, torch.tensor([0.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long),
                            torch.ones(3), torch.full((3,), 0.5, dtype=torch.float64),
                            filtered=False)  # fmt: skip
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0])
