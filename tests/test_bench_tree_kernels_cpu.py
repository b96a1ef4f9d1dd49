"""The tree-kernel benchmark's bookkeeping (targets, report, plot) on made-up numbers."""

from __future__ import annotations

import pytest
import torch

from lab.bench import _stamp, tree_kernels_cases, tree_kernels_report
from lab.bench import tree_kernels as tk


def _fake_results():
    res = {
        "stamp": {"device": "NVIDIA H200", "commit": "abc123"},
        "vocab": tk.VOCAB,
        "config": {"calls": 20, "reps": 30},
        "build": [],
        "accept": [],
        "topk": [],
    }
    for blk in tk.BLOCKS:
        for bud in tk.BUDGETS:
            for bs in tk.BATCH_SIZES:
                gpu = 5.0 + bud / 16
                res["build"].append(
                    dict(
                        block=blk,
                        depth=blk - 1,
                        budget=bud,
                        bs=bs,
                        python_us=gpu * 1000,
                        cpp_us=gpu * 25,
                        gpu_us=gpu,
                        gpu_single_graph_us=gpu + 4,
                        speedup_vs_python=1000.0,
                        speedup_vs_cpp=25.0,
                        mean_tree_depth=3.0,
                    )
                )
                res["accept"].append(
                    dict(
                        block=blk,
                        budget=bud,
                        bs=bs,
                        python_us=900.0,
                        cpp_us=80.0,
                        torch_us=60.0,
                        gpu_us=2.0 + bud / 128,
                        mean_accept_len=2.5,
                    )
                )
                row = dict(block=blk, budget=bud, bs=bs, gpu_us=40.0)
                if bud == 64:
                    row.update(torch_exact_us=900.0, torch_topk_inexact_us=300.0)
                res["topk"].append(row)
    return res


def test_targets_and_report(tmp_path):
    res = _fake_results()
    res["targets"] = tree_kernels_report.evaluate_targets(res)
    t = res["targets"]
    assert t["build_vs_python_bs64_b64"]["met"] and t["build_vs_cpp_bs64_b64"]["met"]
    assert t["build_us_bs1_b32"]["value"] == 7.0 and t["build_us_bs1_b32"]["met"]
    assert t["accept_us_bs64"]["value"] == 4.0 and t["accept_us_bs64"]["met"]
    md = tree_kernels_report.to_markdown(res)
    assert "## Build, block 16 (depth 15)" in md and "| 64 | 64 |" in md
    assert "Cycles per pop" not in md
    res["pop_cycles"] = [
        dict(
            budget=64,
            width=65,
            registers_kernel="ddtree_build_tree_r3",
            registers_cycles_per_pop=640.0,
            shared_kernel="ddtree_build_tree",
            shared_cycles_per_pop=860.0,
        ),
        dict(budget=256, width=257, shared_kernel="ddtree_build_tree", shared_cycles_per_pop=1000.0),
    ]
    md = tree_kernels_report.to_markdown(res)
    assert "| 64 | 65 | ddtree_build_tree_r3 | 640.0 | ddtree_build_tree | 860.0 |" in md
    assert "| 256 | 257 | - | - | ddtree_build_tree | 1000 |" in md
    assert _stamp.device_slug(res["stamp"]) == "h200"
    png = tree_kernels_report.plot(res, tmp_path / "x.png")
    assert png is None or png.stat().st_size > 0


def test_the_sampled_merge_is_forced_only_inside_its_block():
    """``--sampled-merge`` times the sampled merge beside the register merge of the bs-1 plans."""
    from lab.bench import topk_kernels as tkk
    from sglang_ddtree.kernels import topk

    assert topk.split_plan(7, tkk.VOCAB, 64).merge_chunk == 0  # bs 1, depth 7: 16 lists in registers
    with tkk._merge_forced("sampled"):
        assert topk.split_plan(7, tkk.VOCAB, 64).merge_chunk > 0
    with tkk._merge_forced(None):
        assert topk.split_plan(7, tkk.VOCAB, 64).merge_chunk == 0
    assert topk.split_plan(7, tkk.VOCAB, 64).merge_chunk == 0


def test_topk_report():
    from lab.bench import topk_kernels as tkk

    rows = []
    for block in tkk.BLOCKS:
        for bs in tkk.BATCH_SIZES:
            for k in tkk.KS:
                split = 5.0 + bs * (block - 1) / 16 + k / 64
                rows.append(
                    dict(
                        block=block,
                        depth=block - 1,
                        bs=bs,
                        k=k,
                        rows=bs * (block - 1),
                        splits=12,
                        slice_len=13656,
                        split_us=split,
                        row_us=60.0 + bs,
                        speedup=(60.0 + bs) / split,
                        torch_lse_us=2.0 + bs / 2,
                        torch_topk_us=40.0 + bs,
                        forced_splits=None,
                        merge="auto",
                    )
                )
    rows.append({**rows[3], "merge": "sampled", "split_us": 99.0})  # bs 1, block 8, k 64: the other merge
    res = {
        "stamp": {"device": "NVIDIA H200"},
        "vocab": tkk.VOCAB,
        "config": {"calls": 5, "reps": 30},
        "topk": rows,
    }
    res["targets"] = tkk.evaluate_targets(res)
    t = res["targets"]
    assert t["bs1_block8_us"]["value"] == 5.0 + 7 / 16 + 1  # the served (automatic) plan only
    assert t["bs1_block16_us"]["value"] == 5.0 + 15 / 16 + 1 and t["bs1_block16_us"]["met"]
    assert t["bs64_block8_us"]["value"] == 5.0 + 64 * 7 / 16 + 1 and t["bs64_block8_us"]["met"]
    assert not t["bs64_block16_us"]["met"]  # 66.0 us
    res["copy_gbs"] = 8000.0
    res["phases"] = [
        dict(
            block=8,
            bs=64,
            k=64,
            rows=448,
            splits=12,
            cut5_us=40.0,
            cut6_us=50.0,
            cut1_us=60.0,
            cut2_us=80.0,
            cut4_us=120.0,
            cut3_us=150.0,
            cut0_us=201.0,
        )
    ]
    md = tkk.to_markdown(res)
    assert "## The split kernel stopped after each phase (cumulative us)" in md
    assert "| 8 | 64 | 64 | 448 | 12 | 40.0 | 50.0 | 60.0 | 80.0 | 120.0 | 150.0 | 201.0 |" in md
    assert "| bs64_block16_us | 66.0 | 64 | <= 60 us | MISSED |" in md
    assert "bs 64 x depth 15: 39.3 us" in md  # 315 MB read once at 8000 GB/s
    assert "| split kernel | row kernel | x | torch logsumexp | torch topk |" in md
    assert "| 64 | 64 | 448 | 12 | auto | 13656 | 34.0 | 124.0 | 3.65 | 34.0 | 104.0 |" in md


def test_posterior_follows_the_tree_to_its_leaves():
    """The benchmark's target picks a child of every slot that has one (so the accept walk
    goes down to a leaf): its token at each slot is one of the slot's children's tokens."""
    width = 6
    # two trees: 0 -> (1, 2), 1 -> 3, 3 -> 4; and a chain 0 -> 1 -> 2
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1], [-1, 0, 1, -1, -1, -1]])
    tokens = torch.tensor([[5, 11, 12, 13, 14, 0], [7, 21, 22, 0, 0, 0]])
    first, second = tree_kernels_cases.first_two_children(parents)
    assert first.tolist() == [[1, 3, -1, 4, -1, -1], [1, 2, -1, -1, -1, -1]]
    assert second.tolist() == [[2, -1, -1, -1, -1, -1], [-1] * width]
    picks_second = False
    for seed in range(20):
        post = tree_kernels_cases.posterior_following(tokens, parents, seed)
        assert post.shape == tokens.shape
        assert post[0, 0] in (11, 12) and post[0, 1] == 13 and post[0, 3] == 14
        assert post[1, :2].tolist() == [21, 22]
        picks_second |= bool(post[0, 0] == 12)
    assert picks_second  # the second child is taken too (30% of the time)


def test_case_and_draft_logits():
    gen = torch.Generator().manual_seed(3)
    logits = tree_kernels_cases.draft_logits(2, 3, gen)
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 3, tree_kernels_cases.VOCAB)
    # reproducible from the seed, and drawn from the caller's generator (which then draws the roots)
    again = tree_kernels_cases.draft_logits(2, 3, torch.Generator().manual_seed(3))
    assert torch.equal(logits, again)
    assert gen.initial_seed() == 3 and not torch.equal(
        gen.get_state(), torch.Generator().manual_seed(3).get_state()
    )
    lp, ids = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int64)
    case = tree_kernels_cases.Case(8, 4, 2, lp, ids, torch.zeros(2), torch.zeros(2))
    assert (case.depth, case.width, str(case)) == (7, 5, "block=8 budget=4 bs=2")
    assert [a.shape for a in case.on_host()] == [(2, 3, 4), (2, 3, 4), (2,), (2,)]


def test_plots_draw_beside_the_gpu_bundles_ipython_stand_in(tmp_path):
    """The GPU bundle ships a stand-in IPython (sglang imports IPython.display); a bench that
    imports sglang's kernels must still draw its PNG with that stand-in loaded."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("matplotlib")  # plot_lines draws nothing without it
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys, IPython, IPython.display\n"
        "assert 'shims' in IPython.__file__, IPython.__file__\n"
        "from lab.bench._stamp import plot_lines\n"
        "from pathlib import Path\n"
        f"out = plot_lines(Path(r'{tmp_path / 'p.png'}'), {{'a': ([1, 2], [3, 4])}}, title='t', xlabel='x', ylabel='y')\n"
        "assert out is not None and out.stat().st_size > 0\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{root / 'gpu' / 'shims'}:{root}", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
