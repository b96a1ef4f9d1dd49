"""Tree build and accept: the Python reference vs the C++ builder vs the CUDA kernels.

For every block size (8, 16: depth = block - 1), budget (16 ... 256) and batch size
(1 ... 64), with vocabulary 163840:

* **build** - from per-depth top-k log-probs on the GPU to the verify layout on the GPU
  (tokens, depths, parents, tree sizes, positions, bit-packed ancestor mask):
  ``python`` = device->host copy, ``build_tree_batch_ref`` + ``pack_mask_words``, host->device
  copy (what the SGLang ports pay); ``cpp`` = the same with the C++ builder; ``gpu`` = the
  build kernel;
* **accept** - tree + target posterior on the GPU to path / accept lengths / bonus /
  output tokens on the GPU: ``python`` (``accept_walk_ref`` with both copies),
  ``torch`` (the batched torch walk of ``tree/batched.py``, one step per depth), ``gpu``;
* **top-k** - draft logits (bf16) to top-k log-probs + ids, exact ties: the split-vocabulary
  kernel and the one-block-per-row kernel, and at budget 64 the torch path with the same
  result and plain ``torch.topk`` (whose ties are not pinned) for scale (``--topk-only``: just
  this part, see ``topk_kernels.py``).

GPU times are CUDA-graph replays (``calls`` launches per graph, time per launch; the median
of ``reps`` replays): what a captured decode step sees. CPU times are wall clock around the
whole round trip (median). Every configuration is first checked: the GPU and C++ trees must
equal the reference.

    python -m lab.bench.tree_kernels              # -> results/tree_kernels_<device>.*
    python -m lab.bench.tree_kernels --quick      # a few configurations
    python -m lab.bench.tree_kernels --topk-only  # top-k kernels only (a minute)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from lab.bench import _stamp
from lab.bench.topk_kernels import add_arguments as add_topk_arguments
from lab.bench.topk_kernels import time_topk
from lab.bench.tree_kernels_cases import VOCAB, Case, draft_logits, posterior_following
from lab.bench.tree_kernels_report import evaluate_targets, plot, to_markdown
from sglang_ddtree.tree.types import Trees

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
BUDGETS = (16, 32, 64, 128, 256)
BLOCKS = (8, 16)


def _median_wall(fn, reps: int) -> float:
    """Median wall time (s) of ``fn`` with the GPU idle before and synchronised after."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graph_us(fn, calls: int, reps: int) -> float:
    return _stamp.time_graph(fn, reps=reps, warmup=2, calls_per_graph=calls)["median_ms"] * 1e3


def run(args) -> dict:
    from sglang_ddtree.kernels import cpp, gpu

    dev = torch.device("cuda")
    batch_sizes = args.batch_sizes
    budgets = args.budgets
    blocks = args.blocks
    stamp = _stamp.stamp()
    try:
        cpp.load_module()
        args.cpp_error = None
    except Exception as exc:  # noqa: BLE001 - no compiler / headers: time the rest
        args.cpp_error = f"{type(exc).__name__}: {str(exc)[-300:]}"
        print("C++ builder unavailable, its columns stay empty:", args.cpp_error, file=sys.stderr)
    results: dict = {
        "stamp": stamp,
        "vocab": VOCAB,
        "config": vars(args).copy(),
        "build": [],
        "accept": [],
        "topk": [],
    }
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    configs = [(blk, bud, bs) for blk in blocks for bud in budgets for bs in batch_sizes]
    bar = tqdm(total=len(configs), desc="tree kernels", file=sys.stderr) if tqdm else None
    gen = torch.Generator(device=dev)
    for block in blocks:
        depth = block - 1
        gen.manual_seed(block)
        logits = draft_logits(max(batch_sizes), depth, gen)
        for budget in budgets:
            lp_all, ids_all = gpu.topk_log_probs(logits, budget)
            for bs in batch_sizes:
                lp, ids = lp_all[:bs].contiguous(), ids_all[:bs].contiguous()
                roots = torch.randint(0, VOCAB, (bs,), generator=gen, device=dev)
                prefix = torch.randint(100, 4000, (bs,), generator=gen, device=dev)
                case = Case(block, budget, bs, lp, ids, roots, prefix)
                b_row, a_row, t_row = bench_config(args, case, logits)
                results["build"].append(b_row)
                results["accept"].append(a_row)
                results["topk"].append(t_row)
                t_gpu = b_row["gpu_us"]
                if bar:
                    bar.update(1)
                    bar.set_postfix(block=block, budget=budget, bs=bs, gpu_us=f"{t_gpu:.1f}")
            del lp_all, ids_all
        del logits
        torch.cuda.empty_cache()
    if bar:
        bar.close()
    results["targets"] = evaluate_targets(results)
    return results


def bench_config(args, case: Case, logits: torch.Tensor) -> tuple[dict, dict, dict]:
    """Check and time one configuration: (build row, accept row, top-k row)."""
    from sglang_ddtree.kernels import gpu

    tree = Trees.allocate(case.bs, case.width, case.lp.device)
    gpu.build_tree_batch(case.lp, case.ids, case.roots, case.budget, case.width, case.prefix, out=tree)
    torch.cuda.synchronize()
    _check_build(case, tree, has_cpp=args.cpp_error is None)
    build_row = _time_build(args, case, tree)
    accept_row = _check_and_time_accept(args, case, tree)
    return build_row, accept_row, _time_topk(args, case, logits)


def _check_build(case: Case, tree: Trees, has_cpp: bool) -> None:
    """The GPU tree (and the C++ one) must equal the reference before anything is timed."""
    from sglang_ddtree.kernels import cpp
    from sglang_ddtree.tree.layout import build_tree_batch_ref, pack_mask_words

    lp_h, ids_h, roots_h, pre_h = case.on_host()
    ref = build_tree_batch_ref(lp_h, ids_h, roots_h, case.budget, case.width)
    ok = (
        np.array_equal(tree.tokens.cpu().numpy(), ref.tokens)
        and np.array_equal(tree.parents.cpu().numpy(), ref.parents)
        and np.array_equal(tree.mask_words.cpu().numpy(), pack_mask_words(ref.visibility))
    )
    if has_cpp:
        c = cpp.build_tree_batch(lp_h, ids_h, roots_h, case.budget, case.width, pre_h)
        ok = ok and np.array_equal(c["tokens"], ref.tokens) and np.array_equal(c["parents"], ref.parents)
    if not ok:
        raise AssertionError(f"tree mismatch at {case}")


def _time_build(args, case: Case, tree: Trees) -> dict:
    """The build row: the Python and C++ round trips (copies included) against the kernel."""
    from sglang_ddtree.kernels import cpp, gpu
    from sglang_ddtree.tree.layout import build_tree_batch_ref, pack_mask_words

    dev, budget, width = tree.tokens.device, case.budget, case.width

    def python_build():
        a, b_, r, p = case.on_host()
        batch = build_tree_batch_ref(a, b_, r, budget, width)
        outs = (
            batch.tokens,
            batch.depths,
            batch.parents,
            batch.tree_sizes,
            batch.positions(p),
            pack_mask_words(batch.visibility),
        )
        return [torch.from_numpy(np.ascontiguousarray(o)).to(dev, non_blocking=False) for o in outs]

    def cpp_build():
        a, b_, r, p = case.on_host()
        res = cpp.build_tree_batch(a, b_, r, budget, width, p)
        return [torch.from_numpy(v).to(dev) for v in res.values()]

    def gpu_build():
        gpu.build_tree_batch(case.lp, case.ids, case.roots, budget, width, case.prefix, out=tree)

    t_py = _median_wall(python_build, args.python_reps) * 1e6
    t_cpp = _median_wall(cpp_build, args.cpp_reps) * 1e6 if args.cpp_error is None else float("nan")
    t_gpu = _graph_us(gpu_build, args.calls, args.reps)
    return dict(
        block=case.block,
        depth=case.depth,
        budget=budget,
        bs=case.bs,
        python_us=t_py,
        cpp_us=t_cpp,
        gpu_us=t_gpu,
        gpu_single_graph_us=_graph_us(gpu_build, 1, args.reps),
        speedup_vs_python=t_py / t_gpu,
        speedup_vs_cpp=t_cpp / t_gpu,
        mean_tree_depth=float(tree.depths.float().max(dim=1).values.mean()),
    )


def _check_and_time_accept(args, case: Case, tree: Trees) -> dict:
    """The accept row, on a posterior that accepts deep: the kernel's path must equal the
    reference walk's; then the Python walk (copies included), the torch walk and the kernel."""
    from sglang_ddtree.kernels import gpu
    from sglang_ddtree.tree.accept import accept_walk_ref
    from sglang_ddtree.tree.batched import accept_walk as torch_accept_walk

    dev = tree.tokens.device
    post = posterior_following(tree.tokens, tree.parents, case.bs + case.budget)
    acc = gpu.allocate_acceptance(case.bs, case.width, dev)
    walk_inputs = (tree.tokens, tree.parents, tree.tree_sizes, post)
    gpu.accept_walk(*walk_inputs, case.prefix, acc)
    torch.cuda.synchronize()
    ref_acc = accept_walk_ref(*(x.cpu().numpy() for x in walk_inputs))
    if not torch.equal(acc.path.cpu(), ref_acc.path):
        raise AssertionError(f"accept mismatch at {case}")

    def python_accept():
        a = accept_walk_ref(*(x.cpu().numpy() for x in walk_inputs))
        return [v.to(dev) for v in (a.path, a.accept_lens, a.bonus, a.out_tokens)]

    a_py = _median_wall(python_accept, args.python_reps) * 1e6
    a_gpu = _graph_us(lambda: gpu.accept_walk(*walk_inputs, case.prefix, acc), args.calls, args.reps)
    a_torch = _graph_us(lambda: torch_accept_walk(*walk_inputs, max_depth=case.depth), 1, args.reps)
    return dict(
        block=case.block,
        budget=case.budget,
        bs=case.bs,
        python_us=a_py,
        torch_us=a_torch,
        gpu_us=a_gpu,
        mean_accept_len=float(acc.accept_lens.float().mean()),
    )


def _time_topk(args, case: Case, logits: torch.Tensor) -> dict:
    """The top-k row (the preprocessing): the split-vocabulary kernel and the one-block-per-row
    kernel; at budget 64 also the exact torch path and plain ``torch.topk`` for scale."""
    from sglang_ddtree.kernels import gpu

    x, budget = logits[: case.bs], case.budget
    t = time_topk(x, budget, max(1, args.calls // 4), args.reps)
    row = dict(
        block=case.block,
        budget=budget,
        bs=case.bs,
        gpu_us=t["split_us"],
        row_kernel_us=t["row_us"],
        splits=t["splits"],
    )
    if budget == 64:
        row["torch_exact_us"] = _graph_us(lambda: gpu.topk_log_probs_torch(x, budget), 1, args.reps)
        row["torch_topk_inexact_us"] = _graph_us(
            lambda: (
                torch.topk(x.float(), budget, dim=-1).values - torch.logsumexp(x.float(), -1, keepdim=True)
            ),
            1,
            args.reps,
        )
    return row


def pop_cycles(budgets=(16, 31, 32, 64, 95, 128, 159, 256), depth: int = 15, vocab: int = 163840) -> list:
    """Cycles per pop of the build kernels' best-first search, from ``clock64`` around the
    search (the kernel source compiled with ``-DDDT_TIME_POPS``; the timing build writes the
    count into ``positions[:, 0]``). One request, width budget + 1; the register-heap kernel
    the launcher picks and the shared-memory heap, on the same inputs."""
    import cupy

    from sglang_ddtree.kernels import gpu
    from sglang_ddtree.kernels._cupy import NVRTC_OPTIONS, kernel_source, ptr

    module = cupy.RawModule(code=kernel_source("ddtree_tree"), options=(*NVRTC_OPTIONS, "-DDDT_TIME_POPS"))
    dev = torch.device("cuda")
    rows = []
    for budget in budgets:
        width = budget + 1
        gen = torch.Generator(device=dev).manual_seed(budget)
        lp, ids = gpu.topk_log_probs(torch.randn(1, depth, vocab, generator=gen, device=dev) * 3, budget)
        roots = torch.zeros(1, dtype=torch.int64, device=dev)
        smem, staged = gpu.build_smem_bytes(width, depth, budget)
        row = {"budget": budget, "width": width}
        for label, registers in (("registers", True), ("shared", False)):
            name = gpu.build_kernel_name(width, registers and staged)
            if registers and name == "ddtree_build_tree":
                continue
            fn = module.get_function(name)
            fn.max_dynamic_shared_size_bytes = smem
            out = Trees.allocate(1, width, dev)
            args = (ptr(lp), ptr(ids), ptr(roots), ptr(roots), depth, budget, budget, width, int(staged))
            outs = tuple(ptr(t) for t in (out.tokens, out.depths, out.parents, out.tree_sizes, out.positions))
            counts = []
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                for _ in range(20):
                    fn(
                        (1,),
                        (gpu._BUILD_THREADS,),
                        (*args, *outs, ptr(out.mask_words)),
                        shared_mem=smem,
                    )
                    torch.cuda.synchronize()
                    counts.append(int(out.positions[0, 0]) / budget)
            row[f"{label}_kernel"] = name
            row[f"{label}_cycles_per_pop"] = statistics.median(counts)
        rows.append(row)
    return rows


def single_pass(vocab: int, bs: int, budget: int, depth: int, repeat: int = 2) -> None:
    """Every kernel on one small case, ``repeat`` times (for ncu / compute-sanitizer runs)."""
    from sglang_ddtree.kernels import gpu

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(bs, depth, vocab, generator=gen, device=dev) * 2).bfloat16()
    roots = torch.randint(0, vocab, (bs,), generator=gen, device=dev)
    prefix = torch.randint(0, 300, (bs,), generator=gen, device=dev)
    width = budget + 1
    tree = Trees.allocate(bs, width, dev)
    acc = gpu.allocate_acceptance(bs, width, dev)
    mask = torch.empty(bs * width * (300 + width), dtype=torch.bool, device=dev)
    for _ in range(repeat):
        lp, ids = gpu.topk_log_probs(logits, budget)
        gpu.build_tree_batch(lp, ids, roots, budget, width, prefix, out=tree)
        gpu.flat_custom_mask(tree.mask_words, prefix, mask)
        post = posterior_following(tree.tokens, tree.parents, 1)
        gpu.accept_walk(tree.tokens, tree.parents, tree.tree_sizes, post, prefix, acc)
    torch.cuda.synchronize()
    print("single pass done: accept lens", acc.accept_lens.tolist())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output directory (default: results/)")
    p.add_argument("--quick", action="store_true", help="bs 1, 8, 64; budgets 32, 64; block 16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    p.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    p.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS))
    p.add_argument("--reps", type=int, default=30, help="graph replays per GPU timing")
    p.add_argument("--calls", type=int, default=20, help="launches per graph")
    p.add_argument("--python-reps", type=int, default=3)
    p.add_argument("--cpp-reps", type=int, default=15)
    p.add_argument(
        "--single",
        action="store_true",
        help="run every kernel twice on one small case and exit (for ncu / compute-sanitizer)",
    )
    p.add_argument("--vocab", type=int, default=VOCAB, help="with --single and --topk-only")
    p.add_argument(
        "--pop-cycles",
        action="store_true",
        help="cycles per pop of each build kernel (clock64 around the search; adds a table)",
    )
    p.add_argument(
        "--topk-only",
        action="store_true",
        help="only the draft top-k kernels (bs 1, 8, 32, 64 unless --batch-sizes; k from --ks): "
        "-> results/topk_kernels_<device>.*",
    )
    add_topk_arguments(p)
    args = p.parse_args(argv)
    if args.topk_only:
        from lab.bench import topk_kernels

        if args.batch_sizes == list(BATCH_SIZES):
            args.batch_sizes = list(topk_kernels.BATCH_SIZES)
        args.calls = max(1, args.calls // 4)
        return topk_kernels.run_and_write(args)
    if args.single:
        single_pass(args.vocab, args.batch_sizes[0], args.budgets[0], args.blocks[0] - 1)
        return 0
    if args.quick:
        args.batch_sizes, args.budgets, args.blocks = [1, 8, 64], [32, 64], [16]
    if not torch.cuda.is_available():
        print("tree_kernels: needs a CUDA GPU (and CuPy)", file=sys.stderr)
        return 2
    t0 = time.time()
    results = run(args)
    if args.pop_cycles:
        results["pop_cycles"] = pop_cycles()
    results["wall_s"] = time.time() - t0
    results["notes"] = [
        "- Python and C++ times include the device->host copy of the top-k inputs and the "
        "host->device copy of the layout (tokens, depths, parents, sizes, positions, mask words), "
        "as an SGLang port with a CPU builder pays them.",
        "- GPU build = one kernel (one block per request; warp 0 pops the heap, the block writes the "
        "layout): the register-heap kernel for widths up to 160 (budget <= 159), the shared-memory "
        "heap above. 'GPU (1/graph)' is one launch per graph replay: the graph launch overhead "
        "included.",
        f"- Whole run: {results['wall_s']:.0f} s.",
    ]
    out_dir = _stamp.results_dir(args.out)
    name = f"tree_kernels_{_stamp.device_slug(results['stamp'])}" + ("_quick" if args.quick else "")
    paths = _stamp.write_outputs(out_dir, name, results, to_markdown(results))
    png = plot(results, out_dir / f"{name}.png")
    print(to_markdown(results).split("## Build")[0])
    print("wrote", *[str(x) for x in paths], png or "(no matplotlib: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
