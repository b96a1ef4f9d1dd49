"""Host time of SGLang's scheduler per decode step, split by stage, in any server (plain or
speculative): a lab plugin module (``SGLANG_DDTREE_TEST_PLUGIN=lab.bench.step_timer``, with the
checkout on ``PYTHONPATH``), loaded by the plugin's ``register`` in every scheduler process.

Per decode iteration of the scheduler's loop it adds up (microseconds, host clock):

* ``schedule``: ``Scheduler.get_next_batch_to_run`` (filter, memory check and the batch's
  ``prepare_for_decode``: the KV reservation);
* ``prepare_for_decode``: that preparation alone;
* ``run_batch``: ``Scheduler.run_batch``, the launch of the step (on a GPU the forward is
  asynchronous; on a CPU it runs inside), of which ``worker``: the model worker's
  ``forward_batch_generation`` (the plain worker's, or the speculative worker's whole step),
  and ``resolve_seq_lens``: the spec-v2 relay's wait for and copy of the previous step's lengths;
* ``forward``, ``sample`` and ``init_new``: inside the worker, the model runners' forwards (the
  target's graph replay or eager forward, its input copies included; a drafted step's drafter
  forward too), plain decoding's sampler (``ModelRunner.sample``; a DDTREE step takes the
  target's token itself) and the forward batches made (``ForwardBatch.init_new``, in both).
  ``worker - forward - sample`` is the worker's own host work around them: plain's forward
  batch, DDTREE's decoding step's preparation, features, posterior and bookkeeping;
* ``check_decode_mem``: in ``schedule``, SGLang's check that the step's KV fits (a speculative
  batch's asks per request what its reservation needs);
* ``schedule_decode``: in ``schedule``, the DDTREE worker's choice of the step's width and, for a
  width-1 step, its conversion into SGLang's own decode step, of which ``convert`` is the
  conversion (``adapter/plain_steps.py``);
* ``relay_payload`` and ``copy_to_cpu``: after the worker, inside ``run_batch``: the next
  step's inputs stashed in the relay, the result's copy to the host started;
* ``process_result``: ``Scheduler.process_batch_result`` of a decode batch (the tokens to the
  requests, stop checks, streaming);
* ``iteration``: from one decode launch to the next (the whole loop, everything included).

Every ``$SGLANG_STEP_TIMER_EVERY`` decode iterations (default 64) one line is logged:
``STEP TIMER us/step: {...}``, the means over those iterations.

On a GPU it also counts the host synchronisations of decode iterations (PyTorch's sync debug
mode: ``.item()``, ``.tolist()``, ``nonzero``, a blocking device-to-host copy): a step that waits
for the device loses the overlap scheduler's head start, and its device time joins its host time.
With the same period a second line, ``STEP TIMER syncs/step: {...}``, gives per source line (the
Python frame that asked) the synchronisations a step; ``SGLANG_STEP_TIMER_SYNCS=0`` turns it off.

With ``SGLANG_STEP_TIMER_PROFILE=<file>`` the launches and the scheduling of iterations run under cProfile,
its statistics written to ``<file>`` at every log line (``pstats.Stats(<file>)``: where a step's
host time goes, function by function; the model runner's forward is one entry among them).

With ``SGLANG_STEP_TIMER_OPS=1`` (any device) a third line, ``STEP TIMER ops/step: {...}``, counts
the tensor operations a decode iteration dispatches in the scheduler's batch preparation and the
launch, per source line of SGLang or the plugin that issued them, leaving out what a GPU runs
inside a CUDA graph: the model runner's forward (the target's graph replay, its input copies
included) and the drafter's KV append. On a GPU every counted operation is a kernel launch or a
host-side tensor operation the step's host time pays; on a CPU server the counts are the same
(the code path is), so the CPU tells how many launches a step's own work adds around the graphs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections import Counter, defaultdict

logger = logging.getLogger("sglang_ddtree")

LINE = "STEP TIMER us/step:"
SYNC_LINE = "STEP TIMER syncs/step:"
OPS_LINE = "STEP TIMER ops/step:"
# inside a CUDA graph on a GPU: not a launch of the step's own (the module docstring)
GRAPHED = (
    "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
)
SYNC_WARNING = "called a synchronizing CUDA operation"  # PyTorch's sync debug mode, "warn"
_totals: dict[str, float] = defaultdict(float)
_syncs: Counter = Counter()
_ops: Counter = Counter()
_state = {
    "steps": 0,
    "last_launch": None,
    "depth": 0,
    "in_decode_launch": False,
    "decoding": False,
    "counting_syncs": False,
    "ops_mode": None,  # the op counter (SGLANG_STEP_TIMER_OPS=1)
    "profile": None,  # cProfile of the decode launches (SGLANG_STEP_TIMER_PROFILE)
    "profile_path": None,  # where its statistics are written (that variable's value)
    "graphed": 0,  # depth inside a GRAPHED call
}


def _every() -> int:
    return int(os.environ.get("SGLANG_STEP_TIMER_EVERY", "64"))


def _is_decode(batch) -> bool:
    mode = getattr(batch, "forward_mode", None)
    return mode is not None and mode.is_decode()


def _timed(name: str, decode_only_arg: int | None = None, outermost: bool = False, in_launch: bool = False):
    """An AROUND hook adding the call's host time to ``name``: only for a decode batch when
    the ``decode_only_arg``-th argument is the batch, or (``in_launch``) only inside the launch
    of a decode batch (a speculative worker leaves the batch in its verify mode until the
    launch ends); only the outermost call when asked."""

    def hook(original, *args, **kwargs):
        if in_launch and not _state["in_decode_launch"]:
            return original(*args, **kwargs)
        if decode_only_arg is not None:
            batch = args[decode_only_arg] if len(args) > decode_only_arg else kwargs.get("batch")
            if not _is_decode(batch):
                return original(*args, **kwargs)
        if outermost and _state["depth"]:
            return original(*args, **kwargs)
        _state["depth"] += outermost
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _totals[name] += time.perf_counter() - began
            _state["depth"] -= outermost

    return hook


def _run_batch(original, scheduler, batch, *args, **kwargs):
    _state["decoding"] = _is_decode(batch)  # syncs count from a decode launch to the next launch
    if not _is_decode(batch):
        _state["last_launch"] = None  # a prefill in between: the next period is not a step's
        return original(scheduler, batch, *args, **kwargs)
    began = time.perf_counter()
    last, _state["last_launch"] = _state["last_launch"], began
    _state["in_decode_launch"] = True
    try:
        with _counting_ops(_ops), _profiling():
            return original(scheduler, batch, *args, **kwargs)
    finally:
        _state["in_decode_launch"] = False
        _totals["run_batch"] += time.perf_counter() - began
        if last is not None:
            _totals["iteration"] += began - last
            _totals["iterations"] += 1
        _state["steps"] += 1
        if _state["steps"] % _every() == 0:
            _log()


def _schedule(original, scheduler, *args, **kwargs):
    began = time.perf_counter()
    ops: Counter = Counter()
    with _counting_ops(ops), _profiling():  # (the online budget chooses a step's width here)
        plan = original(scheduler, *args, **kwargs)
    if _is_decode(getattr(plan, "batch_to_run", None)):
        _totals["schedule"] += time.perf_counter() - began
        _ops.update(ops)
    return plan


def _log() -> None:
    steps, iterations = _every(), _totals.pop("iterations", 0)
    means = {k: round(1e6 * v / steps, 1) for k, v in _totals.items() if k != "iteration"}
    if iterations:
        means["iteration"] = round(1e6 * _totals["iteration"] / iterations, 1)
    logger.warning("%s %s", LINE, means)
    _totals.clear()
    if _state["counting_syncs"]:
        per_step = {site: round(n / steps, 2) for site, n in _syncs.most_common(12)}
        logger.warning("%s %s", SYNC_LINE, {"total": round(sum(_syncs.values()) / steps, 2), **per_step})
        _syncs.clear()
    if _state["profile"] is not None:
        _state["profile"].dump_stats(_state["profile_path"])
    if _state["ops_mode"] is not None:
        per_step = {site: round(n / steps, 2) for site, n in sorted(_ops.items(), key=lambda kv: -kv[1])}
        logger.warning("%s %s", OPS_LINE, {"total": round(sum(_ops.values()) / steps, 2), **per_step})
        _ops.clear()


def _count_sync(show):
    """A ``warnings.showwarning`` that counts the sync debug mode's warnings of decode iterations
    by the source line that asked (``show``: the one it replaces, for every other warning)."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return show(message, category, filename, lineno, file, line)
        if _state["decoding"]:
            parts = os.path.normpath(filename).split(os.sep)
            _syncs[f"{'/'.join(parts[-3:])}:{lineno}"] += 1

    return showwarning


def _install_sync_counter() -> None:
    import torch

    if os.environ.get("SGLANG_STEP_TIMER_SYNCS", "1") == "0" or not torch.cuda.is_available():
        return
    warnings.filterwarnings("always", message=f".*{SYNC_WARNING}.*")
    warnings.showwarning = _count_sync(warnings.showwarning)
    torch.cuda.set_sync_debug_mode("warn")
    _state["counting_syncs"] = True


class _OpSites:
    """Counts each tensor operation by the innermost SGLang or plugin source line that issued it
    (a ``TorchDispatchMode``, made on first use: torch is imported by then)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        sites = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if sites.into is not None and not _state["graphed"]:
                    sites.into[_site()] += 1
                return func(*args, **(kwargs or {}))

        self.mode, self.into = Mode(), None


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if ("sglang_ddtree" in name or f"{os.sep}sglang{os.sep}" in name) and "step_timer" not in name:
            parts = os.path.normpath(name).split(os.sep)
            return f"{'/'.join(parts[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


@contextlib.contextmanager
def _profiling():
    """cProfile inside it (nothing when the profile is off)."""
    profile = _state["profile"]
    if profile is None:
        yield
        return
    profile.enable()
    try:
        yield
    finally:
        profile.disable()


@contextlib.contextmanager
def _counting_ops(into: Counter):
    """Counts the operations dispatched inside it into ``into`` (nothing when the counter is off)."""
    sites = _state["ops_mode"]
    if sites is None:
        yield
        return
    sites.into = into
    with sites.mode:
        try:
            yield
        finally:
            sites.into = None


def _graphed(original, *args, **kwargs):
    _state["graphed"] += 1
    try:
        return original(*args, **kwargs)
    finally:
        _state["graphed"] -= 1


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    scheduler = "sglang.srt.managers.scheduler.Scheduler"
    runner = "sglang.srt.model_executor.model_runner.ModelRunner"
    hooks = {
        f"{scheduler}.run_batch": _run_batch,
        f"{scheduler}.get_next_batch_to_run": _schedule,
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode": _timed("prepare_for_decode"),
        "sglang.srt.managers.overlap_utils.FutureMap.resolve_seq_lens_cpu": _timed("resolve_seq_lens", 1),
        f"{scheduler}.process_batch_result": _timed("process_result", 1),
        f"{scheduler}._relay_forward_payload": _timed("relay_payload", in_launch=True),
        f"{scheduler}._copy_result_to_cpu": _timed("copy_to_cpu", in_launch=True),
        "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation": _timed(
            "worker", 1, outermost=True
        ),
        "sglang_ddtree.adapter.worker.DDTreeWorker.forward_batch_generation": _timed(
            "worker", 1, outermost=True
        ),
        f"{runner}.forward": _timed("forward", in_launch=True),
        f"{runner}.sample": _timed("sample", in_launch=True),
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": _timed(
            "init_new", in_launch=True
        ),
        "sglang_ddtree.adapter.plain_steps.PlainSteps.convert": _timed("convert"),
        "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem": _timed("check_decode_mem"),
        "sglang_ddtree.adapter.worker.DDTreeWorker.schedule_decode": _timed("schedule_decode"),
    }
    if os.environ.get("SGLANG_STEP_TIMER_PROFILE"):
        import cProfile

        _state["profile"] = cProfile.Profile()
        _state["profile_path"] = os.environ["SGLANG_STEP_TIMER_PROFILE"]
    if os.environ.get("SGLANG_STEP_TIMER_OPS", "0") == "1":
        _state["ops_mode"] = _OpSites()
        hooks.update({target: _graphed for target in GRAPHED})  # (replaces the forward's timer)
    for target, hook in hooks.items():
        HookRegistry.register(target, hook, HookType.AROUND)
    _install_sync_counter()
