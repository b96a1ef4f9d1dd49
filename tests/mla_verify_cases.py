"""Tree-verify attention cases laid out as SGLang's triton backend lays them out (MLA,
target verify): the split kernel behind the plugin's hook against SGLang's own
``extend_attention_fwd`` and a float32 torch reference, on the same tensors.

Run on CPU by ``tests/test_mla_verify.py`` under Triton's interpreter (float32), and on the GPU
by the same test in bfloat16 with a CUDA-graph replay.
"""

from __future__ import annotations

import torch

from lab.bench.mla_tree_attention import ancestor_mask, random_tree_parents
from sglang_ddtree.kernels.compare import relative_difference
from sglang_ddtree.tree.layout import flat_custom_mask

D_QK, D_V = 576, 512


def make_case(prefix_lens, n_nodes, heads, dtype, device, seed=0, slots=None):
    gen = torch.Generator().manual_seed(seed)
    bs, W = len(prefix_lens), n_nodes
    slots = slots or sum(prefix_lens) + 7
    pool = torch.randn(slots, 1, D_QK, generator=gen).to(device, dtype)
    # each request's prefix at scattered slots, as a long-running pool holds them
    kv_indices = torch.randperm(slots, generator=gen)[: sum(prefix_lens)].to(device)
    kv_indptr = torch.tensor(
        [0, *torch.tensor(prefix_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    trees = [ancestor_mask(random_tree_parents(W, gen)) for _ in range(bs)]
    mask_sizes = torch.tensor([W * (L + W) for L in prefix_lens])
    k_extend = torch.randn(bs * W, 1, D_QK, generator=gen).to(device, dtype)
    return dict(
        q=torch.randn(bs * W, heads, D_QK, generator=gen).to(device, dtype),
        k_extend=k_extend,
        v_extend=k_extend[..., :D_V].contiguous(),
        o=torch.full((bs * W, heads, D_V), float("nan"), dtype=dtype, device=device),
        k_buffer=pool,
        v_buffer=pool[..., :D_V],
        qo_indptr=torch.arange(bs + 1, dtype=torch.int32, device=device) * W,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        custom_mask=flat_custom_mask(torch.stack(trees), prefix_lens).to(device),
        is_causal=True,
        mask_indptr=torch.tensor([0, *mask_sizes.cumsum(0).tolist()], dtype=torch.int64, device=device),
        max_extend_len=W,
        k_descale=1.0,
        v_descale=1.0,
        sm_scale=1.0 / (192**0.5),
    ), trees


def reference(case, trees) -> torch.Tensor:
    """float32 softmax over each request's prefix and its tree ancestors; values = latent."""
    W = case["max_extend_len"]
    out = []
    for b, tree in enumerate(trees):
        lo, hi = int(case["kv_indptr"][b]), int(case["kv_indptr"][b + 1])
        prefix = case["k_buffer"][case["kv_indices"][lo:hi].long(), 0].float()
        keys = torch.cat([prefix, case["k_extend"][b * W : (b + 1) * W, 0].float()])
        q = case["q"][b * W : (b + 1) * W].float()  # [W, H, 576]
        s = torch.einsum("whd,nd->hwn", q, keys) * case["sm_scale"]
        visible = torch.cat([torch.ones(W, hi - lo, dtype=torch.bool), tree], 1).to(s.device)
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        out.append(torch.einsum("hwn,nd->whd", p, keys[:, :D_V]))
    return torch.cat(out)


def sglang_kernel(case, **options) -> torch.Tensor:
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    args = {k: v for k, v in case.items()}
    o = torch.full_like(args.pop("o"), float("nan"))
    extend_attention_fwd(
        args["q"], args["k_extend"], args["v_extend"], o, args["k_buffer"], args["v_buffer"],
        args["qo_indptr"], args["kv_indptr"], args["kv_indices"], args["custom_mask"], True,
        args["mask_indptr"], args["max_extend_len"], 1.0, 1.0, sm_scale=args["sm_scale"], **options,
    )  # fmt: skip
    return o


def through_hook(case, sms, **options) -> tuple[torch.Tensor, bool]:
    """The backend's ``_forward_extend_kernel`` after the plugin's hook: (output, whether
    SGLang's kernel was called instead of the split one)."""
    from sglang_ddtree.adapter.attention.mla_verify import use_split_kernel

    calls = []

    class Backend:
        def _forward_extend_kernel(self, layer, *args, **kwargs):
            calls.append(layer)
            return sglang_kernel(case, **options)

    backend = Backend()
    use_split_kernel(backend, sms)
    keys = ("q", "k_extend", "v_extend", "o", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr", "kv_indices",
            "custom_mask", "is_causal", "mask_indptr", "max_extend_len", "k_descale", "v_descale", "sm_scale")  # fmt: skip
    out = backend._forward_extend_kernel("layer", *[case[k] for k in keys], **options)
    return out, bool(calls)


rel = relative_difference  # the measure every check and benchmark reports


def main() -> None:
    """The CPU check (float32 under Triton's interpreter): every assertion must hold."""
    case, trees = make_case([5, 40, 0, 19], n_nodes=5, heads=2, dtype=torch.float32, device="cpu")
    ref = reference(case, trees)
    split, fell_back = through_hook(case, sms=6)  # 6 SMs: several prefix splits, some empty
    assert not fell_back, "a servable verify went to SGLang's kernel"
    assert torch.isfinite(split).all(), "the split kernel left outputs unwritten"
    sglang = sglang_kernel(case)
    print(f"split vs reference {rel(split, ref):.2e}, SGLang vs reference {rel(sglang, ref):.2e}")
    assert rel(split, ref) < 1e-5 and rel(split, sglang) < 1e-5
    _, fell_back = through_hook(case, sms=6, logit_cap=30.0)
    assert fell_back, "a soft-capped verify must stay on SGLang's kernel"
    check_before_serving()
    print("ok")


def check_before_serving():
    """The start-up self-check passes against SGLang's kernel and fails against a wrong one."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from sglang_ddtree.kernels.mla_verify import self_check

    def sglang(*args):
        extend_attention_fwd(*args[:15], sm_scale=args[15])

    def wrong(*args):
        args[3].zero_()

    assert self_check(sglang, 2, torch.float32, torch.device("cpu"), 6) is None
    assert "relative difference" in self_check(wrong, 2, torch.float32, torch.device("cpu"), 6)


if __name__ == "__main__":
    main()
