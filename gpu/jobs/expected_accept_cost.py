"""GPU job: what the online budget's per-step prediction costs on the device, and whether it
replays in a CUDA graph. Times ``reach_by_depth`` (expected accept for every budget at once)
plus the ``[n_widths, depth]`` slice the chooser reads, eagerly and as a graph replay, at the
batch sizes and tree shapes the server would run; checks the device result against the CPU.

    bash gpu/device.sh python gpu/jobs/expected_accept_cost.py

Writes $OUT/expected_accept_cost.json and prints one line per shape.
"""

import json
import os
from pathlib import Path

import torch

from sglang_ddtree.budget import candidate_widths
from sglang_ddtree.tree.expected_accept import reach_at_widths, reach_by_depth

SHAPES = [(7, 32, 31), (15, 64, 63), (15, 16, 63)]  # (depth, k, largest budget)
BATCH_SIZES = (1, 4, 8, 16, 32, 64)


def step(log_probs, budget, widths):
    return reach_at_widths(reach_by_depth(log_probs, budget), widths)


def time_ms(fn, repeats=50):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def measure(bs, depth, k, budget):
    widths = list(candidate_widths(budget))
    generator = torch.Generator().manual_seed(bs * 1000 + depth)
    logits = torch.randn((bs, depth, 4096), generator=generator)
    log_probs = torch.log_softmax(logits, -1).sort(-1, descending=True).values[..., :k]
    cpu = step(log_probs, budget, widths)
    device_input = log_probs.cuda()
    eager_ms = time_ms(lambda: step(device_input, budget, widths))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step(device_input, budget, widths)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            captured = step(device_input, budget, widths)
    graph.replay()
    torch.cuda.synchronize()
    graph_ms = time_ms(graph.replay)
    error = float((captured.cpu() - cpu).abs().max())
    return {
        "bs": bs,
        "depth": depth,
        "k": k,
        "budget": budget,
        "eager_ms": eager_ms,
        "graph_ms": graph_ms,
        "max_abs_error_vs_cpu": error,
    }


def main():
    rows = []
    for depth, k, budget in SHAPES:
        for bs in BATCH_SIZES:
            row = measure(bs, depth, k, budget)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "expected_accept_cost.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
