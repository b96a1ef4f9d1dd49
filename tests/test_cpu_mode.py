"""The CPU serving mode's pieces, without a server: the pure-torch sgl_kernel ops
(against straightforward Python), and the start-up hook staying inert unless asked."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from sglang_ddtree.cpu import ops


def _murmur_py(seed: int, pos: int, col: int) -> int:
    mask = 0xFFFFFFFF

    def rot(x, r):
        return ((x << r) | (x >> (32 - r))) & mask

    def mix(h, k):
        k = rot((k * 0xCC9E2D51) & mask, 15)
        k = (k * 0x1B873593) & mask
        h = rot(h ^ k, 13)
        return (h * 5 + 0xE6546B64) & mask

    h = mix(mix(mix(mix(0, seed & mask), (seed >> 32) & mask), pos & mask), col & mask) ^ 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def test_murmur_hash_matches_python_bigint_version():
    seeds, positions = [0, 42, 2**40 + 7, 2**63 - 1], [0, 5, 99, 2**31 - 1]
    out = ops.murmur_hash32(torch.tensor(seeds), torch.tensor(positions), torch.arange(7))
    expected = [[_murmur_py(s, p, c) for c in range(7)] for s, p in zip(seeds, positions)]
    assert out.dtype == torch.uint32
    assert out.to(torch.int64).tolist() == expected


def test_req_to_token_ops_round_trip():
    table = torch.zeros((3, 10), dtype=torch.int32)
    rows, start, end = torch.tensor([2, 0]), torch.tensor([1, 3]), torch.tensor([3, 7])
    ops.assign_req_to_token_pool(rows, table, start, end, torch.arange(100, 106), 10)
    assert table[2, 1:3].tolist() == [100, 101] and table[0, 3:7].tolist() == [102, 103, 104, 105]
    out = torch.empty(6, dtype=torch.int64)
    ops.assign_extend_cache_locs(rows, table, start, end, out, 10)
    assert out.tolist() == list(range(100, 106))


def test_copy_all_layer_kv_cache_moves_rows_in_order():
    layers = [torch.arange(24.0).view(6, 4), torch.arange(100.0, 118.0).view(6, 3)]
    before = [layer.clone() for layer in layers]
    ptrs = torch.tensor([layer.data_ptr() for layer in layers])
    strides = torch.tensor([layer.stride(0) * layer.element_size() for layer in layers])
    # tree commit shape: final position 1 <- slot 2, position 2 <- slot 3 (slot 2 is read first)
    ops.copy_all_layer_kv_cache(ptrs, strides, torch.tensor([1, 2]), torch.tensor([2, 3]))
    for layer, old in zip(layers, before):
        assert torch.equal(layer[1], old[2]) and torch.equal(layer[2], old[3])
        assert torch.equal(layer[[0, 3, 4, 5]], old[[0, 3, 4, 5]])


def _hook_state(env_value, code="import sys"):
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    if env_value is not None:
        env["SGLANG_USE_CPU_ENGINE"] = env_value
    code += "; print('sglang_ddtree.cpu.boot:active' in sys.modules, 'sgl_kernel.load_utils' in sys.modules)"
    code += "; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return result.stdout.split()


def test_startup_hook_only_acts_when_asked():
    from sglang_ddtree.cpu.hook import hook_path

    assert hook_path().exists(), "make installs the hook: python -m sglang_ddtree.cpu install-hook"
    assert _hook_state(None) == ["False", "False", "False"]
    assert _hook_state("0") == ["False", "False", "False"]
    # the ops wait for SGLang: a process that never imports it does not import torch for them
    assert _hook_state("1") == ["True", "True", "False"]


def test_ops_are_registered_before_sgl_kernel_is_imported():
    code = "import sys, sgl_kernel, torch; print(callable(torch.ops.sgl_kernel.murmur_hash32_cpu))"
    assert _hook_state("1", code) == ["True", "True", "True", "True"]
