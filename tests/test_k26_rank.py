"""The K2.6-rank model folder as SGLang reads it: architecture, MLA and MoE widths of one
TP-8 rank, and the INT4 scheme landing on the routed experts only (the Marlin MoE path)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lab.models.k26_rank import K26, TP, drafter_config, rank_config, weight_bytes, write_rank


@pytest.fixture(scope="module")
def rank(tmp_path_factory):
    return write_rank(tmp_path_factory.mktemp("k26"))


def test_sglang_reads_the_rank_as_deepseek_v3_mla_at_one_eighth_width(rank):
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    config = ModelConfig(str(rank["target"]), dtype="bfloat16")
    hf = config.hf_config
    assert hf.architectures == ["DeepseekV3ForCausalLM"]
    assert config.attention_arch == AttentionArch.MLA
    assert config.num_attention_heads == K26["heads"] // TP == 8
    assert (config.kv_lora_rank, config.qk_rope_head_dim, hf.q_lora_rank) == (512, 64, 1536)
    assert (hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (384, 8, 256)
    assert hf.intermediate_size == 18432 // TP and hf.first_k_dense_replace == 1
    assert config.vocab_size == 163840 and config.num_hidden_layers == 61
    assert config.quantization == "compressed-tensors"


@pytest.mark.parametrize(
    ("name", "quantized"),
    [
        ("model.layers.1.mlp.experts.0.gate_proj", True),
        ("model.layers.60.mlp.experts.383.down_proj", True),
        ("model.layers.1.self_attn.fused_qkv_a_proj_with_mqa", False),
        ("model.layers.1.self_attn.o_proj", False),
        ("model.layers.1.mlp.shared_experts.gate_up_proj", False),
        ("model.layers.0.mlp.gate_up_proj", False),
        ("lm_head", False),
    ],
)
def test_int4_group32_on_routed_experts_only(rank, name, quantized):
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    config = json.loads((rank["target"] / "config.json").read_text())
    quant = CompressedTensorsConfig.from_config(config["quantization_config"])
    scheme = quant.get_scheme_dict(torch.nn.Linear(1, 1), name)
    assert (scheme is not None) == quantized
    if quantized:
        weights = scheme["weights"]
        assert (weights.num_bits, weights.group_size, weights.symmetric) == (4, 32, True)
        assert quant._is_wNa16_group_channel(weights, scheme.get("input_activations"))


def test_drafter_matches_the_published_kimi_dflash_shape(rank):
    drafter = json.loads((rank["drafter"] / "config.json").read_text())
    assert drafter["architectures"] == ["DFlashDraftModel"]
    assert drafter["hidden_size"] == 7168 and drafter["num_hidden_layers"] == 6
    assert drafter["block_size"] == 8 and drafter["num_target_layers"] == 61
    assert drafter["dflash_config"]["target_layer_ids"] == [1, 12, 24, 35, 47, 58]
    assert drafter["num_attention_heads"] == 64 // TP


def test_drafter_rope_is_the_published_yarn_in_the_style_sglangs_fused_paths_serve(rank):
    """SGLang's fused drafter paths (context KV, q/k norm + RoPE) need neox style with the
    rotary over the whole head; an interleaved drafter takes the per-layer paths."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.utils.hf_transformers_utils import get_rope_config

    hf = ModelConfig(str(rank["drafter"]), dtype="bfloat16").hf_config
    theta, scaling = get_rope_config(hf)  # as SGLang's DFlash attention reads them
    assert bool(getattr(hf, "rope_is_neox_style", getattr(hf, "is_neox_style", True)))
    assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == (
        "yarn",
        64.0,
        4096,
    )
    assert theta == 50000.0 and not {"rope_dim", "partial_rotary_factor"} & set(scaling)
    assert getattr(hf, "partial_rotary_factor", 1.0) == 1.0


def test_short_rank_keeps_the_shapes_and_a_drafter_within_its_layers(tmp_path):
    paths = write_rank(tmp_path, layers=3, quantized=False)
    target = json.loads((paths["target"] / "config.json").read_text())
    drafter = json.loads((paths["drafter"] / "config.json").read_text())
    assert target["num_hidden_layers"] == 3 and "quantization_config" not in target
    assert drafter["dflash_config"]["target_layer_ids"] == [0, 1]
    with pytest.raises(ValueError):
        rank_config(layers=1)


@pytest.mark.parametrize("layers", [2, 3, 4, 7, 12, 60, 61])
def test_every_drafter_tap_is_captured_by_sglang(layers):
    """SGLang captures tap ``i`` as the input of layer ``i + 1``
    (``DeepseekV2ForCausalLM.set_dflash_layers_to_capture``); a tap on the last layer is never
    captured and the server's graph capture fails ("captured 2 of 3 aux hidden states", seen on
    a 3-layer rank)."""
    taps = drafter_config(layers)["dflash_config"]["target_layer_ids"]
    captured = [i + 1 for i in taps]
    assert taps == sorted(set(taps)) and min(taps) >= 0
    assert all(layer < layers for layer in captured)
    assert len(taps) == min(6, layers - 1)


def test_rank_weight_budget_fits_one_h200():
    sizes = weight_bytes(rank_config())
    # 60 MoE layers x 384 experts x 3 x 7168 x 256 at 4.5 bits: the bulk of the rank
    assert 70 < sizes["moe_gb"] < 75
    assert 75 < sizes["total_gb"] < 90


def test_the_allreduce_model_is_the_committed_tp8_model():
    """The report's all-reduce term is the model of results/kimi-k2.6_h200_tp8_allreduce_model.json."""
    from pathlib import Path

    from lab.bench.k26_ab_report import allreduce_ms

    model = json.loads(
        (Path(__file__).parents[1] / "results" / "kimi-k2.6_h200_tp8_allreduce_model.json").read_text()
    )
    for row in model["rows"]:
        assert allreduce_ms(row["M"]) == pytest.approx(row["allreduce_ms_max"], rel=0.02), row["M"]


def _cell(c, tok_per_s, accept, round_ms, profile="p", length=96):
    return {
        "prompt_len": length,
        "profile": profile,
        "concurrency": c,
        "tok_per_s": tok_per_s,
        "accept_length": accept,
        "round_ms": round_ms,
        "tpot_ms": 1e3 / tok_per_s,
        "ttft_ms": 50.0,
    }


def test_the_k26_report_says_who_wins_and_where_ddtree_loses():
    from lab.bench.k26_ab_report import round_allreduce_ms, rows, to_markdown, verdicts

    results = {
        "stamp": {"device": "test"},
        "args": {"profiles": ["p"], "graph_max_bs": 4},
        "arms": [
            {
                "arm": "plain",
                "cells": [
                    {**_cell(1, 100.0, 1, 10.0), "profile": None},
                    {**_cell(8, 800.0, 1, 10.0), "profile": None},
                ],
            },
            {"arm": "chain", "cells": [_cell(1, 150.0, 2, 13.3), _cell(8, 700.0, 2, 22.0)]},
            {
                "arm": "ddtree@32",
                "cells": [_cell(1, 180.0, 2.6, 14.4), _cell(8, 600.0, 2.6, 34.0)],
                "memory_usage": {"weight": 80.1},
            },
            {"arm": "ddtree@64", "error": "server did not start: out of memory"},
            {
                "arm": "ddtree@auto64",
                "cells": [],
                "online_budget_log": ["{'width_steps': {1: 5, 65: 9}}"],
                "profiles": [{"bs": 1, "error": "no complete trace"}],
            },  # fmt: skip
        ],
    }
    said = verdicts(results)
    assert said[0].startswith("prompt 96, p, c=1: ddtree@32 wins (1.20x the next arm)")
    assert "ddtree@32 1.80x plain" in said[0] and "1.20x chain" in said[0] and "live service 1.50x" in said[0]
    assert said[1].startswith("prompt 96, p, c=8: plain wins")
    assert "ddtree@32 0.75x plain (DDTREE LOSES)" in said[1] and "0.86x chain (DDTREE LOSES)" in said[1]
    tree_c1 = next(r for r in rows(results) if r[2] == 1 and r[3] == "ddtree@32")
    ar = round_allreduce_ms("ddtree@32", 1)
    assert ar == pytest.approx(
        2 * 61 * (0.015 + 1.75 * 33 * 7168 * 2 / 370e9 * 1e3)
        + 2 * 6 * (0.015 + 1.75 * 8 * 7168 * 2 / 370e9 * 1e3)
    )
    assert tree_c1[12] == pytest.approx(ar / (14.4 + ar)) and tree_c1[13] == pytest.approx(
        180.0 * 14.4 / (14.4 + ar)
    )
    notes = {(r[2], r[3]): r[-1] for r in rows(results)}
    assert notes[(1, "ddtree@32")] == "wins" and notes[(8, "plain")] == "wins, eager"
    assert notes[(8, "chain")] == "eager"  # c=8 is above the captured batch sizes
    text = to_markdown(results)
    assert "out of memory" in text and "weight 80.1" in text and "DDTREE LOSES" in text
    header = next(line for line in text.splitlines() if line.startswith("| arm | start s"))
    error_row = next(line for line in text.splitlines() if line.startswith("| ddtree@64"))
    assert header.count("|") == error_row.count("|")  # the error sits in its column
    assert "widths chosen" in text and "`{'width_steps': {1: 5, 65: 9}}`" in text
    assert "## Per-round profile" in text and "| ddtree@auto64 | 1 | no complete trace |" in text


def test_profile_accept_follows_each_arms_tree(monkeypatch):
    from lab.bench import k26_ab_report
    from lab.bench.replay_profiles import PROFILES, Profile, chain_accept_length

    profile_accept = k26_ab_report.profile_accept
    profile = PROFILES["pycode-4l"]
    assert profile_accept("plain", None) == 1.0
    assert profile_accept("chain", "pycode-4l") == pytest.approx(chain_accept_length(profile))
    tree = [profile_accept(f"ddtree@{b}", "pycode-4l") for b in (7, 8, 32, 64)]
    assert tree == sorted(tree) and tree[0] > profile_accept("chain", "pycode-4l")  # siblings help
    assert (
        profile_accept("ddtree@auto64", "pycode-4l") is None and profile_accept("ddtree@8", "unknown") is None
    )
    # where the drafter's second choice is never right, seven nodes are the chain, and an eighth
    # adds nothing
    only_top1 = Profile("only-top1", "test", tuple((0.6, 0.0, 0.0) for _ in range(7)))
    monkeypatch.setitem(k26_ab_report.PROFILES, "only-top1", only_top1)
    chain = profile_accept("chain", "only-top1")
    assert chain == pytest.approx(1 + sum(0.6**d for d in range(1, 8)))
    assert profile_accept("ddtree@7", "only-top1") == pytest.approx(chain)
    assert profile_accept("ddtree@8", "only-top1") == pytest.approx(chain)


def test_a_win_inside_the_passes_spread_is_said_to_be_unsettled():
    from lab.bench.k26_ab_report import verdicts

    def results(spread):
        return {
            "args": {"profiles": ["p"]},
            "arms": [
                {"arm": "plain", "cells": [{**_cell(1, 100.0, 1, 10.0), "profile": None}]},
                {"arm": "chain", "cells": [_cell(1, 150.0, 2.5, 16.0)]},
                {"arm": "ddtree@8", "cells": [{**_cell(1, 165.0, 2.6, 15.0), "tok_per_s_spread": spread}]},
            ],
        }

    unsettled = verdicts(results(1.18))[0]
    assert "ddtree@8 wins (1.10x the next arm, within the passes' spread 1.18x)" in unsettled
    settled = verdicts(results(1.02))[0]
    assert "ddtree@8 wins (1.10x the next arm)" in settled


def test_inter_token_time_leaves_out_each_requests_ttft():
    from lab.bench.gpu_rounds_profile import inter_token_ms

    done = [
        {"latency_s": 1.0, "ttft_s": 0.5, "tokens": 11},  # 0.5 s over 10 tokens after the first
        {"latency_s": 0.4, "ttft_s": 0.1, "tokens": 21},  # 0.3 s over 20
        {"latency_s": 9.0, "ttft_s": None, "tokens": 5},  # no TTFT reported: left out
    ]
    assert inter_token_ms(done) == pytest.approx(1e3 * 0.8 / 30)
    assert math.isnan(inter_token_ms([{"latency_s": 1.0, "ttft_s": 0.2, "tokens": 1}]))


def test_k26_arms_share_the_graph_flags_and_name_their_speculation():
    from lab.bench.k26_ab import COMMON, arm_args

    plain, chain = arm_args("plain", "D", 16), arm_args("chain", "D", 16)
    fixed, auto = arm_args("ddtree@32", "D", 16), arm_args("ddtree@auto64", "D", 16)
    for flags in (plain, chain, fixed, auto):
        assert flags[:2] == ["--cuda-graph-max-bs-decode", "16"]
    assert "--speculative-algorithm" not in plain
    assert chain[chain.index("--speculative-ddtree-max-topk") + 1] == "1"
    assert fixed[fixed.index("--speculative-ddtree-budget") + 1] == "32"
    assert auto[auto.index("--speculative-ddtree-budget") + 1] == "auto"
    assert auto[auto.index("--speculative-num-draft-tokens") + 1] == "65"
    assert "--log-level" not in auto  # every arm logs at COMMON's level (its widths reach the log)
    assert COMMON[COMMON.index("--log-level") + 1] == "info"
    for bad in ("ddtree@", "ddtree@autox", "tree@8", "ddtree", "ddtree@auto", "plain,chain"):
        with pytest.raises(ValueError):
            arm_args(bad, "D", 16)


def test_k26_sglang_verify_suffix_keeps_the_arm_and_sets_the_kernel_switch():
    from lab.bench.k26_ab import base_arm
    from lab.bench.k26_ab_report import verify_width
    from sglang_ddtree.config import ENV_VERIFY_ATTENTION

    assert base_arm("ddtree@16+sglang-verify") == ("ddtree@16", {ENV_VERIFY_ATTENTION: "sglang"})
    assert base_arm("ddtree@16") == ("ddtree@16", {})
    assert verify_width("ddtree@16+sglang-verify") == verify_width("ddtree@16") == 17


def test_k26_width1_suffix_injects_a_table_where_only_width_1_pays(tmp_path):
    from lab.bench.k26_ab import base_arm
    from sglang_ddtree.config import ENV_BUDGET_COST_TABLE

    name, env = base_arm("ddtree@auto64+width1", tmp_path)
    table = json.loads(Path(env[ENV_BUDGET_COST_TABLE]).read_text())
    assert name == "ddtree@auto64" and table["widths"][0] == 1
    assert all(row[0] < min(row[1:]) for row in table["ms"])
    with pytest.raises(ValueError):
        base_arm("ddtree@16+width1", tmp_path)  # a fixed budget has no width to fall back to


def test_merged_k26_report_takes_every_ratio_inside_its_call(tmp_path):
    from lab.bench import k26_ab_merge

    def call(plain_tok_s, tree_tok_s, variant_tok_s):
        return {
            "stamp": {"commit": "c", "date_utc": "d"},
            "args": {"profiles": ["p"], "graph_max_bs": 32},
            "arms": [
                {"arm": "plain", "cells": [{**_cell(1, plain_tok_s, 1, 10.0), "profile": None}]},
                {"arm": "ddtree@16", "cells": [_cell(1, tree_tok_s, 3, 20.0)]},
                {"arm": "ddtree@16+sglang-verify", "cells": [_cell(1, variant_tok_s, 3, 20.0)]},
            ],
        }

    calls = [("slow_call", call(100.0, 150.0, 900.0)), ("fast_call", call(200.0, 240.0, 10.0))]
    rows = k26_ab_merge.best_tree_rows(calls)
    by_call = {r[3]: r for r in rows}
    assert by_call["slow_call"][4] == "ddtree@16"  # the variant arm is a comparison, not a candidate
    assert by_call["slow_call"][7] == pytest.approx(1.5) and by_call["fast_call"][7] == pytest.approx(1.2)
    assert by_call["slow_call"][-1] == ""  # c=1 ran on graphs (graph_max_bs 32)
    concurrencies, ratio_rows = k26_ab_merge.arm_ratio_rows(calls)
    ratios = {(r[2], r[3]): r[4] for r in ratio_rows}
    assert concurrencies == [1]
    assert ratios[("ddtree@16", "slow_call")] == pytest.approx(1.5)  # over its own call's plain
    assert ratios[("ddtree@16+sglang-verify", "fast_call")] == pytest.approx(0.05)
    paths = []
    for name, results in calls:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(results))
        paths.append(str(path))
    assert k26_ab_merge.main([*paths, "--out", str(tmp_path / "out"), "--label", "merged"]) == 0
    text = (tmp_path / "out" / "merged.md").read_text()
    assert (
        "## Call slow_call" in text and "## Call fast_call" in text and text.count("live K2.6 service") == 1
    )


def test_k26_arms_past_the_deadline_are_reported_as_not_started(tmp_path):
    from lab.bench import k26_ab

    argv = ["--model", "unused", "--drafter", "unused", "--arms", "plain,chain", "--deadline-s", "0"]
    assert k26_ab.main([*argv, "--out", str(tmp_path), "--label", "cut"]) == 0
    results = json.loads((tmp_path / "cut.json").read_text())
    assert [a["arm"] for a in results["arms"]] == ["plain", "chain"]
    assert all(a["skipped"] == ["not started: deadline or no plain recording"] for a in results["arms"])
    assert "not started" in (tmp_path / "cut.md").read_text()


def test_verdicts_give_the_decode_speed_beside_tok_s():
    """A tree that loses in tok/s through a slower prefill but decodes faster says both."""
    from lab.bench.k26_ab_report import verdicts

    results = {
        "args": {"profiles": ["p"]},
        "arms": [
            {"arm": "plain", "cells": [{**_cell(1, 100.0, 1, 10.0), "profile": None, "itl_ms": 9.0}]},
            {"arm": "chain", "cells": [{**_cell(1, 150.0, 2.5, 16.0), "itl_ms": 4.4}]},
            {"arm": "ddtree@8", "cells": [{**_cell(1, 135.0, 2.6, 15.0), "itl_ms": 4.0}]},
        ],
    }
    said = verdicts(results)[0]
    assert "ddtree@8 0.90x chain (decode 1.10x by ITL) (DDTREE LOSES)" in said
    assert "ddtree@8 1.35x plain (decode 2.25x by ITL)" in said
    results["arms"][1]["cells"][0]["itl_ms"] = float("nan")  # no TTFT reported: nothing said
    assert "0.90x chain (DDTREE LOSES)" in verdicts(results)[0]


def test_a_pass_has_two_requests_a_slot_and_a_thousand_output_tokens():
    """64-token requests: 16 a pass at c=1, as before; 256-token requests (decode-bound) need
    only 4 at c=1; from c=8 on two per slot decide."""
    from lab.bench.k26_ab import requests_per_pass

    assert requests_per_pass(1, 64) == 16
    assert requests_per_pass(1, 256) == 4
    assert requests_per_pass(1, 100) == 11  # 1,100 tokens: rounded up
    assert requests_per_pass(8, 64) == 16 and requests_per_pass(8, 256) == 16
    assert requests_per_pass(32, 64) == 64


def test_the_online_budgets_widths_are_reported_per_cell(tmp_path):
    """Each cell's widths are the difference of the cumulative lines logged around it."""
    from lab.bench.k26_ab_report import widths_by_cell
    from lab.bench.server_log import steps_between, width_summary

    log = tmp_path / "server.log"
    log.write_text(
        "[t] DDTREE online budget: start-up round costs (bs -> width -> ms) {1: {1: 6.8, 9: 9.5}}\n"
    )
    assert width_summary(log) == {}  # the online budget, before its first width line
    assert width_summary(tmp_path / "plain.log") is None  # no such server
    line = "[t] DDTREE online budget: {'width_steps': {9: %d}, 'width_steps_by_bs': %s, 'round_ms': {}}\n"
    with log.open("a") as f:
        f.write(line % (50, "{1: {1: 5, 9: 45}}"))
    before = width_summary(log)
    with log.open("a") as f:
        f.write("[t] Decode batch, #running-req: 8\n" + line % (150, "{1: {1: 5, 9: 45}, 8: {3: 20, 9: 80}}"))
    between = steps_between(before, width_summary(log))
    assert between == {8: {3: 20, 9: 80}}  # bs 1 did not move: not listed
    cell = {"prompt_len": 96, "profile": "p", "concurrency": 8, "width_steps_by_bs": between}
    md = "\n".join(widths_by_cell({"arms": [{"arm": "ddtree@auto64", "cells": [cell]}]}))
    assert "| ddtree@auto64 | 96 | p | 8 | 8: 3x20, 9x80 |" in md


def test_the_online_budget_log_interval_is_checked(monkeypatch):
    from sglang_ddtree.config import ENV_ONLINE_BUDGET_LOG_EVERY, DDTreeConfigError, online_budget_log_every

    assert online_budget_log_every(1000) == 1000
    monkeypatch.setenv(ENV_ONLINE_BUDGET_LOG_EVERY, "50")
    assert online_budget_log_every(1000) == 50
    monkeypatch.setenv(ENV_ONLINE_BUDGET_LOG_EVERY, "-1")
    with pytest.raises(DDTreeConfigError, match="non-negative"):
        online_budget_log_every(1000)


def test_the_online_budgets_goals_are_checked_against_the_same_call():
    """auto over the best fixed budget and over plain, per prompt set and concurrency."""
    from lab.bench.k26_ab_report import online_budget_goals

    def arm(name, profile, rates, itl=None):
        cells = [
            {
                "prompt_len": 96,
                "profile": profile,
                "concurrency": c,
                "tok_per_s": r,
                "itl_ms": (itl or {}).get(c),
            }
            for c, r in rates.items()
        ]
        return {"arm": name, "cells": cells}

    results = {
        "args": {"profiles": ["p"]},
        "arms": [
            arm("plain", None, {1: 100.0, 8: 400.0}, {1: 6.7}),
            arm("ddtree@8", "p", {1: 160.0, 8: 430.0}, {1: 4.4}),
            arm("ddtree@16", "p", {1: 150.0, 8: 440.0}),
            arm("ddtree@auto16", "p", {1: 140.0, 8: 420.0}, {1: 4.0, 8: 13.0}),
        ],
    }
    md = "\n".join(online_budget_goals(results))
    assert (
        "| 96 | p | ddtree@auto16 tok/s / best fixed (ddtree@8) tok/s, c=1 | 0.875 | >= 0.95 | False |" in md
    )
    assert (
        "| 96 | p | ddtree@auto16 tok/s / best fixed (ddtree@16) tok/s, c=8 | 0.955 | >= 0.95 | True |" in md
    )
    assert "| 96 | p | ddtree@auto16 tok/s / plain tok/s, c=8 | 1.050 | >= 0.95 | True |" in md
    # beside a goal, the decode's pace alone where both cells have an inter-token time
    assert (
        "| 96 | p | ddtree@auto16 decode pace / best fixed (ddtree@8)'s (ITL), c=1 | 1.100 | (not a goal) |  |"
        in md
    )
    assert "| 96 | p | ddtree@auto16 decode pace / plain's (ITL), c=1 | 1.675 | (not a goal) |  |" in md
    assert "decode pace / best fixed (ddtree@16)'s (ITL), c=8" not in md  # ddtree@16 has none
    results["arms"].pop()  # no online budget, no section
    assert online_budget_goals(results) == []


def test_the_report_shows_each_profiled_request_start():
    from lab.bench.k26_ab_report import to_markdown

    timeline = [
        {
            "at_ms": 0.0,
            "what": "step[EXTEND bs=1 toks=96]",
            "host_ms": 3.0,
            "launches": 900,
            "graph_launches": 0,
            "top_kernels": [["Marlin<int4>", 120.25], ["fused_moe", 3.0]],
        },
        {"at_ms": 4.0, "what": "wait: cudaStreamSynchronize", "host_ms": 48.25},
    ]
    results = {
        "stamp": {"device": "test"},
        "args": {"profiles": ["p"], "graph_max_bs": 4},
        "arms": [
            {
                "arm": "ddtree@auto16",
                "cells": [],
                "start_profiles": [
                    {"trace": "a.trace.json.gz", "ttft_ms": 168.8, "timeline": timeline},
                    {"load": 7, "error": "no complete trace in x after 90 s"},
                ],
            }
        ],
    }
    text = to_markdown(results)
    assert "## Request start (profiled)" in text and "### ddtree@auto16, request 1, from idle\n" in text
    assert "- TTFT (SGLang's stamp): 168.8 ms; trace `a.trace.json.gz`" in text
    assert (
        "| 0.0 | step[EXTEND bs=1 toks=96] | 3 |  |  | 900 | 0 | Marlin<int4> 120.2, fused_moe 3.0 |" in text
    )
    assert "| 4 | wait: cudaStreamSynchronize | 48.2 |  |  |  |  |  |" in text
    assert "### ddtree@auto16, request 2 beside 7 decoding\n\n- no complete trace in x after 90 s" in text
    results["arms"][0].pop("start_profiles")
    assert "Request start" not in to_markdown(results)


def test_a_loaded_request_start_runs_beside_prompts_it_does_not_profile(monkeypatch, tmp_path):
    """``--start-profile-load 7`` with 8 prompts a set: the load cycles over the prompts no
    profiled request uses (a profiled prompt in the load would reach its prefill cached)."""
    from types import SimpleNamespace

    from lab.bench import k26_ab

    calls = []
    monkeypatch.setattr(k26_ab, "_generate", lambda server, prompt, n: None)
    monkeypatch.setattr(
        k26_ab,
        "profile_request_start",
        lambda server, prompt, out, s, load: calls.append((prompt, load)) or {},
    )
    prompts = [[i] for i in range(8)]
    args = SimpleNamespace(
        prompt_lens=[96],
        profiles=["p"],
        out=str(tmp_path),
        label="x",
        profile_export_s=1.0,
        start_profile_load=7,
        output_len=64,
    )
    record = {}
    k26_ab.run_start_profiles(None, "ddtree@8", {(96, "p"): prompts}, args, record)
    profiled = [prompt for prompt, _ in calls]
    assert profiled == [[1], [2]] and len(record["start_profiles"]) == 2
    for _, load in calls:
        assert len(load) == 7 and not any(p in profiled for p in load)
        assert load[:5] == prompts[3:] and load[5:] == prompts[3:5]


def test_each_cell_reports_how_its_requests_were_batched_into_prefills(tmp_path):
    """From SGLang 0.5.23's prefill lines (as the auto16 server logged them at 0fc9c47): a pass
    at c=8 whose first request was prefilled alone and the other seven together, then one
    prefill a request as earlier ones finished."""
    from lab.bench.k26_ab_report import prefills_by_cell
    from lab.bench.server_log import prefill_batches, prefill_summary

    def line(seqs, new, cached):
        return (
            f"[2026-12-02 14:41:23] Prefill batch, #new-seq: {seqs}, #new-token: {new}, #cached-token: {cached}, "
            "token usage: 0.00, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, "
            "input throughput (token/s): 2.18\n"
        )

    log = tmp_path / "server.log"
    log.write_text(line(1, 1, 95) + "[t] Decode batch, #running-req: 1\n")
    before = len(prefill_batches(log))
    with log.open("a") as f:
        f.write(line(1, 1, 95) + line(7, 7, 665) + "".join(line(1, 1, 95) for _ in range(8)))
    cell = prefill_summary(prefill_batches(log)[before:])
    assert cell == {"batches": 10, "requests": 16, "new_tokens": 16, "requests_per_batch": 1.6}
    assert prefill_summary([])["requests_per_batch"] is None
    assert prefill_batches(tmp_path / "missing.log") == []
    row = {"prompt_len": 96, "profile": "p", "concurrency": 8, "prefills": cell}
    md = "\n".join(prefills_by_cell({"arms": [{"arm": "plain", "cells": [row]}]}))
    assert "| plain | 96 | p | 8 | 10 | 16 | 1.6 | 16 |" in md
    assert (
        prefills_by_cell({"arms": [{"arm": "plain", "cells": [{**row, "prefills": prefill_summary([])}]}]})
        == []
    )
