"""CPU-testable parts of the GPU benchmarks: shape bookkeeping, weight packing, reports,
the multi-process all-reduce orchestration (gloo), and the tree-attention kernels' logic
(Triton interpreter, float32)."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lab.bench import jit_bundle
from lab.bench import mla_tree_attention as mla
from lab.bench import moe_layer as layer
from lab.bench import moe_report as report
from lab.bench import moe_verify as mv
from sglang_ddtree.kernels import mla_tree_attention as kern

# --------------------------------------------------------------------------- MoE bookkeeping


@pytest.mark.parametrize("m, touched", [(1, 8), (16, 110), (32, 188), (64, 284), (128, 358)])
def test_expected_experts_touched_matches_anchors(m, touched):
    assert layer.expected_experts_touched(m) == pytest.approx(touched, abs=0.6)


def test_expert_bytes_reproduce_anchor_bandwidth():
    full = layer.MoEShape()
    # 8 experts in 0.219 ms streamed 905 GB/s in docs/anchors.md
    assert 8 * full.expert_weight_bytes() / 0.219e-3 / 1e9 == pytest.approx(905, rel=0.01)
    shard = layer.MoEShape(ffn=256)
    assert shard.expert_weight_bytes() * 8 == pytest.approx(full.expert_weight_bytes(), rel=1e-9)


@pytest.mark.parametrize("m, block", [(1, 8), (32, 8), (256, 8), (512, 16), (1024, 32), (4096, 64)])
def test_marlin_block_size(m, block):
    assert layer.marlin_block_size_m(m, 8, 384) == block


@pytest.mark.parametrize(
    "m, path", [(1, "single_token"), (2, "small_numel"), (8, "small_numel"), (9, "jit_align")]
)
def test_align_path(m, path):
    assert layer.align_path(m, 8, 384) == path


def test_plateau_and_compute_onset_on_anchor_curve():
    ms = sorted(report.ANCHOR_H200)
    full = [report.ANCHOR_H200[m][0] for m in ms]
    shard = [report.ANCHOR_H200[m][1] for m in ms]
    assert mv.plateau_m(ms, full) == 256
    assert mv.plateau_m(ms, shard) == 256
    assert mv.compute_bound_onset(ms, full) == 512
    assert mv.compute_bound_onset(ms, shard) is None
    assert mv.plateau_m([1, 2], [1.0, 2.0]) is None  # no M=512 point


def test_gptq_int4_dequant_roundtrip():
    g = torch.Generator().manual_seed(0)
    K, N, G = 64, 24, 32
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int64)
    packed = torch.zeros(K // 8, N, dtype=torch.int64)
    for i in range(8):
        packed |= q[i::8] << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    scales = torch.rand(K // G, N, generator=g).to(torch.bfloat16)
    w = layer.dequant_gptq_int4(packed, scales, G)
    assert torch.equal(w, (q.float() - 8) * scales.float().repeat_interleave(G, 0))
    rp, rs = layer.random_gptq_int4(3, 64, 32, 32, g, "cpu")
    assert rp.shape == (3, 8, 32) and rp.dtype == torch.int32 and rs.shape == (3, 2, 32)


def _fake_moe_result():
    def moe_rows(scale):
        out = []
        for m in layer.M_SWEEP:
            t = scale * (0.2 + 0.01 * m**0.8)
            out.append({
                "M": m, "experts_touched": min(384, 8 * m), "align_path": layer.align_path(m, 8, 384),
                "core_eager": t * 1.1, "core_graph": t, "core_combine_graph": t * 1.02, "router_graph": 0.01,
                "us_per_token_eager": 1e3 * t * 1.1 / m, "us_per_token_graph": 1e3 * t / m,
                "weight_gbs_graph": 3000.0, "bw_frac_graph": 0.7, "layer_graph": t * 1.05,
            })  # fmt: skip
        return out

    checks = [{"M": 1, "align_path": "single_token", "rel_err": 3e-3, "ok": True}]
    plateau = {k: {"plateau_m": 256, "compute_bound_onset_m": 512} for k in ("eager", "graph")}
    dense_rows = [
        {"M": m, "graph": 0.05, "weight_gbs_graph": 3500.0, "bw_frac_graph": 0.8} for m in layer.M_SWEEP
    ]
    return {
        "stamp": {"device": "test", "commit": "abc"},
        "copy_gbs": 4300.0,
        "matmul_tflops": 780.0,
        "import_s": 1.0,
        "jit_s": 2.0,
        "reps": 30,
        "moe": {
            f"ffn{f}": {
                "shape": {**vars(layer.MoEShape(ffn=f))},
                "expert_weight_bytes": layer.MoEShape(ffn=f).expert_weight_bytes(),
                "checks": checks,
                "rows": moe_rows(1 if f == 2048 else 0.2),
                "plateau": plateau,
            }
            for f in (2048, 256)
        },  # fmt: skip
        "dense": {
            n: {"rows": dense_rows}
            for n in ("shared_ffn2048", "shared_ffn256", "dense_ffn18432", "dense_ffn2304")
        },
    }


def test_moe_report_renders(tmp_path):
    res = _fake_moe_result()
    md = report.render_markdown(res)
    assert "Plateau M" in md and "anchor ms" in md and "| 1024 |" in md
    pytest.importorskip("matplotlib")
    assert report.plot(res, tmp_path / "x.png").exists()


def test_bundle_names_match_load_jit_names():
    names = [jit_bundle._bundle_so_name(m, a) for m, _, a in jit_bundle.BUNDLE_VARIANTS]
    assert names[0] == "sgl_kernel_jit_moe_wna16_marlin_bf16_t_false_false_true_false_true.so"
    assert names[1] == "sgl_kernel_jit_moe_wna16_marlin_bf16_t_false_false_true_true_true.so"
    assert "sgl_kernel_jit_moe_align_single_token_true_true.so" in names
    assert "sgl_kernel_jit_gptq_marlin_repack.so" in names


# --------------------------------------------------------------------------- TP all-reduce orchestration


@pytest.mark.slow  # two rank processes importing SGLang: ~50 s on the CI machine
def test_tp_allreduce_dry_run_two_ranks(tmp_path):
    from lab.bench import moe_tp_allreduce as tp

    argv = ["--dry-run", "--world", "2", "--hidden", "128", "--ffn", "64", "--reps", "2", "--ms", "1", "4"]
    assert tp.main(argv + ["--out", str(tmp_path), "--name", "dry"]) == 0
    res = json.loads((tmp_path / "dry.json").read_text())
    assert res["world"] == 2 and res["dry_run"] is True
    assert [r["M"] for r in res["rows"]] == [1, 4]
    for r in res["rows"]:
        assert r["moe_ms_max"] > 0 and r["allreduce_ms_max"] > 0 and r["total_ms_max"] > 0
        assert r["scaling"] > 0 and "one_gpu_full_ms" in r
    # NVLink multicast was off in every process
    assert res["env_per_rank"] == [tp.MULTICAST_OFF, tp.MULTICAST_OFF]
    assert (tmp_path / "dry.md").read_text().startswith("# TP-2 MoE")


def test_tp_summary_takes_slowest_rank_and_baseline_json(tmp_path):
    from lab.bench import moe_tp_report

    rows = lambda s: [{"M": 8, "moe_ms": s, "allreduce_ms": 0.02, "total_ms": s + 0.02, "modes": ["g"] * 3}]  # noqa: E731
    raw = {"per_rank": [{"rows": rows(0.2), "env": {}}, {"rows": rows(0.3), "env": {}}]}
    base = tmp_path / "b.json"
    base.write_text(json.dumps({"moe": {"ffn2048": {"rows": [{"M": 8, "core_combine_graph": 0.64}]}}}))
    s = moe_tp_report.summarise(raw, 2, str(base))
    (r,) = s["rows"]
    assert r["moe_ms_max"] == 0.3 and r["moe_ms_mean"] == pytest.approx(0.25)
    assert r["scaling"] == pytest.approx(0.64 / 0.32) and r["scaling_efficiency"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- tree attention


def test_ancestor_mask_is_a_tree_mask():
    g = torch.Generator().manual_seed(0)
    parents = mla.random_tree_parents(40, g)
    m = mla.ancestor_mask(parents)
    assert all(parents[i] < i for i in range(1, 40)) and parents[0] == -1
    assert bool(m.diagonal().all()) and bool(m[:, 0].all())  # itself, and the root
    assert not bool(torch.triu(m, 1).any())  # ancestors come first
    for i in range(1, 40):  # a node sees exactly its parent's set plus itself
        expect = m[parents[i]].clone()
        expect[i] = True
        assert torch.equal(m[i], expect)


def test_naive_attention_equals_per_row_softmax():
    p = mla.make_problem(2, 37, 5, 3, device="cpu", seed=4)
    out = kern.naive_tree_attention(p, fp32=True)
    pre = kern.prefix_view(p).float()
    for b in range(2):
        for w in range(5):
            keys = torch.cat([pre[b], p.k_tree[b].float()[p.tree_mask[b, w].bool()]])
            for h in range(3):
                s = keys @ p.q[b, w, h].float() * kern.SM_SCALE
                ref = torch.softmax(s, 0) @ keys[:, : kern.D_LATENT]
                assert torch.allclose(out[b, w, h], ref, atol=1e-5, rtol=1e-5)
    # chunking over requests changes nothing beyond float32 reassociation (the batched and the
    # per-request matmuls sum in different orders: ~1e-6 on values of ~3 on some CPUs)
    assert torch.allclose(kern.naive_tree_attention(p, fp32=True, max_elems=1), out, atol=1e-5, rtol=1e-5)


def test_accounting():
    assert mla.prefix_bytes(4, 8192) == 4 * 8192 * 576 * 2
    pre, tail = mla.attention_flops(1, 1000, 17, 8)
    assert pre == 17 * 8 * 1000 * 2 * (576 + 512) and tail == 17 * 8 * 17 * 2 * (576 + 512)
    assert mla.roofline(4.3e9, 1.0, 4300.0, 800.0) == {"floor_ms": pytest.approx(1.0), "bound": "memory"}
    assert mla.roofline(1.0, 8e11, 4300.0, 800.0)["bound"] == "compute"
    assert kern.choose_splits(1, 8, 32768, 64, 132) == 64
    assert kern.choose_splits(64, 520, 1024, 64, 132) == 1
    assert kern.choose_splits(1, 136, 1000, 64, 132) == 4  # at least 256 keys per split
    assert kern.choose_d_chunks(1, 8, 132) == 8 and kern.choose_d_chunks(64, 520, 132) == 1


_INTERP = textwrap.dedent(
    """
    import torch
    from lab.bench import mla_tree_attention as bench
    from sglang_ddtree.kernels import mla_tree_attention as m
    from sglang_ddtree.kernels.compare import relative_difference
    worst = 0.0
    for bs, L, W, H, ns in [(2, 300, 6, 2, 3), (1, 70, 1, 3, 1), (2, 129, 9, 4, 13), (1, 17, 20, 1, 2)]:
        p = bench.make_problem(bs, L, W, H, device="cpu", seed=L + ns)
        for f in ("q", "kv_pool", "k_tree"):  # the interpreter's bf16 dot is not faithful
            setattr(p, f, getattr(p, f).float())
        att = m.SplitTreeAttention(p, m.SplitConfig(16, 16, 4, 1), sms=4)
        att.set_splits(ns)  # includes splits past the end of the prefix
        att.out.fill_(float("nan"))
        got = att().clone()
        assert torch.isfinite(got).all()
        ref = m.naive_tree_attention(p, fp32=True)
        worst = max(worst, relative_difference(got, ref))
        att.out.fill_(float("nan"))
        att.partials(contiguous=True)  # index arithmetic instead of the gather: same result here
        att.combine()
        worst = max(worst, relative_difference(att.out.view_as(got), ref))
    print(worst)
    """
)


def test_split_kernels_match_reference_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", _INTERP], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-5


def test_mla_report_renders(tmp_path):
    row = {
        "heads": 8, "n_nodes": 17, "budget": 16, "bs": 16, "prefix": 8192, "split_ms": 0.1, "prefix_ms": 0.08,
        "merge_ms": 0.02, "naive_ms": 1.0, "speedup_vs_naive": 10.0, "prefix_bw_frac": 0.5,
        "prefix_mm_frac": 0.4, "prefix_bound": "compute", "prefix_roofline_frac": 0.6,
    }  # fmt: skip
    check = {
        "heads": 8,
        "n_nodes": 17,
        "prefix": 1000,
        "rel_err_split": 3e-3,
        "rel_err_naive": 6e-3,
        "ok": True,
    }
    res = {"stamp": {"device": "t"}, "copy_gbs": 4300.0, "matmul_tflops": 780.0, "tuned": {"H8_W17": "x"},
           "checks": [check, {"ok": None, "error": "x"}], "rows": [row, {**row, "naive_ms": None, "speedup_vs_naive": None}]}  # fmt: skip
    res["rows"].append({**row, "prefix_contig_ms": 0.05, "prefix_contig_bw_frac": 0.8})
    md = mla.render_markdown(res)
    assert "8 heads per GPU" in md and "1/1 checks pass" in md and "did not compile" in md
    assert "| 16 | 16 | 8192 | 0.080 | 50% | 0.050 | 80% |" in md  # gather vs consecutive slots
    pytest.importorskip("matplotlib")
    assert mla.plot(res, tmp_path / "a.png").exists()
    assert math.isfinite(row["split_ms"])


def test_configs_are_timed_per_shape_beside_the_served_one():
    from lab.bench import mla_tree_configs as configs

    p = mla.make_problem(2, 64, 9, 8, device="cpu", seed=1)
    timed = []
    labels = ["M64N64w8s2", "M32N64w4s2"]
    # a stand-in timer: the attention object each config builds, priced by its tile count
    row = configs.time_configs(p, labels, 4, lambda fn: timed.append(fn) or 0.1 * len(timed))
    assert row["served_config"] == "M32N64w4s2" and list(row["prefix_ms_by_config"]) == labels
    assert len(timed) == 2
    rows = [{"heads": 8, "n_nodes": 9, "bs": 32, "prefix": 4096, **row},
            {"heads": 8, "n_nodes": 8, "bs": 32, "prefix": 4096, "served_config": "M64N64w8s2",
             "prefix_ms_by_config": {"M64N64w8s2": 0.14, "M32N64w4s2": 0.2}}]  # fmt: skip
    md = "\n".join(configs.config_lines(rows))
    assert "| 8 | 9 | 32 | 4096 | M32N64w4s2 | 0.100 | 0.200 | M64N64w8s2 |" in md
    assert "| 8 | 8 | 32 | 4096 | M64N64w8s2 | 0.140 | 0.200 | M64N64w8s2 |" in md
    assert configs.config_lines([{"heads": 8}]) == []


def test_tp_model_adds_modelled_allreduce_to_measured_shard(tmp_path):
    from lab.bench import moe_tp_allreduce as tp
    from lab.bench import moe_tp_report
    from lab.budget_model import allreduce_ms

    ref = {"stamp": {"device": "H200"}, "moe": {
        "ffn2048": {"rows": [{"M": m, "core_combine_graph": 0.1 * m} for m in (1, 64)]},
        "ffn256": {"rows": [{"M": m, "core_combine_graph": 0.02 * m} for m in (1, 64)]},
    }}  # fmt: skip
    src = tmp_path / "moe.json"
    src.write_text(json.dumps(ref))
    res = moe_tp_report.model_from_one_gpu(str(src), world=8)
    r64 = res["rows"][1]
    assert r64["allreduce_ms_max"] == pytest.approx(allreduce_ms(64 * 7168 * 2, n_gpus=8))
    assert r64["total_ms_max"] == pytest.approx(1.28 + r64["allreduce_ms_max"])
    assert r64["scaling"] == pytest.approx(6.4 / r64["total_ms_max"])
    with pytest.raises(SystemExit):
        moe_tp_report.model_from_one_gpu(str(src), world=4)  # no ffn512 sweep measured
    assert tp.main(["--model", "--baseline-json", str(src), "--out", str(tmp_path), "--name", "m"]) == 0
    assert "MODEL" in (tmp_path / "m.md").read_text()


def test_drafter_report_puts_the_decode_path_beside_sglang():
    from lab.bench.sglang_verify_attention import drafter_markdown

    row = {"bs": 1, "prefix": 4096, "block": 8, "heads": 8, "kv_heads": 1, "head_dim": 128,
           "sglang_ms": 0.21, "decode_ms": 0.03, "read_floor_ms": 0.001}  # fmt: skip
    old = {k: v for k, v in row.items() if k != "decode_ms"}  # a run from before the decode path
    md = "\n".join(drafter_markdown([row, old]))
    assert "| 1 | 4096 | 0.210 | 0.030 | 7.0x | 0.001 | 210x |" in md
    assert "| 1 | 4096 | 0.210 | - | - | 0.001 | 210x |" in md
