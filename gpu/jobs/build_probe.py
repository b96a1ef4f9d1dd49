"""GPU job: map where the CUDA tree-build kernel faults. Runs configurations in a child
process, printing each before its launch; a fault kills the child (the CUDA context is
lost), the parent records the configuration and resumes after it.

    bash gpu/device.sh python gpu/jobs/build_probe.py
"""

import subprocess
import sys

CHILD = r'''
import sys, numpy as np, torch
sys.path.insert(0, "tests")
from kernel_cases import random_topk, reference_tree
from sglang_ddtree.kernels import gpu
from sglang_ddtree.tree.build import topk_log_probs
start = int(sys.argv[1])
configs = []
for regs in (True, False):
    for budget, k in ((16, 16), (15, 16), (16, 8), (17, 17), (20, 20), (24, 24), (31, 31), (7, 7), (32, 32)):
        for ties in ("none", "bf16", "pairs"):
            for seed in range(4):
                configs.append((regs, budget, k, ties, seed))
for i, (regs, budget, k, ties, seed) in enumerate(configs):
    if i < start:
        continue
    print(f"CFG {i} regs={regs} budget={budget} k={k} ties={ties} seed={seed}", flush=True)
    rng = np.random.default_rng(seed)
    if ties == "bf16":
        g = torch.Generator().manual_seed(seed)
        t = topk_log_probs((torch.randn(7, 4096, generator=g) * 6).to(torch.bfloat16).float(), k)
        lp, ids = np.asarray(t.log_probs)[None].astype(np.float32), np.asarray(t.token_ids)[None].astype(np.int64)
    else:
        lp, ids = random_topk(rng, 1, 7, 4096, k, "none" if ties == "none" else "dup")
    out = gpu.build_tree_batch(torch.tensor(lp, device="cuda"), torch.tensor(ids, device="cuda"),
                               torch.tensor([5], device="cuda"), budget, budget + 1,
                               torch.tensor([100], device="cuda"), heap_in_registers=regs)
    torch.cuda.synchronize()
    ref = reference_tree(lp, ids, np.array([5]), budget, budget + 1, np.array([100]))
    same = all(np.array_equal(getattr(out, key).cpu().numpy(), ref[key]) for key in ("tokens", "parents", "depths"))
    print(f"OK {i} same={same}", flush=True)
print("DONE", flush=True)
'''

start, faults = 0, []
while True:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(start)], capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    mism = [ln for ln in lines if ln.startswith("OK") and "same=False" in ln]
    if mism:
        print("MISMATCH", mism[:10], flush=True)
    if "DONE" in lines:
        break
    last = [ln for ln in lines if ln.startswith("CFG")]
    if not last:
        print("child failed before any configuration:", proc.stderr[-2000:], flush=True)
        break
    faults.append(last[-1])
    print("FAULT", last[-1], "|", proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else "", flush=True)
    start = int(last[-1].split()[1]) + 1
print(f"{len(faults)} faults", flush=True)
