"""The GPU round benchmark's trace summary and report, on synthetic data (no GPU)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from lab.bench import gpu_rounds_report
from lab.bench.gpu_rounds import arm_args, parallel_args
from lab.bench.round_profile import (
    categorise,
    host_time_by_area,
    request_timeline,
    summarise_trace,
    sync_sites,
)


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def _runtime(name, ts, dur=1.0):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur}


def test_trace_summary_per_round(tmp_path):
    # two rounds of 100 us: 40 us of kernels each (two overlapping), one sync per round
    events = []
    for r in range(2):
        t = 100.0 * r
        events += [
            _runtime("cudaGraphLaunch", t),
            _kernel("_fwd_kernel_stage1", t + 2, 20),
            _kernel("ddtree_topk_split_bf16", t + 10, 20),  # overlaps the attention kernel
            _kernel("void cutlass_gemm", t + 40, 10),
            _runtime("cudaLaunchKernel", t + 60),
            _runtime("cudaStreamSynchronize", t + 70, 29.0),
            {"ph": "X", "cat": "user_annotation", "name": "ddtree.build", "ts": t + 5, "dur": 8.0},
            {"ph": "X", "cat": "gpu_user_annotation", "name": "ddtree.build", "ts": t + 10, "dur": 20.0},
            {"ph": "X", "cat": "user_annotation", "name": "other_range", "ts": t + 5, "dur": 50.0},
        ]
    path = tmp_path / "x.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarise_trace(str(path), steps=2)
    assert s["round_us"] == 99.5  # 0 .. 199 over two rounds
    assert s["gpu_busy_us"] == 38.0  # union: 2..30 and 40..50
    assert s["gpu_us_by_category"] == {"attention": 20.0, "draft top-k": 20.0, "gemm": 10.0}
    assert s["graph_launches_per_round"] == 1 and s["kernel_launches_per_round"] == 1
    assert s["host_syncs_per_round"] == 1 and s["kernels_per_round"] == 3
    assert s["phase_host_us"] == {"build": 8.0} and s["phase_gpu_us"] == {"build": 20.0}


def _host(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def test_host_time_goes_to_the_innermost_event_of_the_scheduler_thread():
    # per round (100 us): the scheduler's loop calls our round, which calls SGLang's verify
    # prepare, which dispatches a torch op that launches a kernel
    events = []
    for r in range(2):
        t = 100.0 * r
        events += [
            _host("python_function", "sglang/srt/managers/scheduler.py(10): event_loop", t, 100),
            _host("python_function", "sglang_ddtree/adapter/worker.py(200): _tree_round", t + 10, 60),
            _host(
                "python_function", "sglang/srt/speculative/dflash_info.py(5): prepare_for_verify", t + 20, 30
            ),
            _host("cpu_op", "aten::index_select", t + 25, 10),
            _host("cuda_runtime", "cudaLaunchKernel", t + 30, 4),
            _host("python_function", "torch/nn/modules/module.py(1): _call_impl", t + 55, 5),
            _host("python_function", f"<built-in method to of Tensor object at 0x7f{r}a>", t + 62, 3),
        ]
    events += [_host("python_function", "threading.py(1): run", 0, 50, tid=2)]  # another thread
    events += [_kernel("k", 0, 5)]
    summary = host_time_by_area(events, steps=2, top=3)
    assert summary["host_us_by_area"] == {
        "sglang scheduler": 40.0,  # 100 - 60
        "sglang_ddtree": 22.0,  # 60 - 30 - 5 - 3
        "sglang speculative": 20.0,  # 30 - 10
        "torch (Python)": 5.0,
        "torch ops (dispatch)": 6.0,  # 10 - 4
        "CUDA runtime": 4.0,
        "Python builtins": 3.0,
    }
    assert dict((n, us) for n, us in summary["host_us_top_functions"]) == {
        "sglang/srt/managers/scheduler.py(10): event_loop": 40.0,
        "sglang_ddtree/adapter/worker.py(200): _tree_round": 22.0,
        "sglang/srt/speculative/dflash_info.py(5): prepare_for_verify": 20.0,
    }
    # one entry per method, whatever object it was called on
    assert "<built-in method to of Tensor object>" in dict(
        host_time_by_area(events, 2)["host_us_top_functions"]
    )
    assert host_time_by_area([_kernel("k", 0, 5)], steps=1) == {}  # no Python stacks


def test_each_wait_for_the_device_goes_to_its_innermost_sglang_or_plugin_frame():
    def copy(ts, correlation, direction):
        launch = _host("cuda_runtime", "cudaMemcpyAsync", ts, 2)
        launch["args"] = {"correlation": correlation}
        done = {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": f"Memcpy {direction} (Device -> Pinned)",
            "ts": ts + 5,
        }
        done.update(dur=1, args={"correlation": correlation})
        return [launch, done]

    events = []
    for r in range(2):
        t = 1000.0 * r
        events += [
            _host("python_function", "sglang/srt/managers/scheduler.py(10): event_loop", t, 900),
            _host(
                "python_function",
                "sglang/srt/speculative/dflash_info_v2.py(114): prepare_for_decode",
                t + 10,
                100,
            ),
            _host("python_function", "torch/_tensor.py(1): tolist", t + 20, 50),  # below: says nothing
            _host("cuda_runtime", "cudaStreamSynchronize", t + 30, 20),
            _host(
                "python_function", f"sglang_ddtree/adapter/worker.py(300): _commit at 0x7f{r}", t + 200, 100
            ),
            *copy(t + 210, 10 * r + 1, "DtoH"),
            *copy(t + 250, 10 * r + 2, "HtoD"),  # host to device: no wait
            _host("cuda_runtime", "cudaEventSynchronize", t + 500, 5),  # in the scheduler loop only
        ]
    events += [_host("cuda_runtime", "cudaStreamSynchronize", 5, 1, tid=2)]  # a thread without frames
    assert sync_sites(events, steps=2) == [
        ["sglang/srt/speculative/dflash_info_v2.py(114): prepare_for_decode", "sync", 1.0],
        ["sglang_ddtree/adapter/worker.py(300): _commit", "device-to-host copy", 1.0],
        ["sglang/srt/managers/scheduler.py(10): event_loop", "sync", 1.0],
        ["(no Python frame)", "sync", 0.5],
    ]
    assert sync_sites([e for e in events if e["cat"] != "python_function"], steps=2) == []


def test_request_timeline_orders_forwards_and_long_waits_from_the_first_forward():
    def span(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": 1}

    def launched(name, ts, correlation, tid=1):
        event = _host("cuda_runtime", name, ts, 1, tid=tid)
        event["args"] = {"correlation": correlation}
        return event

    def kernel(ts, correlation):
        return {
            "ph": "X",
            "cat": "kernel",
            "name": "k",
            "ts": ts,
            "dur": 1,
            "args": {"correlation": correlation},
        }

    prefill, draft, verify = "step[EXTEND bs=1 toks=96]", "step[DRAFT bs=1]", "step[VERIFY bs=1]"
    events = [
        _host("cuda_runtime", "cudaStreamSynchronize", 500, 9000),  # idle, before the request
        span("user_annotation", prefill, 1000, 2000),
        *[launched("cudaLaunchKernel", 1100 + i, i) for i in range(5)],
        span("gpu_user_annotation", prefill, 1500, 30000),
        kernel(1500, 0),
        *[{**kernel(2000 + 20000 * i, 1 + i), "name": "marlin", "dur": 10000} for i in range(2)],
        {**kernel(31600, 3), "name": "after the span"},
        span("user_annotation", draft, 3500, 400),
        launched("cudaGraphLaunch", 3600, 10),
        span("user_annotation", verify, 4000, 900),  # eager: launches, no graph
        *[launched("cudaLaunchKernel", 4100 + i, 20 + i) for i in range(7)],
        launched("cudaLaunchKernel", 4200, 30, tid=2),  # another thread
        _host("cuda_runtime", "cudaStreamSynchronize", 5000, 40000),  # the host waits 40 ms
        _host("cuda_runtime", "cudaEventSynchronize", 46000, 100),  # below the 0.2 ms floor
        span("user_annotation", draft, 47000, 300),
        launched("cudaGraphLaunch", 47100, 40),
        # the first draft's graph runs after the second draft's host span began: its kernel's
        # correlation, not the time, gives it to the first draft (the second has no GPU span)
        span("gpu_user_annotation", draft, 47200, 600),
        kernel(47200, 10),
    ]
    rows = request_timeline(events)
    assert [r["what"] for r in rows] == [prefill, draft, verify, "wait: cudaStreamSynchronize", draft]
    first, first_draft, eager, wait, second_draft = rows
    assert first == {
        "at_ms": 0.0,
        "what": prefill,
        "host_ms": 2.0,
        "launches": 5,
        "graph_launches": 0,
        "gpu_at_ms": 0.5,
        "gpu_ms": 30.0,
        "top_kernels": [["marlin", 20.0], ["k", 0.001]],  # the kernels inside its GPU span
    }
    assert first_draft["graph_launches"] == 1
    assert (first_draft["gpu_at_ms"], first_draft["gpu_ms"]) == (46.2, 0.6)
    assert (eager["launches"], eager["graph_launches"]) == (7, 0)
    assert wait == {"at_ms": 4.0, "what": "wait: cudaStreamSynchronize", "host_ms": 40.0}
    assert second_draft["at_ms"] == 46.0 and "gpu_ms" not in second_draft
    assert request_timeline([e for e in events if e["cat"] == "cuda_runtime"]) == []


def test_phase_line_of_the_server_log(tmp_path):
    from lab.bench.gpu_rounds import last_phase_times

    log = tmp_path / "server.log"
    log.write_text(
        "[x] WARNING DDTREE phase host us/round: {'build': 40.0, 'round': 900.5}\n"
        "noise\n[x] WARNING DDTREE phase host us/round: {'build': 41.5, 'round': 880.0}\n"
    )
    assert last_phase_times(log) == {"build": 41.5, "round": 880.0}
    log.write_text("no phase lines\n")
    assert last_phase_times(log) is None


def test_categories():
    assert categorise("ddtree_build_tree_w64") == "tree build + mask"
    assert categorise("ddtree_flat_mask") == "tree build + mask"
    assert categorise("ddtree_accept_walk") == "accept"
    assert categorise("vectorized_elementwise_kernel") == "elementwise / norm / other"
    # the K2.6 rank's INT4 experts and their routing (SGLang's Marlin MoE path)
    assert (
        categorise("void MARLIN_NAMESPACE::Marlin<__nv_bfloat16, 4, 8, 8>(int4 const*)")
        == "MoE experts + routing"
    )
    assert categorise("count_and_sort_expert_tokens_kernel") == "MoE experts + routing"


def test_collectives_are_their_own_categories():
    assert (
        categorise("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
        == "all-reduce"
    )
    assert (
        categorise("void sglang::cross_device_reduce_1stage<float, 2>(sglang::RankData*, float*)")
        == "all-reduce"
    )
    assert categorise("void cross_device_reduce_2stage<__nv_bfloat16, 2>(RankData*)") == "all-reduce"
    assert (
        categorise("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "other collectives"
    )
    assert (
        categorise("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "other collectives"
    )
    # torch's own reductions stay where they were
    assert categorise("void at::native::reduce_kernel<512, 1>(...)") == "sampling / argmax / softmax"


def test_tp_flags():
    assert parallel_args(1, 24200) == []
    assert parallel_args(2, 24201) == ["--tp-size", "2", "--nccl-port", "24201"]
    assert parallel_args(2, None) == ["--tp-size", "2"]


def test_arm_variants_share_flags_and_set_one_variable():
    from lab.bench.gpu_rounds import arm_env

    assert arm_args("ddtree@7+phases", "D", 32) == arm_args("ddtree@7", "D", 32)
    assert arm_args("ddtree@7+eagerstep", "D", 32) == arm_args("ddtree@7", "D", 32)
    assert arm_env("ddtree@7+phases", 50) == {"SGLANG_DDTREE_PHASE_TIMES": "50"}
    assert arm_env("ddtree@7+eagerstep", 50) == {"SGLANG_DDTREE_EAGER_TREE_STEP": "1"}
    assert arm_env("ddtree@7", 50) is None
    assert arm_args("ddtree@auto64+pinned", "D", 32) == arm_args("ddtree@auto64", "D", 32)
    assert arm_env("ddtree@auto64+pinned", 50) == {"SGLANG_DDTREE_ONLINE_BUDGET_PIN_WIDEST": "1"}
    with pytest.raises(ValueError, match="online-budget arm"):
        arm_env("ddtree@64+pinned", 50)  # a fixed budget has nothing to pin


def test_the_width1_variant_injects_a_table_where_width_one_always_wins(tmp_path):
    from lab.bench.gpu_rounds import arm_env
    from sglang_ddtree.adapter.widths import StepWidths
    from sglang_ddtree.budget import RoundCostTable, candidate_widths
    from sglang_ddtree.config import budget_cost_table

    env = arm_env("ddtree@auto64+width1", 50, tmp_path)
    path = env["SGLANG_DDTREE_BUDGET_COST_TABLE"]
    monkey = pytest.MonkeyPatch()
    monkey.setenv("SGLANG_DDTREE_BUDGET_COST_TABLE", path)
    try:
        table = budget_cost_table()
    finally:
        monkey.undo()
    assert tuple(table["widths"]) == candidate_widths(64)
    cost = RoundCostTable(table["batch_sizes"], table["widths"], table["ms"])
    widths = StepWidths(candidate_widths(64), cost, depth=7, make_head=lambda w: w)
    widths._per_request = np.full((len(widths.widths), 7), 0.9)  # a confident prediction
    assert all(widths.chooser.choose(bs, widths._expected_accepted(bs)) == 1 for bs in (1, 8, 64, 300))
    with pytest.raises(ValueError, match="online-budget arm"):
        arm_env("ddtree@32+width1", 50, tmp_path)


def test_the_widest_variant_injects_a_table_where_the_widest_tree_always_wins(tmp_path):
    """``+widest``: every width costs the same, so the most expected tokens wins: the widest
    tree, the fixed arm's width, with the online budget's bookkeeping around it. ``+again`` is
    the arm itself in a second server (no variable)."""
    from lab.bench.gpu_rounds import arm_env
    from sglang_ddtree.adapter.widths import StepWidths
    from sglang_ddtree.budget import RoundCostTable, candidate_widths

    table = json.loads(
        Path(arm_env("ddtree@auto64+widest", 50, tmp_path)["SGLANG_DDTREE_BUDGET_COST_TABLE"]).read_text()
    )
    widths = candidate_widths(64)
    cost = RoundCostTable(table["batch_sizes"], table["widths"], table["ms"])
    steps = StepWidths(widths, cost, depth=7, make_head=lambda w: w)
    # reach per depth grows with the width (a wider best-first tree holds the narrower one)
    steps._per_request = np.array([[min(1.0, w / 65) * 0.9**d for d in range(7)] for w in widths])
    assert all(steps.chooser.choose(bs, steps._expected_accepted(bs)) == 65 for bs in (1, 8, 64, 300))
    assert arm_env("ddtree@64+again", 50) == {}
    with pytest.raises(ValueError, match="online-budget arm"):
        arm_env("ddtree@32+widest", 50, tmp_path)


def test_arm_flags():
    assert "--speculative-ddtree-budget" in arm_args("ddtree@16", "D", 32)
    auto = arm_args("ddtree@auto", "D", 32)
    assert auto[auto.index("--speculative-ddtree-budget") + 1] == "auto"
    assert auto[auto.index("--speculative-num-draft-tokens") + 1] == "33"
    auto64 = arm_args("ddtree@auto64+phases", "D", 32)
    assert auto64[auto64.index("--speculative-num-draft-tokens") + 1] == "65"
    for bad in ("ddtree@autox", "ddtree@", "ddtree@x"):
        with pytest.raises(ValueError):
            arm_args(bad, "D", 32)
    assert "DFLASH" in arm_args("dflash", "D", 32)
    assert not any(a.startswith("--speculative") for a in arm_args("plain", "D", 32))


def test_report_targets_and_files(tmp_path):
    def level(c, tps, rms):
        return {"concurrency": c, "tok_per_s": tps, "accept_length": 3.0, "round_ms": rms, "requests": 8}

    results = {
        "stamp": {"device": "test"},
        "args": {"graph_max_bs": 32, "output_len": 128, "repeats": 2},
        "common_flags": ["--dtype", "bfloat16"],
        "arms": [
            {"arm": "plain", "levels": [level(1, 400, 2.5)], "profiles": []},
            {"arm": "dflash", "levels": [level(1, 700, 3.7), level(8, 2000, 4.0)], "profiles": []},
            {"arm": "ddtree@7", "levels": [level(1, 690, 3.9), level(8, 1900, 4.1)], "profiles": []},
            {
                "arm": "ddtree@32",
                "levels": [level(1, 820, 4.4), level(8, 2100, 4.5)],
                "profiles": [
                    {
                        "bs": 8,
                        "round_us": 4500.0,
                        "gpu_busy_us": 3000.0,
                        "gpu_idle_us": 1500.0,
                        "kernel_launches_per_round": 40.0,
                        "graph_launches_per_round": 2.0,
                        "host_syncs_per_round": 0.0,
                        "device_to_host_copies_per_round": 0.0,
                        "gpu_us_by_category": {"gemm": 900.0, "all-reduce": 321.5, "attention": 500.0},
                    }
                ],
            },
        ],
    }
    rows = {r[0]: r for r in gpu_rounds_report.targets(results)}
    same_width = rows["DDTREE round / DFLASH round, same verify width (8), c=1"]
    assert same_width[1] == f"{3.9 / 3.7:.3f}" and same_width[3] is True
    c1 = rows["best DDTREE (ddtree@32) tok/s / DFLASH tok/s, c=1"]
    assert c1[3] is True  # 820 / 700 = 1.171
    gpu_rounds_report.write_report(results, tmp_path, "r")
    assert (tmp_path / "r.png").stat().st_size > 0
    report = (tmp_path / "r.md").read_text()
    assert "| ddtree@32 | 1 | 820" in report
    assert "| all-reduce us |" in report
    assert "| ddtree@32 | 8 | 4500 | 3000 | 1500 | 40.0 | 2 | 0.0 | 321.5 | gemm 900" in report
    assert "Host time per round by area" not in report  # no stack profiles in this run
    results["arms"][0]["stack_profile"] = {
        "bs": 8,
        "round_us": 2500.0,
        "host_us_by_area": {"sglang scheduler": 900.0, "CUDA runtime": 100.0},
        "host_us_top_functions": [["sglang/srt/managers/scheduler.py(10): event_loop", 700.0]],
    }
    results["arms"][1]["stack_profile"] = {"bs": 8, "error": "no complete trace"}
    gpu_rounds_report.write_report(results, tmp_path, "r")
    report = (tmp_path / "r.md").read_text()
    assert "| arm | round us | sglang scheduler | CUDA runtime |" in report
    assert "| plain | 2500 | 900 | 100 |" in report and "| dflash | no complete trace |" in report
    assert "| `sglang/srt/managers/scheduler.py(10): event_loop` | 700 |" in report


def test_report_judges_the_online_budget_against_the_best_fixed_budget_and_plain():
    def level(c, tps):
        return {"concurrency": c, "tok_per_s": tps, "accept_length": 3.0, "round_ms": 1.0, "requests": 8}

    levels = {
        "plain": {1: level(1, 400), 32: level(32, 6000)},
        "ddtree@7": {1: level(1, 690), 32: level(32, 5000)},
        "ddtree@32": {1: level(1, 820), 32: level(32, 4000)},
        "ddtree@auto": {1: level(1, 800), 32: level(32, 5600)},
        "ddtree@auto+phases": {1: level(1, 10)},  # a debugging variant is not judged
    }
    rows = {r[0]: r for r in gpu_rounds_report.online_budget_targets(levels)}
    assert set(rows) == {
        "ddtree@auto tok/s / best fixed (ddtree@32) tok/s, c=1",
        "ddtree@auto tok/s / plain tok/s, c=1",
        "ddtree@auto tok/s / best fixed (ddtree@7) tok/s, c=32",
        "ddtree@auto tok/s / plain tok/s, c=32",
    }
    assert rows["ddtree@auto tok/s / best fixed (ddtree@32) tok/s, c=1"][3] is True  # 800 / 820 = 0.976
    assert rows["ddtree@auto tok/s / plain tok/s, c=32"][3] is False  # 5600 / 6000 = 0.933
    assert rows["ddtree@auto tok/s / best fixed (ddtree@7) tok/s, c=32"][1] == f"{5600 / 5000:.3f}"


def test_the_same_arm_in_two_servers_is_reported_and_never_judged_as_a_budget():
    def level(c, tps):
        return {"concurrency": c, "tok_per_s": tps, "accept_length": 3.0, "round_ms": 1.0, "requests": 8}

    levels = {
        "ddtree@64": {1: level(1, 881.5), 4: level(4, 2598.0)},
        "ddtree@64+again": {1: level(1, 947.2), 4: level(4, 2288.0)},  # bc39066
        "ddtree@auto64": {1: level(1, 724.0), 4: level(4, 1875.0)},
    }
    lines = gpu_rounds_report.same_arm_section(levels)
    assert "| ddtree@64 | 1 | 1.075 |" in lines[-1] and "| ddtree@64 | 4 | 0.881 |" in lines[-1]
    rows = {r[0]: r for r in gpu_rounds_report.online_budget_targets(levels)}
    assert "ddtree@auto64 tok/s / best fixed (ddtree@64) tok/s, c=4" in rows  # not the +again server
    assert gpu_rounds_report.same_arm_section({"ddtree@64": levels["ddtree@64"]}) == []


def test_text_endpoint_is_read_as_text():
    """SGLang's /start_profile answers plain text: reading it as JSON lost every profile."""
    import http.server
    import threading

    from sglang_ddtree.launch import http_json, http_text

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b"Start profiling.\n" if self.path == "/start_profile" else b'{"ok": 1}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert http_text(f"{url}/start_profile", {"num_steps": 2}) == "Start profiling.\n"
        assert http_json(f"{url}/other", {}) == {"ok": 1}
    finally:
        server.shutdown()


class _ClockServer:
    """Answers every request with 8 tokens in 4 rounds and logs which arm ran when."""

    def __init__(self, name, calls, log_path):
        self.name, self.calls, self.log_path = name, calls, log_path

    def generate(self, payload):
        self.calls.append(self.name)
        self.lens = getattr(self, "lens", []) + [payload["sampling_params"]["max_new_tokens"]]
        return {"meta_info": {"completion_tokens": 8, "spec_verify_ct": 4}}


def test_levels_interleave_the_arms(tmp_path):
    """At a level every arm warms up, then each repeat runs one pass of every arm in a
    rotated order: no arm's passes are all early or all late."""
    from types import SimpleNamespace

    from lab.bench.gpu_rounds import measure_level

    log = tmp_path / "server.log"
    log.write_text("")
    calls = []
    servers = {arm: _ClockServer(arm, calls, log) for arm in ("plain", "dflash", "ddtree@7")}
    args = SimpleNamespace(prompts_per_level=2, output_len=100, output_len_spread=0.5, repeats=3)
    rows = measure_level(servers, [[1, 2, 3]], args, concurrency=1)
    # every arm's passes ask for the same per-request lengths, drawn around the mean
    lens = {arm: server.lens for arm, server in servers.items()}
    assert lens["plain"] == lens["dflash"] == lens["ddtree@7"]
    assert len(set(lens["plain"][1:3])) == 2 and all(50 <= n <= 150 for n in lens["plain"])
    # warm-up: one request per arm; then per repeat every arm's pass (2 requests each)
    assert calls[:3] == ["plain", "dflash", "ddtree@7"]
    passes = [calls[i] for i in range(3, len(calls), 2)]
    assert passes == [
        "plain",
        "dflash",
        "ddtree@7",
        "dflash",
        "ddtree@7",
        "plain",
        "ddtree@7",
        "plain",
        "dflash",
    ]
    for arm, row in rows.items():
        assert row["accept_length"] == 2.0 and len(row["tok_per_s_passes"]) == 3, arm


def test_the_online_budget_lines_come_from_the_arm_log(tmp_path):
    from lab.bench.server_log import online_budget_lines

    log = tmp_path / "ddtree_auto64.log"
    log.write_text(
        "[2026-11-30 16:25:43] DDTREE online budget: verify widths [1, 2, 3] chosen per step\n"
        "[2026-11-30 16:25:44] DDTREE online budget: start-up round costs (bs -> width -> ms) {1: {1: 0.2}}\n"
        "[2026-11-30 16:26:00] DDTREE online budget: {'width_steps': {1: 3, 3: 997}}\n"
        "[2026-11-30 16:27:00] DDTREE online budget: {'width_steps': {1: 500, 3: 1500}}\n"
    )
    assert online_budget_lines(log) == [
        "start-up round costs (bs -> width -> ms) {1: {1: 0.2}}",
        "{'width_steps': {1: 500, 3: 1500}}",
    ]
    assert online_budget_lines(tmp_path / "missing.log") == []


def test_profile_section_lists_where_each_profiled_arm_waits():
    profile = {
        "bs": 1,
        "round_us": 100.0,
        "gpu_busy_us": 60.0,
        "gpu_idle_us": 40.0,
        "kernel_launches_per_round": 3.0,
        "graph_launches_per_round": 1.0,
        "host_syncs_per_round": 1.0,
        "device_to_host_copies_per_round": 0.0,
        "gpu_us_by_category": {"gemm": 50.0},
        "sync_sites": [["sglang/srt/x.py(1): f", "sync", 1.0]],
    }
    lines = gpu_rounds_report.profile_section({"arms": [{"arm": "ddtree@16", "profiles": [profile]}]})
    text = "\n".join(lines)
    assert "`ddtree@16 bs 1`, where the host waits for the device" in text
    assert "| `sglang/srt/x.py(1): f` | sync | 1 |" in text


class _WidthLogServer(_ClockServer):
    """An online-budget server: every request adds 10 steps of width 65 and one of width 1 at
    bs 1 to the cumulative width line of its log."""

    steps = 0

    def generate(self, payload):
        type(self).steps += 1
        with open(self.log_path, "a") as log:
            n = type(self).steps
            log.write(f"[t] DDTREE online budget: {{'width_steps_by_bs': {{1: {{1: {n}, 65: {10 * n}}}}}}}\n")
        return super().generate(payload)


def test_each_level_reports_the_widths_the_online_budget_chose_in_it(tmp_path):
    """A level's widths are the difference of the width lines logged around it (its warm-up
    pass included); the report gives each level's share at the widest width and at width 1."""
    from types import SimpleNamespace

    from lab.bench.gpu_rounds import measure_level, width_log_env

    log = tmp_path / "ddtree_auto64.log"
    log.write_text(
        "[t] DDTREE online budget: start-up round costs (bs -> width -> ms) {1: {1: 0.1, 65: 0.3}}\n"
    )
    plain_log = tmp_path / "plain.log"
    plain_log.write_text("")
    calls = []
    servers = {
        "plain": _ClockServer("plain", calls, plain_log),
        "ddtree@auto64": _WidthLogServer("a", calls, log),
    }
    args = SimpleNamespace(prompts_per_level=2, output_len=100, output_len_spread=0.5, repeats=2)
    rows = measure_level(servers, [[1, 2, 3]], args, concurrency=1)
    assert "width_steps_by_bs" not in rows["plain"]
    assert rows["ddtree@auto64"]["width_steps_by_bs"] == {1: {1: 5, 65: 50}}  # 1 warm-up + 2 x 2 requests
    results = {
        "arms": [{"arm": "ddtree@auto64", "levels": [rows["ddtree@auto64"]], "online_budget_log": ["{}"]}]
    }
    section = "\n".join(gpu_rounds_report.online_budget_section(results))
    assert "| ddtree@auto64 | 1 | 55 | 0.909 | 0.091 | 1: 5, 65: 50 |" in section
    assert width_log_env("ddtree@auto64") and not width_log_env("ddtree@64")


def test_a_pass_splits_its_time_into_request_starts_and_decode_pace():
    """With --enable-metrics a request's meta_info carries its TTFT; a pass reports the median
    TTFT and the decode time per token after the first (latency less TTFT); a server without
    TTFTs reports NaN, and the report leaves such levels out of the section."""
    import time

    from lab.bench.gpu_rounds import timed_pass

    class Server:
        def __init__(self, ttft_s):
            self.ttft_s = ttft_s

        def generate(self, payload):
            time.sleep(0.02)
            meta = {"completion_tokens": 9, "spec_verify_ct": 3}
            return {"meta_info": meta | ({"first_token_latency": self.ttft_s} if self.ttft_s else {})}

    timed = timed_pass(Server(0.004), [[1], [2]], [9, 9], concurrency=1)
    assert timed["ttft_ms"] == pytest.approx(4.0)
    assert timed["itl_ms"] >= (20 - 4) / 8  # each request slept 20 ms; its 8 tokens after the first
    untimed = timed_pass(Server(None), [[1]], [9], concurrency=1)
    assert math.isnan(untimed["ttft_ms"]) and math.isnan(untimed["itl_ms"])

    def level(c, ttft, itl):
        return {"concurrency": c, "tok_per_s": 100.0, "ttft_ms": ttft, "itl_ms": itl}

    levels = {"ddtree@64": {1: level(1, 40.0, 1.5)}, "ddtree@auto64": {1: level(1, 90.0, 1.6)}}
    section = "\n".join(gpu_rounds_report.start_and_pace_section(levels))
    assert "| ddtree@auto64 | 1 | 90.0 | 1.6 |" in section
    assert gpu_rounds_report.start_and_pace_section({"plain": {1: level(1, math.nan, math.nan)}}) == []
    rows = {r[0]: r for r in gpu_rounds_report.online_budget_targets(levels)}
    assert rows["ddtree@auto64 decode pace / best fixed (ddtree@64)'s (ITL), c=1"][1] == f"{1.5 / 1.6:.3f}"
