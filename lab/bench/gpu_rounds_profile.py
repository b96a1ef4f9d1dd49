"""The profiles of :mod:`.gpu_rounds`: SGLang's torch profiler over a few decode steps of a
served batch (``/start_profile``), summarised by :mod:`.round_profile`; one profile per
profiled batch size, and one with Python stacks per ``--stack-profile-arms`` arm."""

from __future__ import annotations

import concurrent.futures
import glob
import time
import urllib.error
from pathlib import Path

from lab.bench.round_profile import load_trace, request_timeline, summarise_trace
from sglang_ddtree.launch import ServerProcess, http_text


def request_tokens(server: ServerProcess, prompt: list[int], output_len: int) -> dict:
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    began = time.perf_counter()
    meta = server.generate({"input_ids": prompt, "sampling_params": params})["meta_info"]
    return {
        "latency_s": time.perf_counter() - began,
        "tokens": meta["completion_tokens"],
        "rounds": meta.get("spec_verify_ct") or meta["completion_tokens"],
        "ttft_s": meta.get("first_token_latency"),  # with --enable-metrics
    }


def inter_token_ms(done: list[dict]) -> float:
    """Decode time per output token after the first, net of each request's TTFT: the round's
    cost without the prefills that wall-clock tok/s carries (at 96-token prompts and 64 output
    tokens a request's TTFT was 20-35% of its time on the K2.6 rank)."""
    timed = [d for d in done if d.get("ttft_s") is not None and d["tokens"] > 1]
    decode_tokens = sum(d["tokens"] - 1 for d in timed)
    if not decode_tokens:
        return float("nan")
    return 1e3 * sum(d["latency_s"] - d["ttft_s"] for d in timed) / decode_tokens


def time_left(args) -> float:
    return args.deadline_s - (time.monotonic() - args.t0)


PROFILE_OUTPUT_LEN = 2048  # tokens per profiled request (the pairs' context is 4096)


def profile_level(
    server, prompts, args, arm: str, bs: int, trace_dir: Path, with_stack: bool = False
) -> dict:
    """Keep ``bs`` requests decoding while SGLang's profiler records ``--profile-steps`` steps
    (``with_stack``: with Python stacks, for the host time by area; they slow the profiled
    steps and the trace's export, so the other profiles go without)."""
    out = trace_dir / f"{arm.replace('@', '_')}_bs{bs}{'_stack' if with_stack else ''}"
    out.mkdir(parents=True, exist_ok=True)
    # Long enough to outlast the profiled steps: on the H200 a 512-token request of the
    # trained pair finished before the profiler started, and SGLang stops its profiler (and
    # writes the trace) only from a later batch, so no trace came.
    long_len = max(args.output_len, getattr(args, "profile_output_len", PROFILE_OUTPUT_LEN))
    with concurrent.futures.ThreadPoolExecutor(bs + 1) as pool:
        running = [
            pool.submit(request_tokens, server, prompts[i % len(prompts)], long_len) for i in range(bs)
        ]
        time.sleep(0.3)  # past prefill, into steady decode
        if any(f.done() for f in running):
            return {"bs": bs, "error": "a request finished before the profiler started"}
        http_text(  # answers in plain text
            f"{server.url}/start_profile",
            {
                "output_dir": str(out),
                "num_steps": args.profile_steps,
                "activities": ["CPU", "GPU"],
                "with_stack": with_stack,
            },
        )
        for f in running:
            f.result()
    trace = _finished_trace(out, args.profile_export_s)
    if trace is None:
        return {"bs": bs, "error": f"no complete trace in {out} after {args.profile_export_s:.0f} s"}
    return {"bs": bs, **summarise_trace(trace, args.profile_steps)}


def _finished_trace(folder: Path, timeout_s: float) -> str | None:
    """The profiler writes its trace after the last profiled step, which takes a while for a
    trace with host stacks: wait until the file stops growing and parses."""
    deadline, last_size = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        # One file per rank (``...-TP-<rank>.trace.json.gz``): rank 0's sorts first.
        traces = sorted(glob.glob(str(folder / "*.trace.json*")))
        size = Path(traces[0]).stat().st_size if traces else -1
        if traces and size > 0 and size == last_size:
            try:
                load_trace(traces[0])  # parses: the file is whole (summarised once, by the caller)
                return traces[0]
            except (ValueError, EOFError, OSError):
                pass
        last_size = size
        time.sleep(2.0)
    return None


# Scheduler batches a request-start trace records: the request's prefill and its first decode
# rounds (a round is a drafter forward and a verify). SGLang writes the trace from a later
# batch, so the request outlasts them: START_OUTPUT_LEN tokens take more than START_STEPS + 1
# rounds at up to 16 tokens a round.
START_STEPS = 8
START_OUTPUT_LEN = 256


# Tokens per request of the load a loaded request start runs beside: enough to keep decoding
# through the profiled batches, few enough to end soon after.
LOAD_OUTPUT_LEN = 512


def profile_request_start(server, prompt: list[int], out: Path, export_s: float, load=()) -> dict:
    """One request under SGLang's torch profiler (no Python stacks: the host's pace stays the
    served one), from an idle server or beside ``load`` (prompts already decoding): its TTFT as
    SGLang stamps it, and the timeline of its prefill and first rounds
    (:func:`.round_profile.request_timeline`). The prefix cache is flushed first, so the
    request prefills its whole prompt in every arm (a plain arm that recorded the prompts
    earlier would otherwise prefill one token)."""
    out.mkdir(parents=True, exist_ok=True)
    http_text(f"{server.url}/flush_cache?timeout=30")  # waits for the idle server; fails loudly
    with concurrent.futures.ThreadPoolExecutor(len(load) + 1) as pool:
        running = [pool.submit(request_tokens, server, p, LOAD_OUTPUT_LEN) for p in load]
        if running:
            time.sleep(1.0)  # past their prefill (on the K2.6 rank one eager prefill takes 150-280 ms)
        http_text(  # answers in plain text
            f"{server.url}/start_profile",
            {
                "output_dir": str(out),
                "num_steps": START_STEPS,
                "activities": ["CPU", "GPU"],
                "with_stack": False,
            },
        )
        ttft = request_tokens(server, prompt, START_OUTPUT_LEN)["ttft_s"]
        for f in running:
            f.result()
    trace = _finished_trace(out, export_s)
    if trace is None:
        return {"load": len(load), "error": f"no complete trace in {out} after {export_s:.0f} s"}
    return {
        "load": len(load),
        "trace": trace.rsplit("/", 1)[-1],
        "ttft_ms": None if ttft is None else 1e3 * ttft,
        "timeline": request_timeline(load_trace(trace)),
    }


def profile_or_error(server, prompts, args, arm: str, bs: int, trace_dir: Path, with_stack: bool) -> dict:
    try:
        return profile_level(server, prompts, args, arm, bs, trace_dir, with_stack)
    except (urllib.error.URLError, OSError, KeyError, ValueError) as error:
        return {"bs": bs, "error": repr(error)[:300]}


def run_profiles(server, prompts, args, record: dict, trace_dir: Path) -> None:
    for bs in args.profile_bs:
        if time_left(args) < 0:
            record["skipped"].append(f"profile bs={bs}: deadline")
            continue
        record["profiles"].append(
            profile_or_error(server, prompts, args, record["arm"], bs, trace_dir, False)
        )


def run_stack_profile(server, prompts, args, record: dict, trace_dir: Path) -> None:
    """One profile with Python stacks at ``--stack-profile-bs``: where the host time goes."""
    bs = args.stack_profile_bs
    if time_left(args) < 0:
        record["skipped"].append(f"stack profile bs={bs}: deadline")
        return
    record["stack_profile"] = profile_or_error(server, prompts, args, record["arm"], bs, trace_dir, True)
