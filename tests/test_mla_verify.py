"""The MLA tree verify served by the split kernel == SGLang's own verify kernel == float32.

On CPU, under Triton's interpreter in float32 (``mla_verify_cases.main``): the plugin's hook on
the backend's kernel launch, SGLang's ``extend_attention_fwd`` and a torch reference on the same
SGLang-laid-out tensors (scattered cache slots, uneven and empty prefixes, random trees), and a
call outside the split kernel's contract left to SGLang. On the GPU in bfloat16 at the K2.6
rank's shapes, and once more through a CUDA-graph replay whose prefixes changed after capture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_cases import run_under_triton_interpreter

HERE = Path(__file__).parent


def test_split_verify_matches_sglang_in_triton_interpreter():
    run_under_triton_interpreter(HERE / "mla_verify_cases.py")


@pytest.mark.gpu
@pytest.mark.parametrize("n_nodes", [1, 8, 17, 65])
@pytest.mark.parametrize("prefix_lens", [[96], [4096, 1, 3000, 96]])
def test_split_verify_matches_sglang_on_gpu(prefix_lens, n_nodes):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from mla_verify_cases import make_case, reference, rel, sglang_kernel, through_hook

    case, trees = make_case(prefix_lens, n_nodes, heads=8, dtype=torch.bfloat16, device="cuda", seed=n_nodes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split, fell_back = through_hook(case, sms)
    ref = reference(case, trees)
    assert not fell_back and torch.isfinite(split).all()
    assert rel(split, ref) < 1e-2 and rel(split, sglang_kernel(case)) < 2e-2


@pytest.mark.gpu
def test_split_verify_replays_under_cuda_graph_with_new_prefixes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from mla_verify_cases import make_case, reference, rel, through_hook

    W, heads = 17, 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    captured, _ = make_case([2000, 5], W, heads, torch.bfloat16, "cuda", seed=1, slots=4000)
    after, trees = make_case([7, 3000], W, heads, torch.bfloat16, "cuda", seed=2, slots=4000)
    # The graph's buffers hold the largest layout; a replay sees the new one written into them.
    for name in ("kv_indices", "custom_mask"):
        grown = torch.zeros(
            max(captured[name].numel(), after[name].numel()), dtype=captured[name].dtype, device="cuda"
        )
        grown[: captured[name].numel()] = captured[name]
        captured[name] = grown
    through_hook(captured, sms)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = through_hook(captured, sms)
    for name in ("q", "k_extend", "k_buffer", "kv_indptr", "mask_indptr"):
        captured[name].copy_(after[name])
    captured["kv_indices"][: after["kv_indices"].numel()] = after["kv_indices"]
    captured["custom_mask"][: after["custom_mask"].numel()] = after["custom_mask"]
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, reference(after, trees)) < 1e-2


def test_verify_kernel_switch_is_validated(monkeypatch):
    from sglang_ddtree.config import (
        ENV_VERIFY_ATTENTION,
        DDTreeConfigError,
        sglang_verify_attention_requested,
    )

    monkeypatch.setenv(ENV_VERIFY_ATTENTION, "sglang")
    assert sglang_verify_attention_requested()
    monkeypatch.setenv(ENV_VERIFY_ATTENTION, "split")
    assert not sglang_verify_attention_requested()
    monkeypatch.setenv(ENV_VERIFY_ATTENTION, "fast")
    with pytest.raises(DDTreeConfigError):
        sglang_verify_attention_requested()


@pytest.mark.gpu
def test_start_up_self_check_passes_on_this_gpu():
    """What a server runs before the split kernel serves: on the GPU the suite runs on it
    must agree with SGLang's kernel (else every MLA verify would stay on SGLang's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from sglang_ddtree.adapter.attention.mla_verify import _CHECKED, _checked

    class Backend:
        num_head = 8

        def _forward_extend_kernel(self, layer, *args):
            extend_attention_fwd(*args[:15], sm_scale=args[15])

    _CHECKED.clear()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert _checked(Backend(), torch.bfloat16, sms) is None
