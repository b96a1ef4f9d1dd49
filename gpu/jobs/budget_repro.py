"""GPU job: where does a DDTREE server at a given budget fail? Starts several variants at
once (tree backend x CUDA graphs, launches blocking), sends each a few greedy requests at
bs 1 and 8, and prints each server's outcome with the traceback's last lines.

    bash gpu/device.sh python gpu/jobs/budget_repro.py 16
"""

import concurrent.futures
import json
import sys
from pathlib import Path

from sglang_ddtree.launch import ServerProcess

PAIR = Path(__file__).resolve().parents[2] / "lab" / "models" / "pairs" / "pycode-4l"
budget = sys.argv[1] if len(sys.argv) > 1 else "16"
common = ["--model-path", str(PAIR / "target"), "--attention-backend", "triton", "--sampling-backend", "pytorch",
          "--max-total-tokens", "65536", "--mem-fraction-static", "0.05", "--speculative-algorithm", "DDTREE",
          "--speculative-draft-model-path", str(PAIR / "drafter"), "--speculative-ddtree-budget", budget]
variants = {
    "cuda_eager": (["--disable-cuda-graph"], {"CUDA_LAUNCH_BLOCKING": "1"}),
    "cuda_graphs": (["--cuda-graph-max-bs-decode", "32"], {"CUDA_LAUNCH_BLOCKING": "1"}),
    "python_graphs": (["--cuda-graph-max-bs-decode", "32"], {"SGLANG_DDTREE_TREE_BACKEND": "python"}),
    "cpp_eager": (["--disable-cuda-graph"], {"SGLANG_DDTREE_TREE_BACKEND": "cpp", "CUDA_LAUNCH_BLOCKING": "1"}),
}
prompts = [p["input_ids"] for p in json.loads((PAIR / "heldout_prompts.json").read_text())[:8]]


def run(name):
    flags, env = variants[name]
    server = ServerProcess(common + flags, env=env, name=name, start_timeout=400)
    try:
        server.start()
    except Exception as error:  # noqa: BLE001
        return name, f"start failed: {str(error)[-1500:]}"
    try:
        params = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
        server.generate({"input_ids": prompts[0], "sampling_params": params}, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: server.generate({"input_ids": p, "sampling_params": params}, timeout=120), prompts))
        return name, f"ok, accept length {server.accept_length()}"
    except Exception as error:  # noqa: BLE001
        return name, f"FAILED {error!r}\n" + server.log_tail(30)
    finally:
        server.stop()


with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
    for name, outcome in pool.map(run, variants):
        print(f"===== {name}: {outcome}", flush=True)
