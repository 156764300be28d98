"""Continuous batching over a fixed-size decode step.

The step backend (`StepBackend`: the CUDA-graph decode engine, or a fake in unit tests) runs
one token for each of its `batch` slots per step. Every slot holds one sequence, which is in
one of two phases:

  prefill  its prompt is written into the slot's KV cache and record history: in chunks of up
           to `prefill_tokens` prompt tokens (several sequences per chunk) by the backend's
           batched prefill, or, where the backend has none (`prefill_tokens == 0`), one prompt
           token per decode step
  decode   the slot feeds the token it sampled last

Each loop round runs one prefill chunk (when a sequence waits for one), samples the first
token of every sequence whose prompt it completed, then one decode step for the slots in the
decode phase. A finished sequence frees its slot at once and the next waiting sequence takes
it, so long-tail lengths do not idle the batch.

Groups share their prompt (batched-prefill backends): the completions of one prompt in a
request (`group_size` of them, 8 in a typical RL step) have the same prompt, so only one of
them prefills it. The others wait in their slots until it is done, then the backend copies
the prompt's positions (K/V and record rows) from that slot into theirs (`copy_prefix`), and
each samples its first token, with its own seed, from the logits the prefill left. That is
exactly what prefilling the prompt again would give, at a `group_size`-th of the cost. A
member that finds no slot holding the prompt any more (every member that had it finished)
prefills it itself.

Weight versions: `swap` closes the admission door, lets every admitted request finish on the
old weights, loads the new ones while nothing runs, and opens the door again. A request is
admitted whole, so all its completions come from one version, which they report.

Sampling (`sample_rows`) is per sequence: temperature, top-k, top-p and a seed. The random
draw of a sequence's t-th token is a counter-based hash of (request seed, sequence index, t),
so a sequence's samples do not depend on which slot it ran in or what ran beside it. On CUDA
the rows without top-k or top-p sample in one Triton kernel (`trace_common.kernels.sample`):
the same distribution from the same draw, each row read twice instead of copied to fp32
several times.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from trace_common.kernels import triton_available
from trace_common.rollout.types import (
    FINISH_LENGTH,
    FINISH_STOP,
    FinishReason,
    GeneratedSample,
    SamplingConfig,
)

log = logging.getLogger(__name__)

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x + _GOLDEN64) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def sequence_seed(request_seed: int, index: int) -> int:
    """The seed of sequence `index` (prompt-major flat index) of a request."""
    s = splitmix64(np.array([request_seed % (1 << 64)], dtype=np.uint64))
    return int(splitmix64(s ^ np.uint64(index))[0])


def uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """One uniform in (0, 1) per (sequence seed, token counter): float64 [n]."""
    h = splitmix64(seeds.astype(np.uint64) ^ splitmix64(counters.astype(np.uint64)))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def sample_rows(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # fp32 [B]; 0 = greedy
    top_k: torch.Tensor,  # int64 [B]; 0 = off
    top_p: torch.Tensor,  # fp32 [B]; 1 = off
    u: torch.Tensor,  # fp64 [B] in (0, 1): the row's random draw
    *,
    filtered: bool,
    any_greedy: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token int64 [B], log-prob fp32 [B]) per row, as `trace_common.model.sample_next`
    defines them: logits / temperature, then top-k (ties with the k-th kept), then top-p (the
    token that crosses p kept), sampled by inverse CDF with `u`; the log-prob is under that
    truncated distribution. Greedy rows take the argmax and its untempered log-prob.
    `filtered`: some row has top-k or top-p (sorts the vocabulary; skipped when False);
    `any_greedy`: some row is greedy (None: read it from `temperature`, a device sync)."""
    x = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    x = x / t[:, None]
    v = x.shape[-1]
    if filtered:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
        kth = sorted_x.gather(1, (k - 1)[:, None])  # [B, 1]
        keep = sorted_x >= kth  # ties with the k-th stay, as sample_next
        sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
        p = torch.softmax(sorted_x, dim=-1)
        drop = (p.cumsum(-1) - p) >= top_p[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        logp_sorted = torch.log_softmax(sorted_x, dim=-1)
        cdf = logp_sorted.exp().cumsum(-1)
        target = (u[:, None] * cdf[:, -1:].double()).float()
        idx = torch.searchsorted(cdf, target).clamp(max=v - 1)  # [B, 1]
        tok = order.gather(1, idx)[:, 0]
        logp = logp_sorted.gather(1, idx)[:, 0]
    else:
        logp_all = torch.log_softmax(x, dim=-1)
        cdf = logp_all.exp().cumsum(-1)
        target = (u[:, None] * cdf[:, -1:].double()).float()
        tok = torch.searchsorted(cdf, target).clamp(max=v - 1)[:, 0]
        logp = logp_all.gather(1, tok[:, None])[:, 0]
    if bool(greedy.any()) if any_greedy is None else any_greedy:
        lsm = torch.log_softmax(logits.float(), dim=-1)
        g_tok = lsm.argmax(dim=-1)
        tok = torch.where(greedy, g_tok, tok)
        logp = torch.where(greedy, lsm.gather(1, g_tok[:, None])[:, 0], logp)
    return tok, logp


class StepBackend(Protocol):
    """A fixed-size decode step over `batch` slots of `capacity` positions each, with a
    record history per slot (one row per position)."""

    batch: int
    capacity: int
    vocab: int
    prefill_tokens: int  # most prompt tokens per `prefill` call; 0: no batched prefill

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Feed tokens (int64 [B], host) at positions (int32 [B], host): K/V and the step's
        records written at that position of each slot, attention over positions 0..pos;
        return the logits [B, V] (valid until the next call)."""
        ...

    def prefill(self, slots: Sequence[int], starts: Sequence[int],
                chunks: Sequence[Sequence[int]]) -> torch.Tensor:  # fmt: skip
        """Write prompt chunk i (tokens at positions starts[i]..) into slot slots[i] (K/V and
        record rows, attention over the slot's positions 0..); return the logits after each
        chunk's last token [n, V]."""
        ...

    def copy_prefix(self, src: int, dsts: Sequence[int], n: int) -> None:
        """Copy positions 0..n-1 of slot `src` (K/V and record rows) into each slot of `dsts`
        (batched-prefill backends)."""
        ...

    def records(self, slot: int, rows: int, tokens: Sequence[int], prompt_len: int) -> bytes:
        """The serialized records of the sequence in `slot`: history rows 0..rows-1 (one per
        token fed), with its `tokens` (prompt + completion)."""
        ...

    def sync(self) -> None:
        """Wait until the last step has read its inputs (the host reuses their buffers)."""
        ...


@dataclass(slots=True, eq=False)
class _Request:
    prompts: list[tuple[int, ...]]
    group_size: int
    sampling: SamplingConfig
    with_records: bool
    stops: frozenset[int]
    results: list[GeneratedSample | None]
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    version: int = -1
    error: BaseException | None = None
    cancelled: Callable[[], bool] | None = None


@dataclass(slots=True, eq=False)
class _Prompt:
    """The completions of one prompt of a request, which share its prefill."""

    unstarted: int  # members that have not got past the prompt yet
    prefiller: _Seq | None = None  # the member prefilling the prompt now
    logits: torch.Tensor | None = None  # [V] after the prompt's last token, while needed


@dataclass(slots=True, eq=False)
class _Seq:
    request: _Request
    index: int  # prompt-major flat index within the request
    group: _Prompt
    tokens: list[int]  # prompt, then the sampled tokens
    prompt_len: int
    seed: int
    logprobs: list[float] = field(default_factory=list)
    fed: int = 0  # tokens written into the slot so far (= the next position)


class SlotScheduler:
    """Runs generate requests on a `StepBackend` with continuous batching (one thread)."""

    def __init__(self, backend: StepBackend, *, eos_id: int, pad_id: int,
                 device: torch.device | str, version: int = -1) -> None:  # fmt: skip
        self.backend = backend
        self.eos_id, self.pad_id = eos_id, pad_id
        self.device = torch.device(device)
        self.version = version
        b = backend.batch
        self._cond = threading.Condition()
        self._pending: collections.deque[_Request] = collections.deque()  # before the door
        self._admitted: list[_Request] = []
        self._waiting: collections.deque[_Seq] = collections.deque()  # admitted, no slot yet
        self._slots: list[_Seq | None] = [None] * b
        self._door_open = True
        self._stop = False
        self._broken: BaseException | None = None
        pin = self.device.type == "cuda"
        self._tokens = torch.zeros(b, dtype=torch.long, pin_memory=pin)
        self._pos = torch.zeros(b, dtype=torch.int32, pin_memory=pin)
        self._u = torch.full((b,), 0.5, dtype=torch.float64, pin_memory=pin)
        self._temperature = torch.ones(b, dtype=torch.float32)
        self._top_k = torch.zeros(b, dtype=torch.long)
        self._top_p = torch.ones(b, dtype=torch.float32)
        # numpy views of the host buffers: element writes without torch's per-call overhead
        self._tokens_np, self._pos_np, self._u_np = (
            self._tokens.numpy(), self._pos.numpy(), self._u.numpy())  # fmt: skip
        self._temp_np, self._top_k_np, self._top_p_np = (
            self._temperature.numpy(), self._top_k.numpy(), self._top_p.numpy())  # fmt: skip
        self._params_dirty = True
        self._params_dev: tuple[torch.Tensor, ...] = ()
        # rows without top-k/top-p sample in one Triton kernel on CUDA (`kernels.sample`)
        self._gpu_sampling = self.device.type == "cuda" and triton_available()
        self.steps_total = 0  # decode steps
        self.tokens_total = 0  # tokens sampled
        self.prefill_chunks_total = 0
        self.prefill_tokens_total = 0
        self.shared_prompt_tokens_total = 0  # prompt tokens copied from a group member's slot
        self.decode_seconds = 0.0  # host time in decode steps (sampling included)
        self.prefill_seconds = 0.0  # host time in prefill chunks (first-token sampling included)
        self._thread = threading.Thread(target=self._run, name="slot-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        *,
        with_records: bool,
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[list[GeneratedSample], int]:
        """Run one request to the end; (samples prompt-major, the version they came from)."""
        cap = self.backend.capacity
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + sampling.max_new_tokens - 1 > cap:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens="
                    f"{sampling.max_new_tokens} it needs {len(p) + sampling.max_new_tokens - 1} "
                    f"positions, the engine holds {cap} per sequence (max_context)"
                )
            bad = [t for t in p if not 0 <= t < self.backend.vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside "
                                 f"[0, {self.backend.vocab})")  # fmt: skip
        n = len(prompts) * group_size
        req = _Request(
            prompts=[tuple(int(t) for t in p) for p in prompts], group_size=group_size,
            sampling=sampling, with_records=with_records,
            stops=frozenset((self.eos_id, *sampling.stop_token_ids)), results=[None] * n,
            remaining=n, cancelled=cancelled,
        )  # fmt: skip
        with self._cond:
            if self._broken is not None:
                raise RuntimeError(f"the rollout engine failed earlier: {self._broken!r}")
            self._pending.append(req)
            self._cond.notify_all()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return [s for s in req.results if s is not None], req.version

    def swap(self, load: Callable[[], None], version: int) -> None:
        """Close the door, wait for every admitted request to finish, run `load` (new
        weights into the backend), then open the door at `version`."""
        with self._cond:
            self._door_open = False
            self._cond.notify_all()
            while self._admitted and self._broken is None:
                self._cond.wait(0.1)
            try:
                if self._broken is not None:
                    raise RuntimeError(f"the rollout engine failed earlier: {self._broken!r}")
                load()
                self.version = version
            finally:
                self._door_open = True
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    @property
    def active_slots(self) -> int:
        return sum(s is not None for s in self._slots)

    def stats(self) -> dict[str, float]:
        """Counters for /status and benchmarks."""
        return {
            "slots": len(self._slots),
            "active_slots": self.active_slots,
            "waiting_sequences": len(self._waiting),
            "decode_steps_total": self.steps_total,
            "sampled_tokens_total": self.tokens_total,
            "prefill_chunks_total": self.prefill_chunks_total,
            "prefill_tokens_total": self.prefill_tokens_total,
            "shared_prompt_tokens_total": self.shared_prompt_tokens_total,
            "decode_seconds_total": self.decode_seconds,
            "prefill_seconds_total": self.prefill_seconds,
        }

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        if self.device.index is not None:  # the current device is per thread; Triton uses it
            torch.cuda.set_device(self.device)
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._admit():
                        self._cond.wait()
                    if self._stop:
                        return
                self._one_step()
        except BaseException as exc:  # the backend failed: fail every request, refuse more
            log.exception("rollout step failed")
            with self._cond:
                self._broken = exc
                for req in [*self._admitted, *self._pending]:
                    req.error = RuntimeError(f"rollout engine step failed: {exc!r}")
                    req.done.set()
                self._admitted.clear()
                self._pending.clear()
                self._cond.notify_all()

    def _admit(self) -> bool:
        """Move pending requests through the door and waiting sequences into free slots
        (holding the lock); True when some slot is busy."""
        while self._door_open and self._pending:
            req = self._pending.popleft()
            req.version = self.version
            self._admitted.append(req)
            for pi, p in enumerate(req.prompts):
                group = _Prompt(unstarted=req.group_size)
                for g in range(req.group_size):
                    idx = pi * req.group_size + g
                    self._waiting.append(_Seq(
                        request=req, index=idx, group=group, tokens=list(p), prompt_len=len(p),
                        seed=sequence_seed(req.sampling.seed, idx),
                    ))  # fmt: skip
        for slot, cur in enumerate(self._slots):
            if cur is None and self._waiting:
                seq = self._waiting.popleft()
                self._slots[slot] = seq
                sp = seq.request.sampling
                self._temp_np[slot] = sp.temperature
                self._top_k_np[slot] = sp.top_k
                self._top_p_np[slot] = sp.top_p
                self._params_dirty = True
        return any(s is not None for s in self._slots)

    def _one_step(self) -> None:
        """One round: a prefill chunk (batched-prefill backends), then a decode step."""
        be = self.backend
        if be.prefill_tokens:
            t0 = time.perf_counter()
            self._take(self._prefill_chunk())
            self._take(self._share_prompts())
            self.prefill_seconds += time.perf_counter() - t0
        sampled: list[tuple[int, int, float]] = []  # (slot, token, log-prob)
        tokens, pos = self._tokens_np, self._pos_np
        need: list[int] = []  # slots whose logits this step samples
        for slot, seq in enumerate(self._slots):
            if seq is None:  # idle: writes position 0 of a free slot
                tokens[slot], pos[slot] = self.pad_id, 0
            elif be.prefill_tokens and seq.fed < seq.prompt_len:
                # prefilling: writes the position its next chunk overwrites first
                tokens[slot], pos[slot] = self.pad_id, seq.fed
            else:
                tokens[slot], pos[slot] = seq.tokens[seq.fed], seq.fed
                if seq.fed == len(seq.tokens) - 1:
                    need.append(slot)
        stepped = [s for s in range(len(self._slots)) if self._slots[s] is not None
                   and (not be.prefill_tokens or self._slots[s].fed >= self._slots[s].prompt_len)]  # type: ignore[union-attr]  # fmt: skip
        if stepped:
            t0 = time.perf_counter()
            self._set_uniforms(need)
            logits = be.step(self._tokens, self._pos)
            self.steps_total += 1
            for slot in stepped:
                self._slots[slot].fed += 1  # type: ignore[union-attr]
            if need:
                tok, logp = self._sample(logits, need)
                sampled += [(slot, int(tok[j]), float(logp[j])) for j, slot in enumerate(need)]
            else:
                be.sync()
            self.decode_seconds += time.perf_counter() - t0
        self._take(sampled)
        self._drop_cancelled()

    def _prefill_chunk(self) -> list[tuple[int, int, float]]:
        """Prefill up to `prefill_tokens` prompt tokens of the slots still in their prompt;
        sample the first token of each sequence whose prompt this completes."""
        budget = self.backend.prefill_tokens
        slots, starts, chunks = [], [], []
        for slot, seq in enumerate(self._slots):
            if budget == 0:
                break
            if seq is None or seq.fed >= seq.prompt_len:
                continue
            group = seq.group
            if group.prefiller is None and not (group.logits is not None
                                                and self._prompt_source(seq) is not None):  # fmt: skip
                group.prefiller = seq  # no member has the prompt: this one prefills it
            if group.prefiller is not seq:
                continue  # a member prefills it (or has it): this one copies it when done
            n = min(budget, seq.prompt_len - seq.fed)
            slots.append(slot)
            starts.append(seq.fed)
            chunks.append(seq.tokens[seq.fed : seq.fed + n])
            budget -= n
        if not slots:
            return []
        logits = self.backend.prefill(slots, starts, chunks)
        self.prefill_chunks_total += 1
        self.prefill_tokens_total += sum(map(len, chunks))
        done: list[int] = []
        rows: list[int] = []
        for i, slot in enumerate(slots):
            seq = self._slots[slot]
            assert seq is not None
            seq.fed += len(chunks[i])
            if seq.fed == seq.prompt_len:
                done.append(slot)
                rows.append(i)
                group = seq.group
                group.prefiller = None
                group.unstarted -= 1
                if group.unstarted:  # members still to start copy it and sample from these
                    group.logits = logits[i].clone()
        if not done:
            return []
        self._set_uniforms(done)
        idx = torch.tensor(rows, device=logits.device)
        tok, logp = self._sample(logits.index_select(0, idx), done, rows_are_slots=False)
        return [(slot, int(tok[j]), float(logp[j])) for j, slot in enumerate(done)]

    def _prompt_source(self, seq: _Seq) -> int | None:
        """A slot holding `seq`'s prompt in full: another member of its group past the
        prompt (its later positions do not touch the prompt's), or None."""
        for slot, other in enumerate(self._slots):
            if (other is not None and other is not seq and other.group is seq.group
                    and other.fed >= other.prompt_len):  # fmt: skip
                return slot
        return None

    def _share_prompts(self) -> list[tuple[int, int, float]]:
        """Members waiting for a prompt another member has prefilled: copy it into their
        slots and sample their first tokens from its logits."""
        copies: dict[int, list[int]] = {}  # source slot -> slots that copy from it
        for slot, seq in enumerate(self._slots):
            if (seq is None or seq.fed or seq.group.logits is None
                    or seq.group.prefiller is seq):  # fmt: skip
                continue
            src = self._prompt_source(seq)
            if src is not None:
                copies.setdefault(src, []).append(slot)
        if not copies:
            return []
        done: list[int] = []
        rows: list[torch.Tensor] = []
        for src, dsts in copies.items():
            n = self._slots[src].prompt_len  # type: ignore[union-attr]
            self.backend.copy_prefix(src, dsts, n)
            for slot in dsts:
                seq = self._slots[slot]
                assert seq is not None and seq.group.logits is not None
                seq.fed = n
                self.shared_prompt_tokens_total += n
                done.append(slot)
                rows.append(seq.group.logits)
                seq.group.unstarted -= 1
        for slot in done:  # the logits are kept while some member has still to start
            group = self._slots[slot].group  # type: ignore[union-attr]
            if not group.unstarted:
                group.logits = None
        self._set_uniforms(done)
        tok, logp = self._sample(torch.stack(rows), done, rows_are_slots=False)
        return [(slot, int(tok[j]), float(logp[j])) for j, slot in enumerate(done)]

    def _set_uniforms(self, slots: list[int]) -> None:
        if not slots:
            return
        seqs = [self._slots[s] for s in slots]
        seeds = np.array([q.seed for q in seqs], dtype=np.uint64)  # type: ignore[union-attr]
        counters = np.array([len(q.tokens) - q.prompt_len for q in seqs], dtype=np.uint64)  # type: ignore[union-attr]
        self._u_np[slots] = uniforms(seeds, counters)

    def _take(self, sampled: list[tuple[int, int, float]]) -> None:
        """Append sampled tokens; finish the sequences that stop or reach their length."""
        for slot, t, lp in sampled:
            seq = self._slots[slot]
            assert seq is not None
            seq.tokens.append(t)
            seq.logprobs.append(lp)
            self.tokens_total += 1
            if t in seq.request.stops:
                self._finish(slot, FINISH_STOP)
            elif len(seq.tokens) - seq.prompt_len >= seq.request.sampling.max_new_tokens:
                self._finish(slot, FINISH_LENGTH)

    def _sample(self, logits: torch.Tensor, slots: list[int], *,
                rows_are_slots: bool = True) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """Sample for `slots` from `logits` (rows indexed by slot, or one row per slot in
        order when not `rows_are_slots`); one device-to-host copy."""
        dev = logits.device
        if self._params_dirty:
            self._params_dev = (self._temperature.to(dev), self._top_k.to(dev),
                                self._top_p.to(dev))  # fmt: skip
            self._params_dirty = False
        temp, top_k, top_p = self._params_dev
        u = self._u.to(dev, non_blocking=True)
        filtered = bool((self._top_k_np[slots] > 0).any() or (self._top_p_np[slots] < 1).any())
        greedy = bool((self._temp_np[slots] <= 0).any())
        idx = torch.tensor(slots, device=dev)
        if not filtered and self._gpu_sampling:
            from trace_common.kernels.sample import sample_rows_unfiltered

            rows = idx if rows_are_slots else torch.arange(len(slots), device=dev)
            tok, logp = sample_rows_unfiltered(logits, rows, temp[idx], u[idx])
        else:
            sel = logits.index_select(0, idx) if rows_are_slots else logits
            tok, logp = sample_rows(sel, temp[idx], top_k[idx], top_p[idx], u[idx],
                                    filtered=filtered, any_greedy=greedy)  # fmt: skip
        both = torch.stack([tok.double(), logp.double()]).cpu().numpy()
        return both[0].astype(np.int64), both[1]

    def _finish(self, slot: int, reason: FinishReason) -> None:
        seq = self._slots[slot]
        assert seq is not None
        self._slots[slot] = None
        req = seq.request
        records = None
        if req.with_records:
            records = self.backend.records(slot, seq.fed, seq.tokens, seq.prompt_len)
        req.results[seq.index] = GeneratedSample(
            prompt_index=seq.index // req.group_size, group_index=seq.index % req.group_size,
            completion_tokens=seq.tokens[seq.prompt_len:], logprobs=seq.logprobs,
            finish_reason=reason, records=records, policy_version=req.version,
        )  # fmt: skip
        req.remaining -= 1
        if req.remaining == 0:
            self._complete(req)

    def _complete(self, req: _Request, error: BaseException | None = None) -> None:
        with self._cond:
            req.error = error
            if req in self._admitted:
                self._admitted.remove(req)
            req.done.set()
            self._cond.notify_all()

    def _drop_cancelled(self) -> None:
        """Free the slots and queue places of requests whose caller has gone."""
        gone = [r for r in self._admitted if r.cancelled is not None and r.cancelled()]
        for req in gone:
            for slot, seq in enumerate(self._slots):
                if seq is not None and seq.request is req:
                    self._slots[slot] = None
            with self._cond:
                self._waiting = collections.deque(s for s in self._waiting if s.request is not req)
            self._complete(req, CancelledError("the caller cancelled the request"))


class CancelledError(Exception):
    """The caller of a generate request went away before it finished."""


__all__ = [
    "CancelledError",
    "SlotScheduler",
    "StepBackend",
    "sample_rows",
    "sequence_seed",
    "splitmix64",
    "uniforms",
]
