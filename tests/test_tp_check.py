"""The TP tree-agreement check (``adapter/tp_check.py``): every rank's round fingerprint
compared with one MAX all-reduce, in real ``torch.distributed`` gloo processes (SGLang's
CPU mode cannot open TP groups), on trees built and walked by the plugin's own backend."""

from __future__ import annotations

import dataclasses
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_ddtree.adapter import tp_check
from sglang_ddtree.config import ENV_CHECK_TP_TREES
from sglang_ddtree.kernels.backend import get_tree_backend
from sglang_ddtree.tree.fingerprint import PARTS, round_fingerprint

BS, DEPTH, K, BUDGET, VOCAB = 3, 6, 4, 12, 50


def _round(seed: int = 0):
    """One round's trees and acceptance from the reference builder and the torch walk;
    the posterior follows each tree's first two levels, so paths have length."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(BS * DEPTH, VOCAB, generator=gen) * 3
    backend = get_tree_backend("python")
    log_probs, ids = backend.topk(logits, K)
    roots = torch.randint(0, VOCAB, (BS,), generator=gen)
    prefix_lens = torch.tensor([5, 9, 2])
    trees = backend.build(
        log_probs.view(BS, DEPTH, K), ids.view(BS, DEPTH, K), roots, prefix_lens, BUDGET, BUDGET + 1
    )
    posterior = torch.randint(0, VOCAB, (BS, BUDGET + 1), generator=gen)
    posterior[:, 0] = trees.tokens[:, 1]
    posterior[:, 1] = trees.tokens[:, 2]
    acceptance = backend.accept(trees, posterior, prefix_lens, DEPTH)
    return trees, acceptance


def _changed_parts(a, b) -> list[str]:
    return [part for part, x, y in zip(PARTS, a.tolist(), b.tolist()) if x != y]


def test_a_round_has_accepted_paths():
    _, acceptance = _round()
    assert int(acceptance.accept_lens.max()) >= 1  # else the path parts would hash only padding


@pytest.mark.parametrize("part", ["tokens", "parents", "tree_sizes"])
def test_fingerprint_names_any_single_tree_change(part):
    trees, acceptance = _round()
    reference = round_fingerprint(trees, acceptance)
    assert torch.equal(round_fingerprint(dataclasses.replace(trees), acceptance), reference)
    name = {"tokens": "tree tokens", "parents": "tree parents", "tree_sizes": "tree sizes"}[part]
    values = getattr(trees, part)
    for index in range(values.numel()):
        changed = values.clone()
        changed.view(-1)[index] += 1
        fingerprint = round_fingerprint(dataclasses.replace(trees, **{part: changed}), acceptance)
        assert _changed_parts(fingerprint, reference) == [name], index


def test_fingerprint_sees_swapped_siblings_and_path_changes():
    trees, acceptance = _round()
    reference = round_fingerprint(trees, acceptance)
    swapped = trees.tokens.clone()
    swapped[0, 1], swapped[0, 2] = trees.tokens[0, 2], trees.tokens[0, 1]
    assert bool(trees.tokens[0, 1] != trees.tokens[0, 2])
    assert _changed_parts(
        round_fingerprint(dataclasses.replace(trees, tokens=swapped), acceptance), reference
    ) == ["tree tokens"]
    for field, name in [
        ("path", "accepted path"),
        ("accept_lens", "accept lengths"),
        ("bonus", "bonus tokens"),
    ]:
        changed = getattr(acceptance, field).clone()
        changed.view(-1)[-1] -= 1
        fingerprint = round_fingerprint(trees, dataclasses.replace(acceptance, **{field: changed}))
        assert _changed_parts(fingerprint, reference) == [name]


# --- across ranks ---------------------------------------------------------------------


def _perturb(trees, acceptance, scenario: str):
    if scenario == "tree":
        tokens = trees.tokens.clone()
        tokens[2, -1] += 7  # a deep node of the last request
        return dataclasses.replace(trees, tokens=tokens), acceptance
    if scenario == "path":
        bonus = acceptance.bonus.clone()
        bonus[1] += 1
        return trees, dataclasses.replace(acceptance, bonus=bonus)
    return trees, acceptance


SCENARIOS = ["same", "tree", "path", "same"]  # the check goes on after a divergence


def _rank_main(rank: int, ranks: int, port: int, perturbed_rank: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{ENV_CHECK_TP_TREES: "1"})
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        coordinator = SimpleNamespace(device_group=dist.group.WORLD, rank_in_group=rank, world_size=ranks)
        check = tp_check.tp_tree_check(coordinator)
        outcomes = []
        for scenario in SCENARIOS:
            trees, acceptance = _round()
            if rank == perturbed_rank:
                trees, acceptance = _perturb(trees, acceptance, scenario)
            try:
                check(trees, acceptance)
                outcomes.append("agree")
            except tp_check.TpTreeDivergence as error:
                outcomes.append(str(error))
        results[rank] = {"outcomes": outcomes, "rounds": check.rounds}
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("ranks, perturbed_rank", [(2, 1), (3, 0)])
def test_identical_ranks_pass_and_a_perturbed_rank_fails_on_every_rank(ranks, perturbed_rank):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(ranks, _free_port(), perturbed_rank, results), nprocs=ranks, join=True)
        results = dict(results)
    for rank in range(ranks):
        same, tree, path, same_again = results[rank]["outcomes"]
        assert same == "agree" and same_again == "agree"
        assert "ranks diverged at round 2 in tree tokens (" in tree
        assert f"rank {rank} of {ranks}" in tree
        assert "ranks diverged at round 3 in bonus tokens (" in path
        assert results[rank]["rounds"] == len(SCENARIOS)


# --- off by default ---------------------------------------------------------------------


class _NoGroup:
    """A coordinator that fails if the check touches it."""

    def __getattr__(self, name):
        raise AssertionError(f"the check is off but read the group's {name}")


def test_off_by_default_touches_no_group(monkeypatch):
    monkeypatch.delenv(ENV_CHECK_TP_TREES, raising=False)
    check = tp_check.tp_tree_check(_NoGroup())
    trees, acceptance = _round()
    assert check(trees, acceptance) is None
    monkeypatch.setenv(ENV_CHECK_TP_TREES, "0")
    assert tp_check.tp_tree_check(_NoGroup()) is check


def test_on_builds_a_check_for_the_group(monkeypatch):
    monkeypatch.setenv(ENV_CHECK_TP_TREES, "1")
    check = tp_check.tp_tree_check(SimpleNamespace(device_group="g", rank_in_group=1, world_size=2))
    assert isinstance(check, tp_check.TpTreeCheck)
    assert (check.group, check.rank, check.world_size) == ("g", 1, 2)
