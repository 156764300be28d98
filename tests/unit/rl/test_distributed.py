"""The sharded learner (FSDP2 over gloo, on the CPU) against one process: 2 ranks train like
one (loss and weights within float tolerance), the streamed FP4 export equals the
single-process export bit for bit, and a sharded checkpoint resumes at 1 and at 2 ranks.

One module fixture runs three small jobs (a fresh interpreter per rank, 1 thread each):
  A  2 ranks: export at init, train steps 1-2 (each followed by an export, as the trainer
     publishes every step), sharded checkpoint (ckpt-2r)
  B  1 rank: resume ckpt-2r, train step 3, sharded checkpoint (ckpt-1r)
  C  2 ranks: resume ckpt-1r, train step 4
and the reference trains the same samples in one process (ModelLearner) for steps 1-4.
A resume quantizes the resumed weights, i.e. the version the last export published.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

from trace_common.model import GuidanceConfig, MoECausalLM, QuantConfig, get_config
from trace_common.model.model import FP4Weights
from trace_common.rl.distributed import (
    LeaderLearner,
    ShardedLearner,
    follow,
    load_sharded_checkpoint,
    rank_chunks,
    save_sharded_checkpoint,
)
from trace_common.rl.policy import LearnerConfig, ModelLearner
from trace_common.rl.testing import engine_train_samples
from trace_common.rl.types import TrainSample
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.types import SamplingConfig
from trace_common.tasks import CharTokenizer

# Three spawned jobs of 1-2 ranks (about 20 s on 2 cores); a hung collective fails, not hangs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOK = CharTokenizer()
GUIDANCE = GuidanceConfig(layers=(0, 1, 2, 3), mode="full")
PROMPTS = [
    [TOK.bos_id, *TOK.encode("12+34=")],
    [TOK.bos_id, *TOK.encode("5+6=")],
    [TOK.bos_id, *TOK.encode("7+80=")],
]
LOSS_TOL = 1e-5  # float summation order differs across ranks (sums of per-rank parts)
# AdamW divides each gradient by its own running RMS, so an element whose gradient is near
# zero moves by up to lr per step whatever float noise it carries: after 4 steps at lr 1e-3
# (up to 4e-3 of movement) the sharded and single runs agree to 5e-5, about 1% of that.
WEIGHT_TOL = 5e-5


def _model() -> MoECausalLM:
    return MoECausalLM(get_config("debug").replace(vocab_size=TOK.vocab_size)).init_weights(0)


def _config() -> LearnerConfig:
    return LearnerConfig(mode="trace", lr=1e-3, minibatches=2)


def _learner_kw() -> dict[str, Any]:
    return dict(quant=QuantConfig(), guidance=GUIDANCE, eos_id=TOK.eos_id, pad_id=TOK.pad_id)


def _samples(lrn: ModelLearner) -> list[TrainSample]:
    """Three prompts x two completions (with records) from the learner's exported policy;
    uneven lengths, so the ranks' token shares differ."""
    engine = NativeEngine.from_weights(*lrn.export_weights())
    return engine_train_samples(engine, PROMPTS, 2, SamplingConfig(max_new_tokens=6, seed=5),
                                advantages=(1.0, -0.5, 0.25))  # fmt: skip


class _Store:
    """The records of the test's samples, minus `missing`; logs which ids were fetched."""

    def __init__(self, samples: list[TrainSample]) -> None:
        self.blobs = {ts.rollout.sample_id: ts.records for ts in samples}
        self.missing: set[str] = set()
        self.fetched: list[str] = []

    def fetch(
        self, run_id: str, policy_version: int, sample_ids: Any, *, generations: Any = None
    ) -> dict[str, bytes]:
        self.fetched += sample_ids
        return {i: self.blobs[i] for i in sample_ids if i not in self.missing}  # type: ignore[misc]


def _worker(rank: int, world: int, tmp: str, job: str) -> None:
    torch.set_num_threads(1)
    # Rendezvous through a file of the job's own: no port to pick before the ranks start, so
    # nothing else on the machine can take it in between (gloo's own sockets bind port 0).
    init = f"file://{pathlib.Path(tmp) / f'rendezvous-{job}'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        root = pathlib.Path(tmp)
        samples = torch.load(root / "samples.pt", weights_only=False)
        if job == "A":
            _job_a(rank, root, samples)
            return
        lrn = ShardedLearner(_model(), _config(), **_learner_kw())
        out: dict[str, Any] = {}
        ckpt = "ckpt-2r/step-000002" if job == "B" else "ckpt-1r/step-000003"
        out["state"] = load_sharded_checkpoint(root / ckpt, lrn)
        out["resumed"] = lrn.full_state_dict()
        out["losses"] = [lrn.train_step(samples)["loss"]]
        if job == "B":
            save_sharded_checkpoint(root / "ckpt-1r", lrn, step=3, version=3)
        out["weights"] = lrn.full_state_dict()
        if rank == 0:
            torch.save(out, root / f"out-{job}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _job_a(rank: int, root: pathlib.Path, samples: list[TrainSample]) -> None:
    """Rank 0 drives a LeaderLearner as TrainerCore does, rank 1 follows; the samples come
    without records and each rank pulls its own from the store."""
    store = _Store(samples)
    lrn = ShardedLearner(_model(), _config(), **_learner_kw(), records=store)
    out: dict[str, Any] = {}
    if rank == 0:
        leader = LeaderLearner(lrn)
        bare = [
            TrainSample(rollout=ts.rollout, reward=0.0, advantage=ts.advantage) for ts in samples
        ]
        out["export0"] = leader.export_weights()
        out["losses"] = [leader.train_step(bare)["loss"]]
        leader.export_weights()  # each step publishes: the QAT forward reads that version
        out["losses"].append(leader.train_step(bare)["loss"])
        out["export2"] = leader.export_weights()
        lrn.export_hp_dtype = torch.bfloat16  # rank 0 alone holds the export
        out["export2_bf16"] = leader.export_weights()
        leader.save(root / "ckpt-2r", step=2, version=2)
        leader.stop()
    else:
        out["follower_steps"] = follow(lrn)
    out["weights"] = lrn.full_state_dict()
    out["fetched"] = list(store.fetched)
    # Between forwards no rank holds dequantized weights (FSDP2 would not shard them); the
    # FP4 codes stay.
    fp4 = [m for m in lrn.model.modules() if isinstance(m, FP4Weights)]
    out["dequant_held"] = sum(len(m.dequant) for m in fp4)
    out["codes_held"] = sum(len(m.quantized) for m in fp4)
    # A record missing on one rank (s5: prompt 2, trained by rank 1) drops its group on both.
    store.missing = {"s5"}
    if rank == 0:
        out["dropped_step"] = leader.train_step(bare)
        # Asked before a step (TrainerCore, to regenerate lost groups), the ranks pull their
        # slices and rank 0 learns which groups some rank lacks; the step reuses what they
        # pulled.
        store.fetched.clear()
        out["checked"] = leader.check_records(bare)
        out["fetched_by_check"] = list(store.fetched)
        out["after_check"] = leader.train_step(bare)
        out["fetched_by_step"] = list(store.fetched[len(out["fetched_by_check"]) :])
        leader.stop()
    else:
        follow(lrn)
    torch.save(out, root / f"out-A{rank}.pt")
    dist.barrier()


SPAWN_TIMEOUT_S = 200.0
ROOT = pathlib.Path(__file__).resolve().parents[3]


def _spawn(world: int, tmp: pathlib.Path, job: str) -> dict[str, Any]:
    """Run `job` as `world` fresh interpreters (one per rank): they import only this module
    and the project, not whatever the test session imported or set up before; a rank that
    fails is reported with its own output."""
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(pathlib.Path(__file__).parent)!r}]; "
        "import test_distributed as t; t._worker(int(sys.argv[1]), int(sys.argv[2]), "
        "sys.argv[3], sys.argv[4])"
    )
    logs = [tmp / f"rank-{job}{r}.log" for r in range(world)]
    procs = []
    for r, log in enumerate(logs):
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, str(r), str(world), str(tmp), job],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
    try:
        codes = [p.wait(timeout=SPAWN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (code_, log) in enumerate(zip(codes, logs, strict=True)):
        assert code_ == 0, f"job {job} rank {r} exited {code_}:\n{log.read_text()[-4000:]}"
    if job == "A":
        ranks = [torch.load(tmp / f"out-A{r}.pt", weights_only=False) for r in range(world)]
        return {**ranks[0], "ranks": ranks}
    return torch.load(tmp / f"out-{job}.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sharded")
    ref = ModelLearner(_model(), _config(), **_learner_kw())
    samples = _samples(ref)
    torch.save(samples, tmp / "samples.pt")
    export0 = ref.export_weights()
    losses, weights = [], []
    for _ in range(4):
        losses.append(ref.train_step(samples)["loss"])
        weights.append({k: v.clone() for k, v in ref.model.state_dict().items()})
        ref.export_weights()  # publish (re-quantize), as the trainer does after every step
    return {
        "ref": {"export0": export0, "losses": losses, "weights": weights},
        "A": _spawn(2, tmp, "A"),
        "B": _spawn(1, tmp, "B"),
        "C": _spawn(2, tmp, "C"),
    }


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        err = float((got[k] - want[k]).abs().max())
        assert err <= WEIGHT_TOL, f"{k}: max |sharded - single| = {err} > {WEIGHT_TOL}"


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        bits_got, bits_want = (
            got[k].reshape(-1).view(torch.uint8),
            want[k].reshape(-1).view(torch.uint8),
        )
        assert torch.equal(bits_got, bits_want), k


def test_rank_chunks_split_each_minibatch_like_one_process() -> None:
    assert rank_chunks(6, 2, 1) == [[[0, 1, 2], [3, 4, 5]]]
    assert rank_chunks(6, 2, 2) == [[[0, 1], [3, 4]], [[2], [5]]]
    with pytest.raises(ValueError, match="without a sample"):
        rank_chunks(3, 2, 2)


def test_two_ranks_train_like_one(runs: dict[str, Any]) -> None:
    ref, a = runs["ref"], runs["A"]
    for got, want in zip(a["losses"], ref["losses"][:2], strict=True):
        assert abs(got - want) <= LOSS_TOL, (got, want)
    assert ref["losses"][0] != ref["losses"][1]  # the steps changed the policy
    _assert_close(a["weights"], ref["weights"][1])
    moved = max(
        float((ref["weights"][1][k] - w).abs().max()) for k, w in _model().state_dict().items()
    )
    assert moved > 20 * WEIGHT_TOL, f"two steps moved the weights by only {moved}"


def test_dequantized_weights_live_only_during_a_forward(runs: dict[str, Any]) -> None:
    for rank in runs["A"]["ranks"]:
        assert rank["dequant_held"] == 0
        assert rank["codes_held"] > 0


def test_sharded_export_is_bit_exact(runs: dict[str, Any]) -> None:
    """At init (same weights) and after training: the sharded export of the trained weights
    equals one process's export of those same weights, bit for bit."""
    ref, a = runs["ref"], runs["A"]
    tensors, meta = a["export0"]
    _assert_bit_exact(tensors, ref["export0"][0])
    assert meta == ref["export0"][1]
    single = ModelLearner(_model(), _config(), **_learner_kw())
    single.model.load_state_dict(a["weights"])
    want, want_meta = single.export_weights()
    got, got_meta = a["export2"]
    _assert_bit_exact(got, want)
    assert got_meta == want_meta
    # the bf16 export of the high-precision weights, sharded as in one process
    single.export_hp_dtype = torch.bfloat16
    want_bf16, _ = single.export_weights()
    got_bf16, _ = a["export2_bf16"]
    _assert_bit_exact(got_bf16, want_bf16)
    assert {t.dtype for t in got_bf16.values()} >= {torch.bfloat16, torch.uint8}


def test_sharded_checkpoint_resumes_at_one_and_two_ranks(runs: dict[str, Any]) -> None:
    ref, a, b, c = runs["ref"], runs["A"], runs["B"], runs["C"]
    assert b["state"]["step"] == 2 and b["state"]["world_size"] == 2
    assert c["state"]["step"] == 3 and c["state"]["world_size"] == 1
    _assert_bit_exact(b["resumed"], a["weights"])  # 2 ranks -> 1 rank: exact weights
    _assert_bit_exact(c["resumed"], b["weights"])  # 1 rank -> 2 ranks
    # The optimizer state came back too: the resumed steps continue the reference run.
    assert abs(b["losses"][0] - ref["losses"][2]) <= LOSS_TOL
    assert abs(c["losses"][0] - ref["losses"][3]) <= LOSS_TOL
    _assert_close(b["weights"], ref["weights"][2])
    _assert_close(c["weights"], ref["weights"][3])


def test_each_rank_pulls_the_records_of_the_samples_it_trains(runs: dict[str, Any]) -> None:
    """rank_chunks(6, 2, 2): rank 0 trains s0 s1 | s3 s4, rank 1 trains s2 | s5; three train
    steps (the third with s5 missing)."""
    rank0, rank1 = runs["A"]["ranks"]
    assert rank1["follower_steps"] == 2
    assert set(rank0["fetched"]) == {"s0", "s1", "s3", "s4"}
    assert set(rank1["fetched"]) == {"s2", "s5"}
    assert len(rank0["fetched"]) == 2 * 4 and len(rank1["fetched"]) == 2 * 2  # no refetch
    assert rank0["dropped_step"]["samples_dropped_records"] == 2  # prompt 2's group
    assert rank0["dropped_step"]["train_tokens"] > 0  # the other groups still trained
    # check_records: rank 1 lacks s5 (prompt 2). Rank 0 pulled its slice at the check; the
    # step drops prompt 2's group (s4 s5) and splits s0-s3 again, rank 0 training s0 | s2:
    # it fetches only s2, which it had not pulled
    assert rank0["checked"] == {2}
    assert sorted(rank0["fetched_by_check"]) == ["s0", "s1", "s3", "s4"]
    assert rank0["fetched_by_step"] == ["s2"]
    assert rank0["after_check"]["samples_dropped_records"] == 2
