"""The drafter's block attention laid out as SGLang's triton backend lays it out (a DFlash
block forward: target-verify mode, non-causal, no mask, GQA): the plugin's decode path behind
its hook against SGLang's own ``extend_attention_fwd`` and a float32 torch reference.

Run on CPU by ``tests/test_draft_attention.py`` under Triton's interpreter (float32), and on
the GPU by the same test in bfloat16 with a CUDA-graph replay.
"""

from __future__ import annotations

import torch

from sglang_ddtree.kernels.compare import relative_difference


def make_case(prefix_lens, width, heads, kv_heads, head_dim, dtype, device, seed=0, slots=None):
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    slots = slots or sum(prefix_lens) + bs * width + 7
    order = torch.randperm(slots, generator=gen)  # prefixes and blocks at scattered slots
    kv_indices = order[: sum(prefix_lens)].to(device)
    block_loc = order[sum(prefix_lens) : sum(prefix_lens) + bs * width].to(device)
    k_buffer = torch.randn(slots, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_buffer = torch.randn(slots, kv_heads, head_dim, generator=gen).to(device, dtype)
    return dict(
        q=torch.randn(bs * width, heads, head_dim, generator=gen).to(device, dtype),
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        kv_indptr=torch.tensor(
            [0, *torch.tensor(prefix_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
        ),
        kv_indices=kv_indices,
        block_loc=block_loc,
        qo_indptr=torch.arange(bs + 1, dtype=torch.int32, device=device) * width,
        width=width,
        sm_scale=head_dim**-0.5,
    )


def sglang_kernel(case, is_causal=False, **options) -> torch.Tensor:
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    c = case
    o = torch.full_like(c["q"], float("nan"))
    extend_attention_fwd(
        c["q"], c["k_buffer"][c["block_loc"]], c["v_buffer"][c["block_loc"]], o, c["k_buffer"], c["v_buffer"],
        c["qo_indptr"], c["kv_indptr"], c["kv_indices"], None, is_causal, None, c["width"], 1.0, 1.0,
        sm_scale=c["sm_scale"], **options,
    )  # fmt: skip
    return o


def reference(case) -> torch.Tensor:
    from sglang_ddtree.kernels.draft_attention import block_attention_reference

    c = case
    return block_attention_reference(
        c["q"],
        c["k_buffer"],
        c["v_buffer"],
        c["kv_indptr"],
        c["kv_indices"],
        c["block_loc"],
        c["width"],
        c["sm_scale"],
    )


class _Mode:
    def is_target_verify(self):
        return True


class _Batch:
    def __init__(self, case):
        self.out_cache_loc = case["block_loc"]
        self.forward_mode = _Mode()


def through_hook(case, max_bs=8, is_causal=False, **options) -> tuple[torch.Tensor, bool]:
    """The backend's ``forward_extend`` (which launches ``_forward_extend_kernel``) after the
    plugin's hook: (output, whether SGLang's kernel was called instead of the decode path)."""
    from sglang_ddtree.adapter.attention.draft_attention import use_block_decode

    calls = []

    class Backend:
        max_context_len = 4096

        def _forward_extend_kernel(self, layer, *args, **kwargs):
            calls.append(layer)
            return sglang_kernel(case, is_causal=is_causal, **options)

        def forward_extend(self, q, k, v, layer, forward_batch):
            c, o = case, torch.full_like(case["q"], float("nan"))
            return self._forward_extend_kernel(
                layer, q, k, v, o, c["k_buffer"], c["v_buffer"], c["qo_indptr"], c["kv_indptr"],
                c["kv_indices"], None, is_causal, None, c["width"], 1.0, 1.0, c["sm_scale"], **options,
            )  # fmt: skip

    backend = Backend()
    use_block_decode(backend, max_bs)
    k = case["k_buffer"][case["block_loc"]]
    out = backend.forward_extend(case["q"], k, k, "layer", _Batch(case))
    return out, bool(calls)


rel = relative_difference  # the measure every check and benchmark reports


def main() -> None:
    """The CPU check (float32 under Triton's interpreter): every assertion must hold."""
    case = make_case(
        [5, 300, 0, 19], width=4, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu"
    )
    ref = reference(case)
    decoded, fell_back = through_hook(case)
    assert not fell_back, "a servable block went to SGLang's kernel"
    assert torch.isfinite(decoded).all(), "the decode path left outputs unwritten"
    sglang = sglang_kernel(case)
    print(f"decode vs reference {rel(decoded, ref):.2e}, SGLang vs reference {rel(sglang, ref):.2e}")
    assert rel(decoded, ref) < 1e-5 and rel(decoded, sglang) < 1e-5
    mqa = make_case(
        [33, 2], width=3, heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, device="cpu", seed=1
    )
    decoded, fell_back = through_hook(mqa)  # one KV head, a width that is not a power of two
    assert not fell_back and rel(decoded, reference(mqa)) < 1e-5, "one KV head, width 3"
    _, fell_back = through_hook(case, is_causal=True)
    assert fell_back, "a causal block must stay on SGLang's kernel"
    _, fell_back = through_hook(case, logit_cap=30.0)
    assert fell_back, "a soft-capped block must stay on SGLang's kernel"
    _, fell_back = through_hook(case, max_bs=2)
    assert fell_back, "more requests than the scratch holds must stay on SGLang's kernel"
    check_before_serving()
    print("ok")


def check_before_serving():
    """The start-up self-check passes against SGLang's kernel and fails against a wrong one."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from sglang_ddtree.adapter.attention.draft_attention import self_check

    def sglang(layer, *args):
        extend_attention_fwd(*args[:15], sm_scale=args[15])

    def wrong(layer, *args):
        args[3].zero_()

    assert self_check(sglang, 4, 2, 16, torch.float32, torch.device("cpu")) is None
    assert "relative difference" in self_check(wrong, 4, 2, 16, torch.float32, torch.device("cpu"))


if __name__ == "__main__":
    main()
