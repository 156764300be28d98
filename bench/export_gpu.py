"""What the trainer's weight push costs before the bytes leave: quantizing the policy
(`quantize_policy`), laying it out (`export_quantized_state_dict`), bringing it to the host
and checksumming it for the wire, for a named shape on one device.

The experts are quantized a layer at a time (what quantize_policy does) and, for comparison
in the same run, one `_quantize_group` call per expert and group.

    python3 bench/export_gpu.py --shape mid-1b --device cuda --repeats 3

Prints the median seconds per phase and the exported bytes.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trace_common.clients.tensors import tensor_to_wire  # noqa: E402
from trace_common.device import resolve_device, to_host  # noqa: E402
from trace_common.fp4 import get_format  # noqa: E402
from trace_common.model import MoECausalLM, QuantConfig, get_config  # noqa: E402
from trace_common.model.quant import (  # noqa: E402
    _EXPERT_GROUPS,
    _quantize_group,
    export_quantized_state_dict,
    quantize_policy,
)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def quantize_per_expert(model: MoECausalLM, quant: QuantConfig) -> None:
    """The experts quantized one `_quantize_group` call per expert and group."""
    fmt = get_format(quant.format)
    for _, block in model.moe_blocks():
        ex = block.experts
        for e in range(ex.num_experts):
            for names in _EXPERT_GROUPS:
                _quantize_group(fmt, [getattr(ex, n)[e].detach() for n in names])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="mid-1b")
    p.add_argument("--vocab", type=int, default=64, help="the demo's character tokenizer: 64")
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    device = resolve_device(args.device)
    cfg = get_config(args.shape).replace(vocab_size=args.vocab)
    torch.manual_seed(0)
    model = MoECausalLM(cfg).init_weights(0).to(device)
    quant = QuantConfig()
    rows: list[tuple[str, float]] = []
    s, _ = timed(lambda: quantize_policy(model, quant), device, args.repeats)
    rows.append(("quantize_policy (experts batched per layer)", s))
    s, _ = timed(lambda: quantize_per_expert(model, quant), device, args.repeats)
    rows.append(("  experts one expert at a time (for comparison)", s))
    s, tensors = timed(lambda: export_quantized_state_dict(model)[0], device, args.repeats)
    rows.append(("export_quantized_state_dict", s))
    assert isinstance(tensors, dict)
    s, host = timed(lambda: {k: v.cpu() for k, v in tensors.items()}, device, args.repeats)
    rows.append((f"to host, one .cpu() per tensor ({len(tensors)} tensors)", s))
    s, _ = timed(lambda: to_host(tensors), device, args.repeats)
    rows.append(("to host, one pinned buffer (to_host, what the export uses)", s))
    assert isinstance(host, dict)
    s, _ = timed(lambda: [tensor_to_wire(k, v) for k, v in host.items()], device, args.repeats)
    rows.append(("wire views + CRC-32", s))
    nbytes = sum(v.numel() * v.element_size() for v in host.values())
    print(f"{args.shape} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}),"
          f" median of {args.repeats}; exported {nbytes / 2**20:.0f} MiB")  # fmt: skip
    print("| phase | seconds |\n|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec:.3f} |")


if __name__ == "__main__":
    main()
