"""SGLang's speculative memory check's sum against the reservation's (``patches/0006``), host time.

``ScheduleBatch._new_tokens_required_next_decode_spec_v2`` (SGLang's own, unhooked) and
``sglang_ddtree.adapter.reservation.slots_short`` on the same requests, every one holding the
reserve as a DDTREE batch's do between top-ups (the sums are 0 and equal; checked here), at
batch sizes 1-64, pages of 1 and 16; warm loops, best of three repeats.

    python -m lab.bench.memory_check   # -> results/sglang_cpu_memory_check.{json,md}
"""

from __future__ import annotations

import argparse
import timeit
import types
from pathlib import Path

from lab.bench import _stamp

RESERVE = 130  # two verify widths at budget 64


def _requests(bs: int) -> list:
    return [
        types.SimpleNamespace(kv=types.SimpleNamespace(kv_committed_len=100 + i, kv_allocated_len=400 + i))
        for i in range(bs)
    ]


def measure(batch_sizes, page_sizes, number: int = 20000) -> list[dict]:
    from sglang.srt.managers import schedule_batch

    from sglang_ddtree.adapter.reservation import slots_short

    method = schedule_batch.ScheduleBatch._new_tokens_required_next_decode_spec_v2
    sglang_sum = getattr(method, "__wrapped__", method)  # SGLang's own where the hooks are applied
    real = schedule_batch.get_alloc_reserve_per_decode
    schedule_batch.get_alloc_reserve_per_decode = lambda: RESERVE  # no published spec settings here
    rows = []
    try:
        for page in page_sizes:
            for bs in batch_sizes:
                reqs = _requests(bs)
                if sglang_sum(None, reqs, page) != slots_short(reqs, page, RESERVE):
                    raise RuntimeError(f"the sums differ at bs {bs}, page {page}")
                times = {}
                for name, call in (
                    ("sglang_us", lambda r=reqs, p=page: sglang_sum(None, r, p)),
                    ("slots_short_us", lambda r=reqs, p=page: slots_short(r, p, RESERVE)),
                ):
                    times[name] = min(timeit.repeat(call, number=number, repeat=3)) / number * 1e6
                rows.append({"page": page, "bs": bs, **times})
    finally:
        schedule_batch.get_alloc_reserve_per_decode = real
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", type=Path, default=_stamp.REPO_ROOT / "results")
    parser.add_argument("--name", default="sglang_cpu_memory_check")
    args = parser.parse_args(argv)
    rows = measure(args.batch_sizes, args.pages)
    st = _stamp.stamp()
    table = _stamp.md_table(
        ["page", "bs", "SGLang's sum (us)", "slots_short (us)"],
        [[r["page"], r["bs"], r["sglang_us"], r["slots_short_us"]] for r in rows],
    )
    markdown = (
        "# SGLang's speculative memory check's sum against the reservation's (host time)\n\n"
        f"{_stamp.stamp_markdown(st)}\n\ncommand: `python -m lab.bench.memory_check`\n\n"
        "Every request holds the reserve (a DDTREE batch between top-ups): both sums are 0. "
        "Warm loops on this machine's CPU, best of three; a server's step runs it cold.\n\n"
        f"{table}\n"
    )
    for path in _stamp.write_outputs(args.out, args.name, {"stamp": st, "rows": rows}, markdown):
        print(path)


if __name__ == "__main__":
    main()
