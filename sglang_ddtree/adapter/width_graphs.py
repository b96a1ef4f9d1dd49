"""``--speculative-ddtree-budget auto`` under CUDA graphs: one target verify graph runner per
candidate width, swapped in per step (docs/online-budget.md, "How SGLang 0.5.23 can run more
than one verify width", option 1).

SGLang fixes a verify width twice: ``DecodeCudaGraphRunner`` captures at one
``captured_req_width`` (and refuses other widths: ``can_run_graph``), and the attention backend
sizes its verify state from ``get_spec().speculative_num_draft_tokens`` when built. EAGLE's
``--speculative-adaptive`` answers both the way this module does
(``EAGLEWorkerV2.build_adaptive_runtime_state`` / ``apply_runtime_state``): at start-up, for
every candidate width below the largest, a fresh target attention backend
(``_get_attention_backend(init_new_workspace=True)``) and a ``DecodeCudaGraphRunner``
captured while the runtime context says ``speculative_num_draft_tokens = width``; per step,
the model runner's ``attn_backend`` and ``decode_cuda_graph_runner`` point at the chosen
width's pair for the verify (:class:`WidthRunners`), and back at the start-up pair (the
largest width) after it, so prefill and everything else runs exactly as on a fixed server.
The largest width stays the server's ``speculative_num_draft_tokens``: the KV reservation, the
shared logits buffer and the start-up graphs follow it.

DDTREE's capture hooks (``attention/gpu_backends.py``) take the tree mask from the runner
being captured, so every width's graphs are captured with the masked verify kernel.

The drafter's forward is the same at every width: its graph builds the largest tree, and a
narrower step takes that tree's first slots (``Trees.narrowed``, exact for a best-first
build). Its top-k log-probs, which the width choice reads, are kept in a buffer the graph
writes (``kept_prediction.py``), and the online budget's prediction from them is one graph
replay of its own.

Start-up timing: every captured ``(bs, width)`` verify graph and the drafter's graph per
``bs`` are replayed with CUDA events on the inputs capture left in their buffers, which fills
a :class:`~sglang_ddtree.budget.TimedCostTable` before the first request; the rounds served
refine it (device time, ``adapter/widths.py``).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time

import torch

from ..budget import TimedCostTable

logger = logging.getLogger("sglang_ddtree")

TIMED_REPLAYS = 3


class WidthRunners:
    """The target's ``(attention backend, verify graph runner)`` per width; :meth:`use` points
    the model runner at one width's pair, :meth:`restore` back at the start-up pair."""

    def __init__(self, model_runner, pairs: dict, largest: int):
        self.model_runner = model_runner
        self.startup = (model_runner.attn_backend, model_runner.decode_cuda_graph_runner)
        self.pairs = {**pairs, int(largest): self.startup}
        self.widths = tuple(sorted(self.pairs))

    def use(self, width: int) -> None:
        backend, graphs = self.pairs[int(width)]
        self.model_runner.attn_backend = backend
        self.model_runner.decode_cuda_graph_runner = graphs

    def restore(self) -> None:
        self.model_runner.attn_backend, self.model_runner.decode_cuda_graph_runner = self.startup


def verify_backends(runners: WidthRunners | None) -> list:
    """The attention backends of ``runners``' verify graph sets (not width 1's decode graphs)."""
    if runners is None:
        return []
    return [
        backend
        for backend, graphs in runners.pairs.values()
        if getattr(getattr(graphs, "capture_forward_mode", None), "name", None) != "DECODE"
    ]


# --- start-up ----------------------------------------------------------------------------------


def captured_verify_graphs(model_runner) -> bool:
    graphs = getattr(model_runner, "decode_cuda_graph_runner", None)
    return graphs is not None and graphs is not getattr(model_runner, "eager_runner", None)


def captured_graph_mode(model_runner):
    """The forward mode the model runner's current CUDA graphs were captured in (DECODE for
    width 1's, TARGET_VERIFY for every wider width's), None where it runs eagerly."""
    if not captured_verify_graphs(model_runner):
        return None
    return getattr(model_runner.decode_cuda_graph_runner, "capture_forward_mode", None)


def decode_mode_runner(runner_cls, appends_draft_kv: bool = False):
    """``runner_cls`` (SGLang's decode graph runner class) captured as plain decoding: DECODE
    mode, no speculative input, the target's hidden states kept for the drafter. SGLang captures
    every target runner of a speculative server in TARGET_VERIFY mode; width 1 is one token a
    request, which its ordinary decode graph serves with plain decoding's forward batch and
    graph load (a verify's costs a step ~0.5 ms more host work on the H200).
    ``appends_draft_kv``: its graphs also append the roots' drafter KV (the capture hook of
    ``draft_kv_graphs.py`` acts on runners so marked)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    class DecodeModeGraphRunner(runner_cls):
        def capture(self):
            self.capture_forward_mode = ForwardMode.DECODE
            self.capture_hidden_mode = CaptureHiddenMode.FULL
            return super().capture()

        def get_spec_info(self, num_tokens):
            return None

    DecodeModeGraphRunner.appends_draft_kv = appends_draft_kv
    DecodeModeGraphRunner.__name__ = DecodeModeGraphRunner.__qualname__ = f"DecodeMode{runner_cls.__name__}"
    return DecodeModeGraphRunner


def build_width_runners(model_runner, widths, roots_append: bool = False) -> WidthRunners:
    """Capture a graph runner (with its own attention backend) for every width below the
    largest: decode graphs for width 1 (``roots_append``: appending the roots' drafter KV),
    verify graphs for the rest; the largest is the model runner's own, captured at start-up."""
    pairs = {int(width): _capture_width(model_runner, int(width), roots_append) for width in widths[:-1]}
    torch.cuda.empty_cache()  # the scratch each width allocated before it took the shared one
    return WidthRunners(model_runner, pairs, largest=widths[-1])


@contextlib.contextmanager
def verify_width_context(width: int):
    """The runtime context's ``speculative_num_draft_tokens`` set to ``width`` (everything
    sized from ``get_spec()`` during a capture sees it), restored after."""
    from sglang.srt.runtime_context import get_context, get_spec

    saved = get_spec().speculative_num_draft_tokens
    get_context().override("ddtree.width_capture", speculative_num_draft_tokens=int(width))
    try:
        yield
    finally:
        get_context().override("ddtree.width_restore", speculative_num_draft_tokens=saved)


def _capture_width(model_runner, width: int, roots_append: bool = False):
    from sglang.srt.utils import get_available_gpu_memory

    started, before = time.perf_counter(), get_available_gpu_memory(model_runner.device, model_runner.gpu_id)
    held, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with verify_width_context(width):
        workspace = model_runner.init_new_workspace
        try:
            backend = model_runner._get_attention_backend(init_new_workspace=True)
        finally:
            model_runner.init_new_workspace = workspace
        decodes = width == 1
        share_graph_scratch(backend, model_runner.attn_backend, split_scratch=not decodes)
        runner_cls = model_runner._decode_cuda_graph_runner_cls()
        if decodes:
            runner_cls = decode_mode_runner(runner_cls, appends_draft_kv=roots_append)
        graphs = runner_cls(model_runner, attn_backend=backend, speculative_num_draft_tokens=width)
    after = get_available_gpu_memory(model_runner.device, model_runner.gpu_id)
    # Which memory a width costs: tensors still held after its capture (buffers, workspaces,
    # graph outputs) against what the caching allocator reserved besides (graph pools that
    # earlier captures' freed blocks did not cover).
    logger.info(
        "DDTREE online budget: %s graphs of width %d captured (bs %s) in %.1f s, %.2f GB "
        "(tensors held %+.2f GB, allocator reserve %+.2f GB)%s",
        "decode" if decodes else "verify",
        width,
        list(graphs.capture_bs),
        time.perf_counter() - started,
        before - after,
        (torch.cuda.memory_allocated() - held) / 2**30,
        (torch.cuda.memory_reserved() - reserved) / 2**30,
        "; the roots' drafter KV append inside" if getattr(graphs, "appends_draft_kv", False) else "",
    )
    return backend, graphs


# Per-token graph state SGLang's triton backend sizes for ``max_bs x width`` tokens: the
# decode kernel's split partials (fp32 ``[tokens, heads, splits, v_dim]``: on the K2.6 rank 256
# splits, 4 MB a token) and its lse; besides, the kv indices and the verify mask (``width x
# (context + width)`` cells a request). Only one verify width runs at a time, on one stream, and
# each replay writes these before reading them, so every width can use the largest width's.
SHARED_SCRATCH = ("cuda_graph_attn_logits", "cuda_graph_attn_lse")


def share_graph_scratch(backend, startup_backend, split_scratch: bool = True) -> None:
    """Make ``backend``'s CUDA-graph state (allocated when its graph runner is built) use the
    start-up backend's: its kv-index buffer through SGLang's own ``kv_indices_buf`` argument
    (refilled by every replay's metadata) and, with ``split_scratch``, its split scratch as
    views of the start-up one (a verify never reads it, and the start-up one is released
    after capture; width 1's decode graphs read theirs, so they keep their own).
    A backend without that state (another attention backend) is left as it is."""
    init = getattr(backend, "init_cuda_graph_state", None)
    if init is None or getattr(startup_backend, "cuda_graph_kv_indices", None) is None:
        return

    def init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf=None, cuda_graph_num_kv_splits_buf=None):
        shared = startup_backend.cuda_graph_kv_indices
        if kv_indices_buf is None and shared.numel() >= max_bs * backend.max_context_len:
            kv_indices_buf = shared  # a verify fills one prefix per request
        init(max_bs, max_num_tokens, kv_indices_buf, cuda_graph_num_kv_splits_buf)
        if not split_scratch:
            return
        for name in SHARED_SCRATCH:
            mine, theirs = getattr(backend, name, None), getattr(startup_backend, name, None)
            if _fits_in(mine, theirs):
                setattr(backend, name, theirs[: mine.shape[0]])
        mine, theirs = getattr(backend, "_verify_mask", None), getattr(startup_backend, "_verify_mask", None)
        if _mask_fits_in(mine, theirs):
            backend._verify_mask = theirs  # each replay copies its tree mask in before the kernel reads it

    backend.init_cuda_graph_state = init_cuda_graph_state


def _mask_fits_in(mine, theirs) -> bool:
    """SGLang's verify mask (``VerifyMask``: per request ``width x (context + width)`` cells
    at most) of a narrower width inside the largest width's."""
    return (
        mine is not None
        and theirs is not None
        and mine.mode == theirs.mode
        and mine.max_bs <= theirs.max_bs
        and mine.buffer.dtype == theirs.buffer.dtype
        and mine.buffer.numel() <= theirs.buffer.numel()
    )


def _fits_in(mine, theirs) -> bool:
    return (
        isinstance(mine, torch.Tensor)
        and isinstance(theirs, torch.Tensor)
        and mine.dtype == theirs.dtype
        and mine.device == theirs.device
        and mine.shape[1:] == theirs.shape[1:]
        and mine.shape[0] <= theirs.shape[0]
    )


def time_graph_replays(graph_runner, repeats: int = TIMED_REPLAYS) -> dict[int, float]:
    """``{captured bs: ms}`` of one replay of each of ``graph_runner``'s default graphs (no
    LoRA, PD-multiplexing or attention variant), on what capture left in its buffers. Empty
    where the graphs cannot be replayed on their own (another graph backend, ragged verify):
    the rounds served then measure the costs."""
    backend = getattr(graph_runner, "backend", None)
    graphs = getattr(backend, "_graphs", None)
    if not graphs or getattr(graph_runner, "ragged_verify_mode", False):
        return {}
    timed = {}
    with torch.inference_mode():
        for key in list(graphs):
            if key.stream_idx is not None or key.attention_variant is not None:
                continue
            if key.variant_label not in (None, "nolora"):
                continue
            timed[int(key.size)] = _replay_ms(lambda key=key: backend.replay(key, None), repeats)
    return timed


def spread_token_ids(graph_runner, vocab_size: int, seed: int = 0) -> None:
    """Random token ids in ``graph_runner``'s input buffer, for its timed replays. Capture
    leaves one id in every slot, so on a MoE target every token routes to the same experts and
    a wide verify times nearly as cheap as a narrow one (on the K2.6 rank the start-up table put
    width 65 at 14.6 ms at bs 1 against 9.4 for width 9, while 65 routed tokens read ~4x the
    expert weights 9 do; that server's c=1 rounds took 27 ms, the chain's 19.5). Distinct ids spread the
    routing as a real batch does. Every replay while serving copies its own ids in first."""
    ids = getattr(getattr(graph_runner, "buffers", None), "input_ids", None)
    if not isinstance(ids, torch.Tensor):
        return
    generator = torch.Generator(device=ids.device).manual_seed(seed)
    ids.copy_(torch.randint(0, vocab_size, ids.shape, generator=generator, device=ids.device).to(ids.dtype))


def _replay_ms(replay, repeats: int) -> float:
    replay()  # the first replay after capture may carry one-time work
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def startup_cost_table(widths, verify_ms: dict[int, dict[int, float]], draft_ms: dict[int, float]):
    """``T(bs, width)`` from timed replays: rows at every batch size some width captured; a cell
    costs the width's verify graph that holds the batch (its smallest captured size >= bs;
    past its largest, linear in bs: the eager forward) plus, for a tree (width > 1), the
    drafter's graph likewise (no drafter graph: nothing added, the rounds served will show
    it). Width 1 runs no drafter (``StepWidths.skips_draft``)."""
    missing = [w for w in widths if not verify_ms.get(w)]
    if missing:
        raise ValueError(f"no timed graph for widths {missing}")
    rows = sorted({bs for timed in verify_ms.values() for bs in timed})
    ms = [
        [_served_by(verify_ms[w], bs) + (_served_by(draft_ms, bs) if w > 1 else 0.0) for w in widths]
        for bs in rows
    ]
    return TimedCostTable(rows, widths, ms)


def _served_by(timed: dict[int, float], bs: int) -> float:
    """The time of the graph that serves a batch of ``bs``: the smallest captured size that
    holds it, past the largest scaled linearly; 0 when nothing was timed."""
    if not timed:
        return 0.0
    sizes = sorted(timed)
    index = bisect.bisect_left(sizes, bs)
    if index == len(sizes):
        return timed[sizes[-1]] * bs / sizes[-1]
    return timed[sizes[index]]


def install(widths, target_runner, draft_runner, roots_append: bool = False) -> None:
    """After the server's own graph capture: the per-width verify graphs that ``widths`` (a
    ``StepWidths``) swaps per step (``roots_append``: width 1's append the roots' drafter KV),
    and its start-up cost table (a fixed table injected for testing is kept). Nothing where the
    target captured no verify graphs (CPU, eager servers): the eager round verifies any width
    with the one backend."""
    if not captured_verify_graphs(target_runner):
        return
    runners = build_width_runners(target_runner, widths.widths, roots_append)
    widths.runners = runners
    if widths.kept is not None:
        from .kept_prediction import PredictionGraph

        widths.prediction = PredictionGraph(widths.kept, widths.widths)
    if widths.measured:
        for _, graphs in runners.pairs.values():
            spread_token_ids(graphs, target_runner.model_config.vocab_size)
        verify_ms = {w: time_graph_replays(graphs) for w, (_, graphs) in runners.pairs.items()}
        drafter = getattr(draft_runner, "decode_cuda_graph_runner", None)
        draft_ms = time_graph_replays(drafter) if drafter is not None else {}
        try:
            widths.use_cost_table(startup_cost_table(widths.widths, verify_ms, draft_ms))
        except ValueError as why:
            logger.warning("DDTREE online budget: no start-up cost table (%s); measuring while serving", why)
        else:
            logger.info(
                "DDTREE online budget: start-up round costs (bs -> width -> ms) %s", widths.cost_rows()
            )
