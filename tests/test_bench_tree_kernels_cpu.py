"""The tree-kernel benchmark's bookkeeping (targets, report, plot) on made-up numbers."""

from __future__ import annotations

from sglang_ddtree.bench import tree_kernels as tk


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
    res["targets"] = tk.evaluate_targets(res)
    t = res["targets"]
    assert t["build_vs_python_bs64_b64"]["met"] and t["build_vs_cpp_bs64_b64"]["met"]
    assert t["build_us_bs1_b32"]["value"] == 7.0 and t["build_us_bs1_b32"]["met"]
    assert t["accept_us_bs64"]["value"] == 4.0 and t["accept_us_bs64"]["met"]
    md = tk.to_markdown(res)
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
    md = tk.to_markdown(res)
    assert "| 64 | 65 | ddtree_build_tree_r3 | 640.0 | ddtree_build_tree | 860.0 |" in md
    assert "| 256 | 257 | - | - | ddtree_build_tree | 1000 |" in md
    assert tk.device_slug(res["stamp"]) == "h200"
    png = tk.plot(res, tmp_path / "x.png")
    assert png is None or png.stat().st_size > 0


def test_topk_report():
    from sglang_ddtree.bench import topk_kernels as tkk

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
                        forced_splits=None,
                    )
                )
    res = {
        "stamp": {"device": "NVIDIA H200"},
        "vocab": tkk.VOCAB,
        "config": {"calls": 5, "reps": 30},
        "topk": rows,
    }
    res["targets"] = tkk.evaluate_targets(res)
    t = res["targets"]
    assert t["bs1_block16_us"]["value"] == 5.0 + 15 / 16 + 1 and t["bs1_block16_us"]["met"]
    assert t["bs64_block8_us"]["value"] == 5.0 + 64 * 7 / 16 + 1 and t["bs64_block8_us"]["met"]
    assert not t["bs64_block16_us"]["met"]  # 66.0 us
    res["copy_gbs"] = 8000.0
    md = tkk.to_markdown(res)
    assert "| bs64_block16_us | 66.0 | 64 | <= 60 us | MISSED |" in md
    assert "bs 64 x depth 15: 78.6 us" in md
