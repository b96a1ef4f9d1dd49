"""The manual stays a manual (fast, no server).

* No page of ``docs/`` and no README carries a commit hash or a date: dated rounds of
  measurement belong in ``lab/notes/``, and a commit belongs in a result's stamp.
* Every ``results/...`` path the README or a docs page names exists, and every local link
  they make resolves (the README's links to ``docs/*.md`` among them).

A commit hash is a run of 7-40 hex digits that git resolves to a commit of this repository,
or, whether or not git can tell (a shallow clone, no git), one that mixes letters and digits.
The checks run on the old notebook too (``lab/notes/``), which must fail them.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
NOTEBOOK = REPO / "lab" / "notes" / "gpu.md"

HEX_RUN = re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{7,40}(?![0-9A-Za-z])")
ISO_DATE = re.compile(r"(?<!\d)(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?!\d)")
YEAR = re.compile(r"(?<!\d)(?:19[89]\d|20[0-3]\d)(?!\d)")
HEADING = re.compile(r"^#{1,6}\s.*$", re.MULTILINE)
RESULTS_PATH = re.compile(r"(?<![\w-])results/[\w.*{},/-]*")
LOCAL_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
README_DOCS = re.compile(r"(?<![\w/-])docs/[\w.-]+\.md")


def _git_commits(words: set[str]) -> set[str] | None:
    """The words git resolves to a commit here; None where git cannot say (no git, not a
    checkout, a shallow clone without the history)."""
    if not words:
        return set()
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    shallow = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True
    )
    if shallow.returncode != 0 or shallow.stdout.strip() == "true":
        return None
    ordered = sorted(words)
    out = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "--batch-check"],
        input="".join(f"{w}^{{commit}}\n" for w in ordered),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return {w for w, line in zip(ordered, out) if line.split()[1:2] == ["commit"]}


def commit_hashes(text: str) -> set[str]:
    """The commit hashes ``text`` names (see the module docstring)."""
    words = set(HEX_RUN.findall(text))
    mixed = {w for w in words if re.search(r"[a-f]", w) and re.search(r"\d", w)}
    resolved = _git_commits(words)
    return mixed | (resolved or set())


def dated_headings(text: str) -> list[str]:
    """Headings that date a round: a date, a year, or a commit in the heading."""
    return [h for h in HEADING.findall(text) if ISO_DATE.search(h) or YEAR.search(h) or commit_hashes(h)]


def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for part in match.group(1).split(",") for p in _expand_braces(head + part + tail)]


def missing_results(text: str) -> list[str]:
    """The ``results/...`` paths (globs, ``{a,b}`` and a series' name without its extension
    allowed) that match no file."""
    missing = []
    for raw in RESULTS_PATH.findall(text):
        path = raw.rstrip(".,;:")
        if not any(glob.glob(str(REPO / p)) or glob.glob(str(REPO / p) + ".*") for p in _expand_braces(path)):
            missing.append(path)
    return missing


def broken_links(page: Path, text: str) -> list[str]:
    """Local markdown links of ``page`` whose target does not exist."""
    out = []
    for target in LOCAL_LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        if not (page.parent / target).exists():
            out.append(target)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_commit_hash_or_date(page):
    text = page.read_text()
    assert not commit_hashes(text), (
        f"{page.name} names commits {sorted(commit_hashes(text))}: lab/notes/ or results/"
    )
    assert not ISO_DATE.findall(text), f"{page.name} carries dates {ISO_DATE.findall(text)}"
    assert not dated_headings(text), f"{page.name} has dated headings {dated_headings(text)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_results_path_and_link_exists(page):
    text = page.read_text()
    assert not missing_results(text), f"{page.name} names results that do not exist: {missing_results(text)}"
    assert not broken_links(page, text), f"{page.name} links to missing files: {broken_links(page, text)}"


def test_every_docs_page_the_readme_names_exists():
    named = set(README_DOCS.findall((REPO / "README.md").read_text()))
    assert named, "the README links no docs page"
    assert not [p for p in named if not (REPO / p).exists()]


def test_the_checks_fail_the_old_notebook():
    """The dated notebook (the docs as they were) fails every check a manual page passes."""
    text = NOTEBOOK.read_text()
    assert len(commit_hashes(text)) > 20
    assert len(dated_headings(text)) > 10
    assert missing_results(text.replace("bench_results/", "results/"))  # series not kept
    if _git_commits({"0000000"}) is not None:  # with the history, hashes are resolved, not guessed
        assert _git_commits(set(HEX_RUN.findall(text))) & {"6125f69", "e835772", "002ee97"}
