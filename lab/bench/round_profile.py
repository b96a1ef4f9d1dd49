"""Summarise a torch-profiler trace of decode steps into a per-round profile.

A trace of ``steps`` decode steps (SGLang's ``/start_profile`` with ``num_steps``) holds
the GPU kernels (``cat == "kernel"``), the CUDA runtime calls that launched them and any
host synchronisation. Per round (one decode step = one draft + verify round):

* wall time: the trace's span over the steps;
* GPU time by kind of kernel (:data:`CATEGORIES`, first match wins), and GPU busy time
  (union of kernel intervals): wall minus busy is where the GPU waited on the host;
* kernel launches, CUDA-graph launches and host synchronisations (stream / device /
  event syncs, device-to-host copies) per round;
* for DDTREE servers run with ``SGLANG_DDTREE_PHASE_TIMES``, the host and GPU time of each
  phase of the round (the worker's ``ddtree.<phase>`` ranges and their GPU projections);
* for traces recorded with Python stacks, the host time per round by area (our plugin,
  SGLang's speculative code, its scheduler, its model executor, torch dispatch, the CUDA
  runtime) and the Python functions with the most own time (:func:`host_time_by_area`).
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict

# (category, kernel-name pattern), checked in order. Collectives come first: their names
# hold "reduce", "gather" and "kernel" words that the later patterns would claim. NCCL's are
# ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` and the like; SGLang's custom all-reduce is
# ``cross_device_reduce_1stage`` / ``_2stage``. A collective's kernel time includes waiting
# for the slowest rank to arrive.
ALL_REDUCE = "all-reduce"
CATEGORIES = [
    (ALL_REDUCE, re.compile(r"AllReduce|all_?reduce|cross_device_reduce|ReduceScatter", re.I)),
    ("other collectives", re.compile(r"^nccl|AllGather|Broadcast|all_gather|SendRecv", re.I)),
    ("draft top-k", re.compile(r"ddtree_topk")),
    ("tree build + mask", re.compile(r"ddtree_(build|tree|flat_mask)")),
    ("accept", re.compile(r"ddtree_accept")),
    ("tree other", re.compile(r"ddtree_")),
    # SGLang's Marlin MoE GEMM (``Marlin<...>``) and the expert routing around it
    ("MoE experts + routing", re.compile(r"marlin|moe|expert|route|fused_gate", re.I)),
    ("attention", re.compile(r"_fwd_kernel|attention|attn|flash", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90", re.I)),
    ("sampling / argmax / softmax", re.compile(r"argmax|softmax|sort|topk|top_k|reduce|sampl|max_", re.I)),
    ("kv / index copies", re.compile(r"copy|kv|cache|index|gather|scatter|memcpy", re.I)),
]
OTHER = "elementwise / norm / other"
LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx)")
GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)")
SYNC = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cuStreamSynchronize)")


def categorise(kernel_name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return category
    return OTHER


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace.get("traceEvents", trace) if isinstance(trace, dict) else trace


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def _phase_us(events: list[dict], category: str, steps: int) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == category and e.get("name", "").startswith("ddtree."):
            totals[e["name"][len("ddtree.") :]] += e.get("dur", 0)
    return {k: v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def summarise_events(events: list[dict], steps: int) -> dict:
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    copies = [e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"]
    if not kernels:  # a CPU server's trace: its host time is all there is
        return {"error": "no GPU kernels in the trace", **host_time_by_area(events, steps)}
    timed = kernels + runtime
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed)
    by_category: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_category[categorise(e.get("name", ""))] += e.get("dur", 0)
    busy = _busy_us([(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels])
    names = [e.get("name", "") for e in runtime]
    per_round = 1.0 / steps
    return {
        "steps": steps,
        "round_us": span * per_round,
        "gpu_busy_us": busy * per_round,
        "gpu_idle_us": (span - busy) * per_round,
        "gpu_us_by_category": {
            k: v * per_round for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])
        },
        "kernels_per_round": len(kernels) * per_round,
        "kernel_launches_per_round": sum(bool(LAUNCH.match(n)) for n in names) * per_round,
        "graph_launches_per_round": sum(bool(GRAPH_LAUNCH.match(n)) for n in names) * per_round,
        "host_syncs_per_round": sum(bool(SYNC.match(n)) for n in names) * per_round,
        "device_to_host_copies_per_round": sum("DtoH" in e.get("name", "") for e in copies) * per_round,
        "phase_host_us": _phase_us(events, "user_annotation", steps),
        "phase_gpu_us": _phase_us(events, "gpu_user_annotation", steps),
        "sync_sites": sync_sites(events, steps),
        **host_time_by_area(events, steps),
    }


# Where a round's host time goes, from a trace recorded with Python stacks: each event's own
# time (its duration minus its children's) goes to an area, first match of its name wins.
HOST_AREAS = [
    ("sglang_ddtree", re.compile(r"sglang_ddtree/")),
    ("sglang speculative", re.compile(r"sglang/srt/speculative/")),
    ("sglang scheduler", re.compile(r"sglang/srt/managers/")),
    ("sglang model executor", re.compile(r"sglang/srt/model_executor/")),
    ("sglang layers + models", re.compile(r"sglang/srt/(layers|models)/")),
    ("sglang other", re.compile(r"sglang/")),
    ("torch (Python)", re.compile(r"torch/")),
    ("Python builtins", re.compile(r"^<built-in")),
]
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # "<built-in method to of Tensor object at 0x7f..>"
HOST_EVENT_CATEGORIES = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")


def host_area(event: dict) -> str:
    category = event.get("cat")
    if category == "cpu_op":
        return "torch ops (dispatch)"
    if category in ("cuda_runtime", "cuda_driver"):
        return "CUDA runtime"
    name = event.get("name", "")
    for area, pattern in HOST_AREAS:
        if pattern.search(name):
            return area
    return "Python other"


def _own_times(events: list[dict]) -> list[tuple[dict, float]]:
    """(event, own time) of properly nested events of one thread: the duration minus the
    durations of the events directly inside it."""
    ordered = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
    own = {id(e): float(e.get("dur", 0)) for e in ordered}
    stack: list[dict] = []
    for e in ordered:
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1].get("dur", 0):
            stack.pop()
        if stack:
            own[id(stack[-1])] -= e.get("dur", 0)
        stack.append(e)
    return [(e, max(own[id(e)], 0.0)) for e in ordered]


def host_time_by_area(events: list[dict], steps: int, top: int = 15) -> dict:
    """Own host time per round by area and by Python function, on the thread with the most
    Python time (the scheduler's, which runs the round); empty without Python stacks."""
    by_thread: dict = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_EVENT_CATEGORIES:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    python_us = {
        key: sum(e.get("dur", 0) for e in evs if e.get("cat") == "python_function")
        for key, evs in by_thread.items()
    }
    if not python_us or max(python_us.values()) == 0:
        return {}
    thread = max(python_us, key=python_us.get)
    areas: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    for e, own in _own_times(by_thread[thread]):
        areas[host_area(e)] += own
        if e.get("cat") == "python_function":
            functions[_ADDRESS.sub("", e.get("name", ""))] += own
    per_round = 1.0 / steps
    ranked = sorted(functions.items(), key=lambda kv: -kv[1])[:top]
    return {
        "host_us_by_area": {k: v * per_round for k, v in sorted(areas.items(), key=lambda kv: -kv[1])},
        "host_us_top_functions": [[name, us * per_round] for name, us in ranked],
    }


# A Python frame that names where a synchronisation comes from: SGLang's or this plugin's code
# (torch's Python and builtins sit below them and say nothing about which step waited).
_SITE = re.compile(r"(sglang_ddtree|sglang)/")
MEMCPY = re.compile(r"^(cudaMemcpy|cuMemcpy)")


def _device_to_host_correlations(events: list[dict]) -> set:
    return {
        e.get("args", {}).get("correlation")
        for e in events
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")
    }


def sync_sites(events: list[dict], steps: int, top: int = 12) -> list[list]:
    """Where the host waits for the device, per round: every stream / device / event
    synchronisation and device-to-host copy of the trace, attributed to the innermost
    enclosing Python frame of SGLang or this plugin on its thread (traces with Python stacks;
    empty without). ``[[site, kind, per round], ...]``, most frequent first."""
    dtoh = _device_to_host_correlations(events)
    frames: dict = defaultdict(list)
    waits = []
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e.get("pid"), e.get("tid"))
        if e.get("cat") == "python_function" and _SITE.search(e.get("name", "")):
            frames[key].append(e)
        elif e.get("cat") in ("cuda_runtime", "cuda_driver"):
            name = e.get("name", "")
            if SYNC.match(name):
                waits.append((key, e, "sync"))
            elif MEMCPY.match(name) and e.get("args", {}).get("correlation") in dtoh:
                waits.append((key, e, "device-to-host copy"))
    if not frames:
        return []
    counts: dict = defaultdict(int)
    for key, e, kind in waits:
        inside = [f for f in frames[key] if f["ts"] <= e["ts"] and e["ts"] <= f["ts"] + f.get("dur", 0)]
        site = max(inside, key=lambda f: f["ts"]).get("name", "?") if inside else "(no Python frame)"
        counts[_ADDRESS.sub("", site), kind] += 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [[site, kind, n / steps] for (site, kind), n in ranked]


# SGLang 0.5.23 names every model forward in a trace (``ModelRunner.forward``'s step span):
# ``step[EXTEND bs=1 toks=96]`` for a prefill, ``step[DRAFT bs=1]`` for a drafter forward,
# ``step[VERIFY bs=1]`` for a target verify.
STEP_SPAN = re.compile(r"^step\[")


def request_timeline(events: list[dict], min_wait_ms: float = 0.2) -> list[dict]:
    """The way of one request from idle to its first decode rounds, in host order: every
    model forward (its host span, its GPU span where the trace has one, and the kernel and
    graph launches its host span made) and every host wait for the device of at least
    ``min_wait_ms``. Times in ms from the first forward's host start. A forward that launches
    hundreds of kernels instead of one graph ran eagerly; a long wait or a gap between spans
    is host time the request's first token waits for."""
    spans = sorted((e for e in events if _is_step(e, "user_annotation")), key=lambda e: e["ts"])
    if not spans:
        return []
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    kernels = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"]
    )
    starts = [k["ts"] for k in kernels]
    gpu_of = _gpu_spans_of(spans, kernels, starts, runtime, events)
    t0, ms = spans[0]["ts"], 1e-3
    rows = []
    for span in spans:
        end = span["ts"] + span.get("dur", 0)
        inside = [
            e["name"] for e in runtime if e.get("tid") == span.get("tid") and span["ts"] <= e["ts"] <= end
        ]
        row = {
            "at_ms": (span["ts"] - t0) * ms,
            "what": span["name"],
            "host_ms": span.get("dur", 0) * ms,
            "launches": sum(bool(LAUNCH.match(n)) for n in inside),
            "graph_launches": sum(bool(GRAPH_LAUNCH.match(n)) for n in inside),
        }
        gpu = gpu_of.get(id(span))
        if gpu is not None:
            row.update(gpu_at_ms=(gpu["ts"] - t0) * ms, gpu_ms=gpu.get("dur", 0) * ms)
            row["top_kernels"] = _top_kernels(kernels, starts, gpu)
        rows.append(row)
    dtoh = _device_to_host_correlations(events)
    for e in runtime:
        name = e.get("name", "")
        is_wait = SYNC.match(name) or (MEMCPY.match(name) and e.get("args", {}).get("correlation") in dtoh)
        if is_wait and e.get("dur", 0) * ms >= min_wait_ms and e["ts"] >= t0:
            rows.append(
                {"at_ms": (e["ts"] - t0) * ms, "what": f"wait: {name}", "host_ms": e.get("dur", 0) * ms}
            )
    return sorted(rows, key=lambda r: r["at_ms"])


def _is_step(event: dict, category: str) -> bool:
    return (
        event.get("ph") == "X"
        and event.get("cat") == category
        and bool(STEP_SPAN.match(event.get("name", "")))
    )


# Kernels named per forward of a request-start timeline: the ones with the most GPU time.
TOP_KERNELS = 3


def _top_kernels(kernels: list[dict], starts: list[float], gpu: dict) -> list[list]:
    """``[[kernel name, ms], ...]``: the kernels (sorted by start, ``starts`` their start
    times) with the most GPU time inside a GPU span."""
    end = gpu["ts"] + gpu.get("dur", 0)
    totals: dict[str, float] = defaultdict(float)
    for k in kernels[bisect.bisect_left(starts, gpu["ts"]) :]:
        if k["ts"] > end:
            break
        totals[k.get("name", "?")] += k.get("dur", 0) * 1e-3
    return [[name, t] for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]]


def _gpu_spans_of(
    spans: list[dict], kernels: list[dict], starts: list[float], runtime: list[dict], events: list[dict]
) -> dict[int, dict]:
    """``{id(host span): its GPU span}``: a GPU span belongs to the host span that launched
    its first kernel (the kernel's correlation id names the launch; a graph's kernels carry
    their graph launch's). Time alone cannot tell: the device may run a forward long after
    the host moved on to the next one."""
    launches = {e.get("args", {}).get("correlation"): e for e in runtime}
    owner = {}
    for gpu in (e for e in events if _is_step(e, "gpu_user_annotation")):
        first = bisect.bisect_left(starts, gpu["ts"])
        if first == len(kernels) or kernels[first]["ts"] > gpu["ts"] + gpu.get("dur", 0):
            continue
        launch = launches.get(kernels[first].get("args", {}).get("correlation"))
        if launch is None:
            continue
        for span in spans:
            same_thread = span.get("tid") == launch.get("tid") and span["name"] == gpu["name"]
            if same_thread and span["ts"] <= launch["ts"] <= span["ts"] + span.get("dur", 0):
                owner[id(span)] = gpu
                break
    return owner


def summarise_trace(path: str, steps: int) -> dict:
    return {"trace": path.rsplit("/", 1)[-1], **summarise_events(load_trace(path), steps)}
