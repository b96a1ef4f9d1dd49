"""Registration with SGLang and start-up validation (no model is served here,
except by the launcher tests, which must stop before loading one; their launches run
as background jobs, tests/background.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from background import BACKGROUND

from lab.models.tiny import build_tiny_models
from sglang_ddtree.adapter import server_args as ddtree_args
from sglang_ddtree.adapter.server_info import server_info_section
from sglang_ddtree.config import DDTreeConfig, DDTreeConfigError, Settings


def test_ddtree_resolves_after_load_plugins():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ddtree.adapter.spec import DDTreeSpecAlgo

    load_plugins()
    algo = SpeculativeAlgorithm.from_string("DDTREE")
    assert isinstance(algo, DDTreeSpecAlgo)
    assert SpeculativeAlgorithm.from_string("ddtree") is algo
    assert algo.is_dflash_family() and algo.is_dflash() and algo.is_speculative()
    assert not algo.is_eagle() and not algo.need_topk() and not algo.carries_draft_hidden_states()
    assert algo.supports_overlap
    assert hasattr(algo, "create_future_map")


def test_registration_is_idempotent():
    from sglang_ddtree.adapter.spec import register_algorithm
    from sglang_ddtree.plugin import register

    register()
    register()
    assert register_algorithm() is False  # already there: no error, no second entry


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("ddtree") == "sglang_ddtree.plugin:register"


def test_draft_verify_widths():
    from sglang_ddtree.adapter.spec import DDTreeSpecAlgo

    algo = DDTreeSpecAlgo("DDTREE", lambda args: None)
    assert algo.get_num_tokens_per_req_for_target_verify(33, is_draft_worker=False) == 33


@pytest.mark.parametrize(
    "budget, block, message",
    [(0, 8, ">= 1"), (3, 8, "smaller than the drafter's depth"), (2000, 8, "exceeds"), (7, 1, "block size")],
)
def test_config_rejects_bad_budgets(budget, block, message):
    with pytest.raises(DDTreeConfigError, match=message):
        DDTreeConfig(budget=budget, block_size=block).validate()


def test_config_widths_and_topk():
    config = DDTreeConfig(budget=32, block_size=8, max_topk=4)
    config.validate()
    assert (config.verify_width, config.depth, config.topk(163840), config.topk(3)) == (33, 7, 4, 3)
    assert DDTreeConfig(budget=32, block_size=8).topk(163840) == 32


def test_budget_flag_sets_verify_width():
    args = SimpleNamespace(speculative_ddtree_budget=16, speculative_num_draft_tokens=None)
    ddtree_args.apply_budget_flag(args)
    assert args.speculative_num_draft_tokens == 17
    args = SimpleNamespace(speculative_ddtree_budget=16, speculative_num_draft_tokens=9)
    with pytest.raises(DDTreeConfigError, match="Pass only one"):
        ddtree_args.apply_budget_flag(args)


def test_budget_flag_parses_numbers_and_auto():
    import argparse

    parser = argparse.ArgumentParser()
    ddtree_args.add_cli_args(parser)
    assert parser.parse_args(["--speculative-ddtree-budget", "24"]).speculative_ddtree_budget == 24
    assert parser.parse_args(["--speculative-ddtree-budget", "AUTO"]).speculative_ddtree_budget == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-ddtree-budget", "lots"])


def _auto_args(**overrides):
    fields = dict(speculative_ddtree_budget="auto", speculative_num_draft_tokens=None, device="cpu")
    return SimpleNamespace(**{**fields, **overrides})


def test_budget_auto_is_served_eagerly_and_with_graphs(monkeypatch, tmp_path):
    """``auto`` keeps the largest tree as the verify width (the flag's default unless
    --speculative-num-draft-tokens says otherwise) and becomes the server's settings (carried
    to the scheduler processes on the ServerArgs); tensor parallelism is refused, and with CUDA graphs what cannot swap the
    target's backend per step (SGLang's own list for EAGLE's adaptive mode), one line each."""
    monkeypatch.delenv("SGLANG_DDTREE_ONLINE_BUDGET", raising=False)
    monkeypatch.delenv("SGLANG_DDTREE_BUDGET_COST_TABLE", raising=False)
    for refused, message in (
        ({"device": "cuda", "disable_cuda_graph": True, "tp_size": 2}, "needs --tp-size 1"),
        ({"device": "cuda", "tp_size": 2}, "needs --tp-size 1"),
        ({"device": "cuda", "enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
        ({"device": None, "enable_pdmux": True}, "--enable-pdmux"),
        ({"device": "cuda", "enable_dp_attention": True}, "--enable-dp-attention"),
        ({"device": "cuda", "attn_dp_size": 2}, "--attn-dp-size > 1"),
    ):
        args = _auto_args(**refused)
        with pytest.raises(DDTreeConfigError, match=message):
            ddtree_args.apply_budget_flag(args)
    args = _auto_args()
    ddtree_args.apply_budget_flag(args)
    assert args.speculative_num_draft_tokens == 33 and ddtree_args.settings_from_flags(args).online_budget
    assert "SGLANG_DDTREE_ONLINE_BUDGET" not in os.environ  # nothing written to the environment
    # two-batch overlap does not matter where nothing is swapped (eager)
    args = _auto_args(device="cuda", disable_cuda_graph=True, enable_two_batch_overlap=True)
    args.speculative_num_draft_tokens = 17
    ddtree_args.apply_budget_flag(args)
    assert args.speculative_num_draft_tokens == 17 and not ddtree_args.serves_cuda_graphs(args)
    info = server_info_section(17, ddtree_args.settings_from_flags(args))
    assert info["budget"] == "auto"
    assert info["online_budget"] == {
        "max_budget": 16,
        "widths": [1, 2, 4, 8, 16, 17],
        "verify_graphs": "none (eager)",
        "cost_table": "measured",
    }
    args = _auto_args(device="cuda", speculative_num_draft_tokens=17)
    ddtree_args.apply_budget_flag(args)  # CUDA graphs: served
    assert ddtree_args.serves_cuda_graphs(args)
    assert not ddtree_args.serves_cuda_graphs(
        SimpleNamespace(device="cuda", cuda_graph_backend_decode="disabled")
    )
    info = server_info_section(17, Settings(online_budget=True), cuda_graphs=True)["online_budget"]
    assert info["verify_graphs"] == "per width" and info["cost_table"].startswith("timed at start-up")
    # a fixed budget next to the variable set by hand is a contradiction
    monkeypatch.setenv("SGLANG_DDTREE_ONLINE_BUDGET", "1")
    with pytest.raises(DDTreeConfigError, match="contradicts SGLANG_DDTREE_ONLINE_BUDGET"):
        ddtree_args.apply_budget_flag(
            SimpleNamespace(speculative_ddtree_budget=8, speculative_num_draft_tokens=None)
        )


def test_budget_auto_checks_an_injected_cost_table(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_DDTREE_ONLINE_BUDGET", "")
    table = tmp_path / "table.json"
    monkeypatch.setenv("SGLANG_DDTREE_BUDGET_COST_TABLE", str(table))
    table.write_text("not json")
    with pytest.raises(DDTreeConfigError, match="not a cost table"):
        ddtree_args.apply_budget_flag(_auto_args(speculative_num_draft_tokens=9))
    table.write_text(json.dumps({"batch_sizes": [1, 2], "widths": [1, 9], "ms": [[1.0, 2.0]]}))
    with pytest.raises(DDTreeConfigError, match="ms must be"):
        ddtree_args.apply_budget_flag(_auto_args(speculative_num_draft_tokens=9))
    table.write_text(json.dumps({"batch_sizes": [1], "widths": [1, 9], "ms": [[1.0, 2.0]]}))
    with pytest.raises(DDTreeConfigError, match=r"must be the candidates \[1, 2, 4, 8, 9\]"):
        ddtree_args.apply_budget_flag(_auto_args(speculative_num_draft_tokens=9))
    table.write_text(json.dumps({"batch_sizes": [1], "widths": [1, 2, 4, 8, 9], "ms": [[1.0, 2, 3, 4, 5]]}))
    ddtree_args.apply_budget_flag(_auto_args(speculative_num_draft_tokens=9))
    section = server_info_section(9, Settings(online_budget=True))
    assert section["online_budget"]["cost_table"] == "fixed"


def _cfg(tiny, **overrides):
    base = dict(
        device="cpu",
        model_path=str(tiny.target),
        speculative_draft_model_path=str(tiny.drafter),
        speculative_dflash_block_size=None,
        speculative_num_draft_tokens=17,
        attention_backend="torch_native",
        decode_attention_backend=None,
        prefill_attention_backend=None,
        pp_size=1,
        speculative_draft_window_size=None,
        speculative_adaptive=False,
        disaggregation_mode="null",
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def test_validation_accepts_the_tiny_pair(tiny, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    ddtree_args.validate_server_args(_cfg(tiny, device="cuda"))
    assert ddtree_args.resolve_config(_cfg(tiny)) == DDTreeConfig(budget=16, block_size=8)


def _drafter_copy(tiny, tmp_path, **config_changes):
    folder = tmp_path / "drafter"
    shutil.copytree(tiny.drafter, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": 1000}, "does not match the target"),
        ({"architectures": ["Qwen3ForCausalLM"], "dflash_config": None}, "not a DFlash model"),
    ],
)
def test_validation_rejects_bad_drafters(tiny, tmp_path, change, message):
    folder = _drafter_copy(tiny, tmp_path, **change)
    if change.get("dflash_config", 1) is None:
        config = json.loads((folder / "config.json").read_text())
        config.pop("dflash_config")
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DDTreeConfigError, match=message):
        ddtree_args.validate_server_args(_cfg(tiny, device="cuda", speculative_draft_model_path=str(folder)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"speculative_draft_model_path": None}, "is required"),
        ({"attention_backend": "trtllm_mla"}, "no tree-masked verify path"),
        ({"pp_size": 2}, "pipeline parallelism"),
    ],
)
def test_validation_rejects_bad_arguments(tiny, overrides, message):
    with pytest.raises(DDTreeConfigError, match=message):
        ddtree_args.validate_server_args(_cfg(tiny, device="cuda", **overrides))


# --- the real launcher: one line, non-zero exit, no traceback, no model loaded -------------


def _launch(job, tiny, extra, env_changes):
    env = {**os.environ, **env_changes}
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(tiny.target),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--max-total-tokens",
        "2048",
        "--speculative-algorithm",
        "DDTREE",
        *extra,
    ]
    started = time.monotonic()
    # Tracked by the background job: a run that ends (or is stopped) meanwhile kills it.
    proc = job.track(
        subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    result = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    return result, time.monotonic() - started


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        ({"attention_backend": "triton"}, {}, "--attention-backend triton does not run with --device cpu"),
        ({"decode_attention_backend": "fa3"}, {}, "--decode-attention-backend fa3 does not run"),
        ({}, {"SGLANG_DDTREE_TREE_BACKEND": "bogus"}, "expected auto, cuda, cpp or python"),
        ({}, {"SGLANG_DDTREE_TREE_BACKEND": "cuda"}, "needs a GPU"),
        ({}, {"SGLANG_DDTREE_MAX_TOPK": "0"}, "expected a positive integer"),
        ({}, {"SGLANG_DDTREE_LOG_STATS_EVERY": "often"}, "expected a non-negative integer"),
        ({}, {"SGLANG_DDTREE_TEST_PLUGIN": "no_such_test_plugin_module"}, "no such module"),
    ],
)
def test_validation_rejects_cpu_backends_and_bad_variables(tiny, monkeypatch, overrides, env, message):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DDTreeConfigError, match=message):
        ddtree_args.validate_server_args(_cfg(tiny, **overrides))


LAUNCH_CASES = {
    "missing-drafter": "does not exist",
    "vocab-mismatch": "does not match the target",
    "cpu-without-cpu-mode": "SGLANG_USE_CPU_ENGINE=1",
    "bad-budget": "must be >= 1",
    "budget-auto-tp": "auto needs --tp-size 1",
    "cpu-triton": "--attention-backend triton does not run with --device cpu",
    "bogus-tree-backend": "SGLANG_DDTREE_TREE_BACKEND='bogus'",
}


def _launch_case(job, tiny, case):
    folder = job.folder
    env = {}
    extra = ["--speculative-draft-model-path", str(tiny.drafter)]
    if case == "missing-drafter":
        extra = ["--speculative-draft-model-path", str(folder / "no-such-drafter")]
    elif case == "vocab-mismatch":
        extra = ["--speculative-draft-model-path", str(_drafter_copy(tiny, folder, vocab_size=1000))]
    elif case == "cpu-without-cpu-mode":
        env = {"SGLANG_USE_CPU_ENGINE": None}
    elif case == "bad-budget":
        extra += ["--speculative-ddtree-budget", "0"]
    elif case == "budget-auto-tp":
        extra += ["--speculative-ddtree-budget", "auto", "--tp-size", "2"]
    elif case == "cpu-triton":
        extra += ["--attention-backend", "triton"]
    elif case == "bogus-tree-backend":
        env = {"SGLANG_DDTREE_TREE_BACKEND": "bogus"}
    return _launch(job, tiny, extra, env)


# Each case is a minute of imports on one core: a background job, while other tests run.
for _case in LAUNCH_CASES:
    BACKGROUND.declare(
        f"launcher-{_case}",
        f"test_launcher_fails_fast_with_one_line[{_case}]",
        lambda job, case=_case: _launch_case(job, build_tiny_models(), case),
    )


@pytest.mark.server
@pytest.mark.parametrize("case", list(LAUNCH_CASES))
def test_launcher_fails_fast_with_one_line(case):
    message = LAUNCH_CASES[case]
    result, seconds = BACKGROUND.result(f"launcher-{case}")
    assert result.returncode != 0
    assert "error: DDTREE: " in result.stderr and message in result.stderr, result.stderr[-2000:]
    assert sum(line.startswith("error: ") for line in result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "Load weight" not in result.stderr + result.stdout  # stopped before any model loaded


# --- GPU attention backends: what is allowed, and graph capture with a tree mask ------------


def test_mla_target_refuses_backends_without_tree_mask(tiny):
    from lab.models.tiny import TinySpec, build_tiny_models

    mla = build_tiny_models(TinySpec(arch="deepseek_v3"))
    assert ddtree_args.target_uses_mla(str(mla.target)) and not ddtree_args.target_uses_mla(str(tiny.target))
    cfg = _cfg(mla, device="cuda", attention_backend="flashinfer")
    with pytest.raises(DDTreeConfigError, match="no tree-masked verify path for MLA"):
        ddtree_args.validate_server_args(cfg)
    ddtree_args.validate_server_args(_cfg(mla, device="cuda", attention_backend="triton"))
    ddtree_args.validate_server_args(_cfg(tiny, device="cuda", attention_backend="flashinfer"))


def test_live_backend_check():
    from sglang_ddtree.adapter.attention.gpu_backends import check_live_backend

    class TritonAttnBackend:  # noqa: N801 - named like SGLang's class on purpose
        attn_backend_list = None  # SGLang's backends carry this attribute, often None

    class FlashInferMLAAttnBackend:
        pass

    check_live_backend(TritonAttnBackend())
    with pytest.raises(DDTreeConfigError, match="FlashInferMLAAttnBackend"):
        check_live_backend(FlashInferMLAAttnBackend())


def test_verify_graphs_are_captured_with_a_tree_mask():
    """Both capture-time verify inputs carry a tree mask for the target's DDTREE graphs.

    The decode graph runner's ``get_spec_info`` builds the input its verify graphs are
    captured with; for the DFlash family on triton it passes no mask, which captures the
    causal kernel and makes every replay ignore the tree (the lossy-under-graphs defect).
    """
    from types import SimpleNamespace

    import torch
    from sglang.srt.model_executor.runner import base_runner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ddtree.adapter.verify_input import DDTreeVerifyInput

    load_plugins()
    ddtree = SpeculativeAlgorithm.from_string("DDTREE")
    mask = torch.ones(64, dtype=torch.bool)
    dummy = base_runner.create_dummy_verify_input(ddtree, mask, 17, False)
    assert isinstance(dummy, DDTreeVerifyInput)
    assert dummy.custom_mask is mask and dummy.draft_token_num == 17 and dummy.topk == 1

    class TritonAttnBackend:  # noqa: N801 - SGLang decides by the class name
        pass

    def graph_runner(is_draft_worker, width=17, custom_mask=mask):
        return SimpleNamespace(
            model_runner=SimpleNamespace(
                spec_algorithm=ddtree, is_draft_worker=is_draft_worker, attn_backend=TritonAttnBackend()
            ),
            buffers=SimpleNamespace(custom_mask=custom_mask),
            captured_req_width=width,
            _capture_ragged_verify_layout=lambda num_tokens: None,
        )

    target = DecodeCudaGraphRunner.get_spec_info(graph_runner(False), 17)
    assert target.custom_mask is mask and target.draft_token_num == 17
    # --speculative-ddtree-budget auto captures a runner per width (adapter/width_graphs.py) on one
    # model runner: each is captured with its own width and a tree mask from its own buffers
    for width in (1, 2, 5, 9):
        own_mask = torch.ones(8 * width, dtype=torch.bool)
        narrow = DecodeCudaGraphRunner.get_spec_info(graph_runner(False, width, own_mask), 4 * width)
        assert narrow.custom_mask is own_mask and narrow.draft_token_num == width
        dummy = base_runner.create_dummy_verify_input(ddtree, own_mask, width, False)
        assert dummy.custom_mask is own_mask and dummy.draft_token_num == width
    drafter = DecodeCudaGraphRunner.get_spec_info(graph_runner(True), 17)
    assert drafter.custom_mask is None  # the drafter's block is causal
    dflash = graph_runner(False)
    dflash.model_runner.spec_algorithm = SpeculativeAlgorithm.DFLASH
    assert DecodeCudaGraphRunner.get_spec_info(dflash, 17).custom_mask is None  # stock DFLASH untouched


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative-ddtree-max-topk", "0"], "--speculative-ddtree-max-topk must be >= 1"),
        (["--speculative-ddtree-stats-interval", "-1"], "--speculative-ddtree-stats-interval must be >= 0"),
    ],
)
def test_option_flags_are_validated(argv, message, monkeypatch):
    import argparse

    monkeypatch.delenv("SGLANG_DDTREE_MAX_TOPK", raising=False)
    monkeypatch.delenv("SGLANG_DDTREE_LOG_STATS_EVERY", raising=False)
    parser = argparse.ArgumentParser()
    ddtree_args.add_cli_args(parser)
    with pytest.raises(DDTreeConfigError, match=message):
        ddtree_args.apply_option_flags(parser.parse_args(argv))


def test_option_flags_reach_the_configuration(monkeypatch):
    """The flags become the server's settings, which travel on the ServerArgs record (also
    through pickling, as to a spawned scheduler process) and make the configuration; a
    contradicting variable set by hand is refused."""
    import argparse
    import pickle

    from sglang.srt.server_args import ServerArgs

    from sglang_ddtree.config import SETTINGS_ATTR, DDTreeConfig, settings_of

    monkeypatch.delenv("SGLANG_DDTREE_MAX_TOPK", raising=False)
    monkeypatch.delenv("SGLANG_DDTREE_LOG_STATS_EVERY", raising=False)
    parser = argparse.ArgumentParser()
    ddtree_args.add_cli_args(parser)
    namespace = parser.parse_args(
        ["--speculative-ddtree-max-topk", "2", "--speculative-ddtree-stats-interval", "5"]
    )
    ddtree_args.apply_option_flags(namespace)
    record = ServerArgs(model_path="unused")
    setattr(record, SETTINGS_ATTR, ddtree_args.settings_from_flags(namespace))
    settings = settings_of(pickle.loads(pickle.dumps(record)))
    assert settings == Settings(online_budget=False, max_topk=2, stats_interval=5)
    assert DDTreeConfig.from_spec_fields(17, 8, settings.max_topk).max_topk == 2
    assert server_info_section(17, settings)["stats_interval"] == 5
    assert settings_of(ServerArgs(model_path="unused")) == Settings()  # no flags, no variables
    monkeypatch.setenv("SGLANG_DDTREE_MAX_TOPK", "3")
    with pytest.raises(DDTreeConfigError, match="contradicts SGLANG_DDTREE_MAX_TOPK=3"):
        ddtree_args.apply_option_flags(namespace)
