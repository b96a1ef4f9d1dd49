"""The drafter's KV append after each verify, replayed from CUDA graphs.

After a verify, the DFlash worker writes the drafter's context KV for the committed tokens
(SGLang's ``_append_target_hidden_to_draft_kv_by_loc``: the drafter's input projection, then
per drafter layer its K/V projection, norm, rope and a prefix-valid write). Eagerly that is
dozens of launches and ~0.7 ms of host time per round on the H200 (docs/gpu.md, the round's
largest host step), in the chain's round as in DDTREE's. Every shape in it is fixed by
(batch size, verify width), so it is captured once per pair at start-up; a round writes its
inputs into the graph's buffers and replays. A batch between captured sizes replays the next
larger one: the extra requests commit nothing (their ``commit_lens`` are 0), which the
prefix-valid write honours on the device.

CPU servers, eager servers and tensor parallelism keep the eager append (TP would put the
drafter's collectives inside these graphs; not done).

Width 1's decode graphs (the online budget's decoding steps, ``width_graphs.py``) append every
root's drafter KV inside themselves (:meth:`DraftKVGraphs.root_append_hook`, a capture hook
SGLang's graph runner calls at the end of each captured forward): the step then pays no copies
and no replay of its own for it. That takes the graph's own write ids, so only where the
target's pool and the drafter's name a slot alike (:func:`same_write_ids`).

A drafter with neox-style RoPE (the published Kimi DFlash drafters) takes SGLang's fused KV
path, whose helper keeps a workspace between calls and replaces it with a larger one, freeing
the old, when a longer prefill needs more rows. The graphs read and write the tensors they
were captured on, so they hold every tensor the helper held at capture.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sglang_ddtree")


def committed_rows(
    hidden, sources, prefix_lens, width: int, last_position: int, out_hidden=None, out_positions=None
):
    """The target's hidden features of each request's committed path ``[bs, width, features]``
    (accepted nodes gathered into their final positions) and those positions ``[bs, width]``."""
    bs = sources.shape[0]
    hidden = hidden.view(bs, width, -1)
    index = sources[:, :, None].expand(-1, -1, hidden.shape[-1])
    rows = torch.gather(hidden, 1, index, out=out_hidden)
    offsets = torch.arange(width, device=sources.device)
    positions = torch.add(prefix_lens[:, None].to(torch.int64), offsets, out=out_positions)
    return rows, positions.clamp_(max=last_position)


def same_write_ids(target_translator, draft_translator) -> bool:
    """Whether the target's full-attention write ids are the drafter's: both sub-pools index
    the iteration's virtual ids as they are, or the drafter lives in the target's (one key)."""
    from sglang.srt.mem_cache.kv_loc_plan import IdSpaceKind

    target, draft = target_translator.space(IdSpaceKind.FULL), draft_translator.space(IdSpaceKind.FULL)
    if target is None or draft is None:
        return False
    return target.key == draft.key or (target.write is None and draft.write is None)


def held_by_append(append) -> list[torch.Tensor]:
    """The tensors SGLang's append keeps between calls, as they are now: the fused KV path's
    stacked weights (SGLang drops its helper if a later eager call fails) and its workspace
    (which a longer prefill replaces). Empty on the per-layer path."""
    helper = getattr(getattr(append, "__self__", None), "_fused_kv_helper", None)
    return [v for v in vars(helper).values() if isinstance(v, torch.Tensor)] if helper is not None else []


class DraftKVGraphs:
    """One graph per (captured batch size, verify width), sharing buffers and a memory pool."""

    def __init__(self, append, features: int, dtype, batch_sizes, widths, last_position: int, device):
        self._append = append
        self.batch_sizes = sorted(int(b) for b in batch_sizes)
        self.widths = sorted({int(w) for w in widths})
        self.last_position = last_position
        rows = self.batch_sizes[-1] * self.widths[-1]
        self.hidden = torch.zeros(rows, features, dtype=dtype, device=device)
        # Zeros until a round writes them: slot 0 is the pool's padding slot, and a commit
        # length of 0 writes nothing (the warm-up and capture runs write no KV).
        self.cache_loc = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.commit_lens = torch.zeros(self.batch_sizes[-1], dtype=torch.int32, device=device)
        # The batch size whose decoding-step commit lengths ``commit_lens`` holds (ones for its
        # rows, zeros to its padded size), or None: a run of decoding steps writes them once.
        self._roots_written: int | None = None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.held: list = []  # what the captured append reads and writes outside the graph pool

    def _run(self, bs: int, width: int) -> None:
        n = bs * width
        self._append(
            target_hidden=self.hidden[:n],
            cache_loc=self.cache_loc[:n],
            cache_loc_2d=self.cache_loc[:n].view(bs, width),
            positions=self.positions[:n],
            commit_lens=self.commit_lens[:bs],
        )

    def capture(self) -> None:
        """Most rows first, so smaller graphs reuse the pool (and a workspace SGLang's append
        keeps is never regrown under an earlier graph); each after one eager warm-up run
        (which, with every ``commit_lens`` 0, writes nothing)."""
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        pairs = [(bs, width) for width in self.widths for bs in self.batch_sizes]
        for bs, width in sorted(pairs, key=lambda pair: pair[0] * pair[1], reverse=True):
            with torch.cuda.stream(stream):
                self._run(bs, width)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._run(bs, width)
            self.graphs[(bs, width)] = graph
        torch.cuda.current_stream().wait_stream(stream)
        self.held = held_by_append(self._append)

    def root_append_hook(self):
        """A capture hook (``model_runner.capture_tail_hooks``) that appends every root's
        drafter KV inside the graphs of runners marked ``appends_draft_kv`` (width 1's decode
        graphs), from the captured forward's own write ids, positions and hidden states. A
        padded row's write id is the sink; its commit length of 1 writes there."""
        ones = torch.ones(self.batch_sizes[-1], dtype=torch.int32, device=self.commit_lens.device)

        def append_roots_in_graph(runner, out, forward_batch, num_tokens) -> None:
            if not getattr(runner, "appends_draft_kv", False):
                return
            if num_tokens > ones.shape[0]:
                raise ValueError(
                    f"a decode graph of {num_tokens} rows past the drafter KV graphs' {ones.shape[0]}"
                )
            cache_loc = forward_batch.out_cache_loc[:num_tokens]  # int32 there: the append casts
            self._append(
                target_hidden=out.hidden_states[:num_tokens],
                cache_loc=cache_loc,
                cache_loc_2d=cache_loc.view(num_tokens, 1),
                positions=forward_batch.positions[:num_tokens],
                commit_lens=ones[:num_tokens],
            )
            self.hold_what_append_holds()  # the captured append reads them

        return append_roots_in_graph

    def hold_what_append_holds(self) -> None:
        """Keep what SGLang's append holds now too (after other graphs captured it)."""
        known = {id(t) for t in self.held}
        self.held += [t for t in held_by_append(self._append) if id(t) not in known]

    def padded_batch(self, bs: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= bs), None)

    def append(self, hidden, sources, prefix_lens, cache_loc, commit_lens) -> bool:
        """Replay the append for this round; False where no graph covers it (append eagerly)."""
        bs, width = sources.shape
        if hidden.dtype != self.hidden.dtype or hidden.shape[-1] != self.hidden.shape[-1]:
            return False
        padded = self.padded_batch(bs)
        graph = self.graphs.get((padded, width)) if padded is not None else None
        if graph is None:
            return False
        n = bs * width
        committed_rows(
            hidden, sources, prefix_lens, width, self.last_position,
            out_hidden=self.hidden[:n].view(bs, width, -1), out_positions=self.positions[:n].view(bs, width),
        )  # fmt: skip
        self.cache_loc[:n].copy_(cache_loc)
        self.commit_lens[:bs].copy_(commit_lens)
        self._roots_written = None
        if padded > bs:
            self.commit_lens[bs:padded].zero_()
        graph.replay()
        return True

    def append_roots(self, hidden, positions, cache_loc) -> bool:
        """Replay the append of a decoding step (width 1: every request's root, committed);
        False where no graph covers it."""
        bs = hidden.shape[0]
        if hidden.dtype != self.hidden.dtype or hidden.shape[-1] != self.hidden.shape[-1]:
            return False
        padded = self.padded_batch(bs)
        graph = self.graphs.get((padded, 1)) if padded is not None else None
        if graph is None:
            return False
        self.hidden[:bs].copy_(hidden)
        self.positions[:bs].copy_(positions)
        self.cache_loc[:bs].copy_(cache_loc)
        if self._roots_written != bs:
            self.commit_lens[:bs].fill_(1)
            if padded > bs:
                self.commit_lens[bs:padded].zero_()
            self._roots_written = bs
        graph.replay()
        return True


def install(worker, widths) -> DraftKVGraphs | None:
    """The graphs for a DDTREE worker whose target verifies in CUDA graphs (TP 1), or None
    where the eager append stays (logged when a capture fails)."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    from ..config import eager_draft_kv_requested
    from .width_graphs import captured_verify_graphs

    if (
        not captured_verify_graphs(worker.model_runner)
        or get_parallel().tp_size != 1
        or eager_draft_kv_requested()
    ):
        return None
    fc = worker.draft_model.fc
    features = int(getattr(fc, "input_size", None) or fc.in_features)
    graphs = DraftKVGraphs(
        worker._append_target_hidden_to_draft_kv_by_loc, features, worker.model_runner.dtype,
        get_exec().graph.cuda_graph_config.decode.bs, widths, worker._last_position, worker.device,
    )  # fmt: skip
    try:
        graphs.capture()
    except Exception as why:  # a drafter whose append cannot be captured keeps the eager one
        logger.warning("DDTREE: drafter KV append stays eager (capture failed: %s)", why)
        return None
    logger.info("DDTREE: drafter KV append captured for %d (batch size, width) pairs", len(graphs.graphs))
    return graphs


def root_append_hook(worker):
    """Install on the target's model runner the capture hook that appends the roots' drafter KV
    inside width 1's decode graphs (captured after this); None where they cannot: no drafter KV
    graphs (CPU, eager, TP, asked), or pools that name a slot differently."""
    graphs = worker.draft_kv_graphs
    if graphs is None or not same_write_ids(
        worker.model_runner.kv_index_translator, worker.draft_model_runner.kv_index_translator
    ):
        return None
    hook = graphs.root_append_hook()
    worker.model_runner.capture_tail_hooks.append(hook)
    return hook
