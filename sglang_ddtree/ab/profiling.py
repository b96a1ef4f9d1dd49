"""``--profile ARM@C``: one arm's rounds at one concurrency under SGLang's torch profiler, summarised
per round into the series.

After ``ARM``'s timed passes at level ``C`` (its first server), the engine sends ``C`` requests of
the run's prompts (``--output-len`` tokens each, streamed), and once every one of them has its
first token (all decoding together) asks the server to profile ``--profile-steps`` scheduler steps
(``/start_profile`` with ``num_steps``, CPU and GPU activities, no Python stacks, no shapes). When
the requests end it asks ``/stop_profile`` (harmless where the profiler already stopped itself),
waits for the trace file (rank 0's), and summarises it (:func:`summarise_events`). Where a
request ended before the profiler started or had its steps (its rounds show a smaller batch),
the requests go again with twice the tokens (three tries in all).

* the rounds profiled: SGLang names each forward in the trace (``step[VERIFY bs=8]`` a target
  verify, ``step[DECODE bs=8]`` a plain decode, ``step[DRAFT ...]`` a drafter forward,
  ``step[EXTEND ...]`` a prefill); a round starts with a verify or a decode, and the summary
  covers the whole rounds from the first one's start to the last one's (the prefills before
  them and the idle time after them left out);
* per round: wall time, GPU busy time (the union of kernel intervals) and idle time, GPU time
  by kind of kernel (:data:`CATEGORIES`, the tensor-parallel all-reduce among them), kernel and
  CUDA-graph launches, host synchronisations and device-to-host copies; the DDTREE worker's
  phases (``ddtree.<phase>`` ranges, host and GPU) where the server times them (``ARM+phases``);
* every forward's name with its count (the batch sizes the profile saw).

The trace stays in the run's raw folder (``profiles/``); the GPU jobs leave it out of the logs
they bring back.
"""

from __future__ import annotations

import glob
import gzip
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

from ..launch import http_text
from .arms import ABError

DEFAULT_STEPS = 20
EXPORT_SECONDS = 180.0  # a trace of a large model's rounds takes a while to write
ATTEMPTS = 3  # tries at getting every request decoding under the profiler at once

# (category, kernel-name pattern), checked in order. Collectives first: their names hold
# "reduce", "gather" and "kernel" words the later patterns would claim (NCCL's
# ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``, SGLang's custom ``cross_device_reduce_1stage``).
# A collective's kernel time includes its wait for the slowest rank.
ALL_REDUCE = "all-reduce"
CATEGORIES = [
    (ALL_REDUCE, re.compile(r"AllReduce|all_?reduce|cross_device_reduce|ReduceScatter", re.I)),
    ("other collectives", re.compile(r"^nccl|AllGather|Broadcast|all_gather|SendRecv", re.I)),
    ("draft top-k", re.compile(r"ddtree_topk")),
    ("tree build + mask", re.compile(r"ddtree_(build|tree|flat_mask)")),
    ("accept", re.compile(r"ddtree_accept")),
    ("tree other", re.compile(r"ddtree_")),
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
STEP = re.compile(r"^step\[")
ROUND = re.compile(r"^step\[(VERIFY|DECODE)\b")
ROUND_BS = re.compile(r"^step\[(?:VERIFY|DECODE) bs=(\d+)\]")  # a round's batch size


# --------------------------------------------------------------------------- the option


def parse_specs(items: list[str] | None, arms: list[str], levels: list[int]) -> list[tuple[str, int]]:
    """``--profile ARM@C`` (repeatable, or comma-separated) -> [(arm, concurrency)]; the arm's
    name may hold an ``@`` itself (``ddtree@32@8``: ``ddtree@32`` at concurrency 8)."""
    specs = []
    for item in items or []:
        for text in (t.strip() for t in item.split(",")):
            if not text:
                continue
            arm, at, level = text.rpartition("@")
            if not at or not arm or not level.isdigit():
                raise ABError(f"--profile {text!r}: expected ARM@CONCURRENCY, e.g. ddtree@32@8.")
            if arm not in arms:
                raise ABError(f"--profile {text!r}: {arm!r} is not an arm of the run ({', '.join(arms)}).")
            if int(level) not in levels:
                raise ABError(
                    f"--profile {text!r}: concurrency {level} is not a level of the run "
                    f"({', '.join(map(str, levels))})."
                )
            if (arm, int(level)) not in specs:
                specs.append((arm, int(level)))
    return specs


# --------------------------------------------------------------------------- the profile


def _stream(url: str, prompt, max_new_tokens: int, first: threading.Event, timeout: float) -> None:
    """One streamed greedy request; ``first`` is set with its first token."""
    key = "text" if isinstance(prompt, str) else "input_ids"
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    body = json.dumps({key: prompt, "sampling_params": params, "stream": True}).encode()
    request = urllib.request.Request(
        f"{url}/generate", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                first.set()


def profile_level(
    url: str,
    prompts: list,
    concurrency: int,
    out_dir: Path,
    *,
    steps: int = DEFAULT_STEPS,
    max_new_tokens: int = 256,
    export_seconds: float = EXPORT_SECONDS,
    timeout: float = 600.0,
) -> dict:
    """``concurrency`` requests decoding together under SGLang's profiler (module docstring):
    the trace's summary, or ``{"error": ...}`` (a profile that failed does not fail the run).

    A request that ends before the profiler starts, or before it has profiled its steps (a fast
    arm, a short ``--output-len``, a loaded host: the profiler's start can take longer than a
    short request's decode; its rounds then show a smaller batch), leaves nothing or little to profile
    together: the requests are sent again with twice the tokens (the next try's trace in a
    folder of its own), up to :data:`ATTEMPTS` times; a profile still cut short says so
    (``cut_short``)."""
    for attempt in range(1, ATTEMPTS + 1):
        tokens = max_new_tokens * 2 ** (attempt - 1)
        folder = out_dir if attempt == 1 else out_dir / f"try-{attempt}"
        folder.mkdir(parents=True, exist_ok=True)
        started, cut_short, errors = _requests_under_profiler(
            url, prompts, concurrency, folder, steps, tokens, timeout
        )
        if not started:
            if errors:
                break
            continue
        trace = finished_trace(folder, export_seconds)
        if trace is None:
            missing = {"error": f"no complete trace in {folder} after {export_seconds:.0f} s"}
            return {**missing, "request_errors": errors} if errors else missing
        summary = summarise_trace(trace, steps)
        # a request that ended while the profiler ran (its start can take longer than a short
        # request's decode) leaves rounds of a smaller batch: cut short too
        cut_short = cut_short or _batch_shrank(summary, concurrency)
        if errors or not cut_short:
            break
    if not started:
        ended = f"a request ended before the profiler started ({ATTEMPTS} tries, up to {tokens} tokens)"
        return {"error": "; ".join(errors) or ended}
    if attempt > 1:
        summary["max_new_tokens"] = tokens
    if cut_short:
        summary["cut_short"] = True  # a request ended before the profiler's steps did
    if errors:
        summary["request_errors"] = errors
    return summary


def _batch_shrank(summary: dict, concurrency: int) -> bool:
    """Whether a profiled round ran fewer requests than ``concurrency`` (the forwards' names)."""
    sizes = [int(size) for name in summary.get("forwards", {}) for size in ROUND_BS.findall(name)]
    return any(size < concurrency for size in sizes)


def _requests_under_profiler(
    url: str, prompts: list, concurrency: int, out_dir: Path, steps: int, max_new_tokens: int, timeout: float
) -> tuple[bool, bool, list[str]]:
    """Sends the requests, starts the profiler once every one has its first token and none has
    ended, and stops it when they end: (whether it started, whether it was still running then:
    the requests ended before its steps did, the errors)."""
    firsts = [threading.Event() for _ in range(concurrency)]
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            _stream(url, prompts[i % len(prompts)], max_new_tokens, firsts[i], timeout)
        except (urllib.error.URLError, OSError, ValueError) as error:
            errors.append(f"request {i}: {error!r}"[:300])
        finally:
            firsts[i].set()  # a failed request must not hold the others

    threads = [threading.Thread(target=one, args=(i,), name=f"ab-profile-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    began = time.monotonic()
    for first in firsts:
        first.wait(max(timeout - (time.monotonic() - began), 0.0))
    started = False
    if not errors and all(t.is_alive() for t in threads):
        try:
            http_text(  # answers in plain text
                f"{url}/start_profile",
                {
                    "output_dir": str(out_dir),
                    "num_steps": steps,
                    "activities": ["CPU", "GPU"],
                    "with_stack": False,
                    "record_shapes": False,
                },
            )
            started = True
        except (urllib.error.URLError, OSError) as error:
            errors.append(f"/start_profile: {error!r}"[:300])
    for thread in threads:
        thread.join()
    cut_short = False
    if started:
        try:  # the requests ended before the profiled steps did: stop it here
            http_text(f"{url}/stop_profile", {})
            cut_short = True
        except (urllib.error.URLError, OSError):
            pass  # it had stopped itself (SGLang answers an error): the usual case
    return started, cut_short, errors


def finished_trace(folder: Path, timeout: float) -> str | None:
    """Rank 0's trace once written whole: its size has stopped growing and it parses."""
    deadline, last_size = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        traces = sorted(glob.glob(str(folder / "*.trace.json*")), key=lambda p: ("TP-0" not in p, p))
        size = Path(traces[0]).stat().st_size if traces else -1
        if traces and size > 0 and size == last_size:
            try:
                load_trace(traces[0])
                return traces[0]
            except (ValueError, EOFError, OSError):
                pass
        last_size = size
        time.sleep(1.0)
    return None


# --------------------------------------------------------------------------- the summary


def categorise(kernel_name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return category
    return OTHER


def load_trace(path: str) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
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


def _complete(events: list[dict], *categories: str) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories and "ts" in e]


def _phase_us(events: list[dict], rounds: int) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("name", "").startswith("ddtree."):
            totals[e["name"][len("ddtree.") :]] += e.get("dur", 0)
    return {k: round(v / rounds, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def summarise_events(events: list[dict], steps: int) -> dict:
    """Per round, over the span of the profiled rounds (module docstring). A trace without
    forward names (not SGLang's) is taken whole, as ``steps`` rounds."""
    annotations = _complete(events, "user_annotation")
    forwards = sorted((e for e in annotations if STEP.match(e.get("name", ""))), key=lambda e: e["ts"])
    rounds_seen = [e for e in forwards if ROUND.match(e["name"])]
    kernels = _complete(events, "kernel")
    runtime = _complete(events, "cuda_runtime", "cuda_driver")
    if len(rounds_seen) > 1:  # from the first round's start to the last one's: whole periods
        t0, t1, rounds = rounds_seen[0]["ts"], rounds_seen[-1]["ts"], len(rounds_seen) - 1
    elif rounds_seen:
        t0, t1, rounds = rounds_seen[0]["ts"], rounds_seen[0]["ts"] + rounds_seen[0].get("dur", 0), 1
    else:
        timed = kernels + runtime or _complete(events, "cpu_op", "user_annotation")
        if not timed:
            return {"error": "an empty trace"}
        t0 = min(e["ts"] for e in timed)
        t1 = max(e["ts"] + e.get("dur", 0) for e in timed)
        rounds = steps

    def inside(evs):
        return [e for e in evs if t0 <= e["ts"] < t1]

    kernels, runtime = inside(kernels), inside(runtime)
    per_round = 1.0 / rounds
    summary = {
        "rounds": rounds,
        "round_us": round((t1 - t0) * per_round, 1),
        "forwards": dict(Counter(e["name"] for e in forwards)),
        "phase_host_us": _phase_us(inside(annotations), rounds),
        "phase_gpu_us": _phase_us(inside(_complete(events, "gpu_user_annotation")), rounds),
    }
    if not kernels:  # a CPU server's trace: its host time is all there is
        return summary
    by_category: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_category[categorise(e.get("name", ""))] += e.get("dur", 0)
    busy = _busy_us([(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels])
    names = [e.get("name", "") for e in runtime]
    copies = inside(_complete(events, "gpu_memcpy"))
    summary.update(
        gpu_busy_us=round(busy * per_round, 1),
        gpu_idle_us=round((t1 - t0 - busy) * per_round, 1),
        gpu_us_by_category={
            k: round(v * per_round, 1) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])
        },
        kernels_per_round=round(len(kernels) * per_round, 2),
        kernel_launches_per_round=round(sum(bool(LAUNCH.match(n)) for n in names) * per_round, 2),
        graph_launches_per_round=round(sum(bool(GRAPH_LAUNCH.match(n)) for n in names) * per_round, 2),
        host_syncs_per_round=round(sum(bool(SYNC.match(n)) for n in names) * per_round, 2),
        device_to_host_copies_per_round=round(
            sum("DtoH" in e.get("name", "") for e in copies) * per_round, 2
        ),
    )
    return summary


def summarise_trace(path: str, steps: int) -> dict:
    return {"trace": Path(path).name, **summarise_events(load_trace(path), steps)}
