"""The decode scratch a speculative target's verify graphs never read is given back after
capture (adapter/verify_graph_memory.py); a target with decode graphs keeps it."""

from types import SimpleNamespace

import torch

from sglang_ddtree.adapter.verify_graph_memory import release_decode_scratch


def _backend(tokens=12, heads=2, splits=4, v_dim=8):
    return SimpleNamespace(
        cuda_graph_attn_logits=torch.zeros(tokens, heads, splits, v_dim),
        cuda_graph_attn_lse=torch.zeros(tokens, heads, splits),
        cuda_graph_kv_indices=torch.zeros(tokens * 16, dtype=torch.int64),
    )


def _target(mode: str, backend):
    graphs = SimpleNamespace(capture_forward_mode=SimpleNamespace(name=mode))
    return SimpleNamespace(decode_cuda_graph_runner=graphs, attn_backend=backend)


def test_a_verify_target_gives_back_the_decode_scratch_of_every_width():
    startup = _backend(tokens=36)
    narrow = _backend(tokens=12)
    narrow.cuda_graph_attn_logits = startup.cuda_graph_attn_logits[:12]  # a width viewing the start-up one
    kv_indices = startup.cuda_graph_kv_indices
    released = release_decode_scratch(_target("TARGET_VERIFY", startup), [startup, narrow, startup])
    # each storage counted once: the start-up logits (the narrow width's view), both lse buffers
    assert released * 2**30 == 4 * (36 * 2 * 4 * 8 + 36 * 2 * 4 + 12 * 2 * 4)
    for backend in (startup, narrow):
        assert backend.cuda_graph_attn_logits.shape == (0, 2, 4, 8)
        assert backend.cuda_graph_attn_lse.shape == (0, 2, 4)
    assert startup.cuda_graph_kv_indices is kv_indices  # the verify graphs read the indices


def test_a_target_with_decode_graphs_keeps_its_scratch():
    backend = _backend()
    logits = backend.cuda_graph_attn_logits
    assert release_decode_scratch(_target("DECODE", backend), [backend]) == 0.0
    assert backend.cuda_graph_attn_logits is logits
    eager = SimpleNamespace(attn_backend=backend)  # no graphs captured
    assert release_decode_scratch(eager, [backend]) == 0.0


class _TritonLikeBackend:
    """``init_cuda_graph_state`` as SGLang's triton backend sizes its kv indices."""

    max_context_len, device = 100, "cpu"

    def init_cuda_graph_state(
        self, max_bs, max_num_tokens, kv_indices_buf=None, cuda_graph_num_kv_splits_buf=None
    ):
        self.cuda_graph_kv_indices = (
            torch.zeros(max_num_tokens * self.max_context_len, dtype=torch.int64)
            if kv_indices_buf is None
            else kv_indices_buf
        )


def test_a_verify_target_holds_kv_indices_for_one_prefix_per_request():
    from sglang_ddtree.adapter.verify_graph_memory import size_kv_indices_for_verify

    backend = _TritonLikeBackend()
    size_kv_indices_for_verify(backend)
    backend.init_cuda_graph_state(4, 4 * 17)  # as SGLang's graph runner calls it: bs 4, width 17
    assert backend.cuda_graph_kv_indices.numel() == 4 * (100 + 17)  # not 4 * 17 * 100
    given = torch.zeros(5, dtype=torch.int64)
    backend.init_cuda_graph_state(4, 4 * 17, given)  # a buffer SGLang passes in is kept
    assert backend.cuda_graph_kv_indices is given


def test_every_width_shares_the_start_up_kv_indices_sized_for_verify():
    from sglang_ddtree.adapter.verify_graph_memory import size_kv_indices_for_verify
    from sglang_ddtree.adapter.width_graphs import share_graph_scratch

    startup, narrow = _TritonLikeBackend(), _TritonLikeBackend()
    for backend in (startup, narrow):
        size_kv_indices_for_verify(backend)  # the hook on every target backend's __init__
    startup.init_cuda_graph_state(4, 4 * 65)
    share_graph_scratch(narrow, startup)
    narrow.init_cuda_graph_state(4, 4 * 9)
    assert narrow.cuda_graph_kv_indices is startup.cuda_graph_kv_indices


def test_the_hook_sizes_the_targets_backends_only(registered_hooks):
    from sglang_ddtree.adapter import verify_graph_memory

    verify_graph_memory.install()
    ((target, after),) = registered_hooks
    assert target.endswith("TritonAttnBackend.__init__")
    ddtree = SimpleNamespace(name="DDTREE")
    for is_draft_worker, sized in ((False, True), (True, False)):
        backend = _TritonLikeBackend()
        runner = SimpleNamespace(spec_algorithm=ddtree, is_draft_worker=is_draft_worker)
        after(None, backend, runner)
        backend.init_cuda_graph_state(4, 4 * 17)
        assert (backend.cuda_graph_kv_indices.numel() == 4 * 117) == sized
    plain = _TritonLikeBackend()
    after(None, plain, SimpleNamespace(spec_algorithm=SimpleNamespace(name="DFLASH"), is_draft_worker=False))
    plain.init_cuda_graph_state(4, 4 * 17)
    assert plain.cuda_graph_kv_indices.numel() == 4 * 17 * 100  # stock speculation is left as it is
