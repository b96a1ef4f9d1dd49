"""The drafter's block attention through the split-KV decode == SGLang's own kernel == float32.

On CPU, under Triton's interpreter in float32 (``draft_attention_cases.main``): the plugin's hook
on the backend's launch, SGLang's ``extend_attention_fwd`` and a torch reference on the same
SGLang-laid-out tensors (scattered slots, uneven and empty prefixes, GQA), calls outside the
contract left to SGLang, and the start-up self-check. On the GPU in bfloat16 at the K2.6 rank's
drafter shape (8 query heads, 1 KV head per rank) and the trained pair's, and through a CUDA-graph
replay whose prefixes changed after capture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_cases import run_under_triton_interpreter

HERE = Path(__file__).parent


def test_block_decode_matches_sglang_in_triton_interpreter():
    run_under_triton_interpreter(HERE / "draft_attention_cases.py")


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 1, 128), (4, 2, 64)])
@pytest.mark.parametrize("width", [8, 16])
def test_block_decode_matches_sglang_on_gpu(width, heads, kv_heads, head_dim):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from draft_attention_cases import make_case, reference, rel, sglang_kernel, through_hook

    case = make_case(
        [4096, 1, 3000, 0, 96], width, heads, kv_heads, head_dim, torch.bfloat16, "cuda", seed=width
    )
    decoded, fell_back = through_hook(case)
    assert not fell_back and torch.isfinite(decoded).all()
    assert rel(decoded, reference(case)) < 1e-2 and rel(decoded, sglang_kernel(case)) < 2e-2


@pytest.mark.gpu
def test_block_decode_replays_under_cuda_graph_with_new_prefixes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from draft_attention_cases import make_case, reference, rel, through_hook

    shape = dict(width=8, heads=8, kv_heads=1, head_dim=128, dtype=torch.bfloat16, device="cuda")
    captured = make_case([2000, 5], seed=1, slots=6000, **shape)
    after = make_case([7, 3000], seed=2, slots=6000, **shape)
    grown = torch.zeros(
        max(captured["kv_indices"].numel(), after["kv_indices"].numel()), dtype=torch.int64, device="cuda"
    )
    grown[: captured["kv_indices"].numel()] = captured["kv_indices"]
    captured["kv_indices"] = grown  # the graph's buffer holds the largest layout
    through_hook(captured)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, fell_back = through_hook(captured)
    assert not fell_back
    for name in ("q", "k_buffer", "v_buffer", "kv_indptr", "block_loc"):
        captured[name].copy_(after[name])
    captured["kv_indices"][: after["kv_indices"].numel()] = after["kv_indices"]
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, reference(after)) < 1e-2


@pytest.mark.gpu
def test_the_start_up_self_check_passes_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from sglang_ddtree.adapter.attention.draft_attention import self_check

    def sglang(layer, *args):
        extend_attention_fwd(*args[:15], sm_scale=args[15])

    assert self_check(sglang, 8, 1, 128, torch.bfloat16, torch.device("cuda")) is None


def test_the_scratch_holds_the_graph_max_batch_or_32_without_graphs(monkeypatch):
    from types import SimpleNamespace

    import sglang.srt.runtime_context as context

    from sglang_ddtree.adapter.attention import draft_attention

    for config, want in ((SimpleNamespace(decode=SimpleNamespace(bs=[1, 2, 48, 16])), 48), (None, 32)):
        monkeypatch.setattr(
            context, "get_exec", lambda c=config: SimpleNamespace(graph=SimpleNamespace(cuda_graph_config=c))
        )
        draft_attention._graph_max_bs.cache_clear()
        assert draft_attention._graph_max_bs() == want
    draft_attention._graph_max_bs.cache_clear()
