"""GPU job helper: which collected tests a pytest log (``-v``) shows no result for.

    python gpu/jobs/unfinished_tests.py COLLECTED LOG

COLLECTED is ``pytest --collect-only -q`` of the same selection. A run cut by its time limit
ends with a summary of what did run ("14 passed, 1 skipped"), which reads like a whole suite;
this prints how many of the collected tests finished and names the rest. Exit status 1 when
some did not finish.
"""

from __future__ import annotations

import re
import sys

RESULT = re.compile(r"^(\S+::\S+) (?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def unfinished(collected: str, log: str) -> tuple[list[str], list[str]]:
    """(every collected test id, those without a result line in the log), in collection order."""
    ids = [line.strip() for line in collected.splitlines() if "::" in line]
    finished = set(RESULT.findall(log))
    return ids, [test for test in ids if test not in finished]


def main(argv: list[str]) -> int:
    with open(argv[1]) as a, open(argv[2], errors="replace") as b:
        ids, left = unfinished(a.read(), b.read())
    if not left:
        print(f"suite complete: {len(ids)} of {len(ids)} tests finished")
        return 0
    print(f"SUITE INCOMPLETE: {len(ids) - len(left)} of {len(ids)} tests finished; not finished:")
    for test in left:
        print(f"  {test}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
