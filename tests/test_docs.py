"""The docs stand alone: no tracked source or doc names a path outside the repo, every relative markdown
link in README.md and docs/ resolves to a file of the repo, and every doc is linked from another."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Paths of a development machine or of material beside the checkout. Spelt in pieces so that this file
# does not name them itself.
OUTSIDE_PATHS = ("../" + "shared", "/" + "work/", "/" + "root/", "/" + "home/")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)


def tracked_files(*patterns: str) -> list[Path]:
    """Tracked files matching git pathspecs, e.g. '*.md'."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs a git checkout to list tracked files: {e}")
    # a file deleted in the work tree but still in the index (a copy whose .git lags behind) has nothing to read
    return [ROOT / name for name in out.split("\0") if name and (ROOT / name).exists()]


def outside_path_mentions(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line that names a path outside the repo."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)
            if any(p in line for p in OUTSIDE_PATHS)]


def relative_links(text: str) -> list[str]:
    """Link targets of a markdown text that point into the repo (no URL, no bare #anchor), code blocks
    excluded, anchors stripped."""
    text = _FENCE.sub("", text)
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http:, https:, mailto: ... or a heading of the same page
        targets.append(target.split("#", 1)[0])
    return targets


def broken_links(md_file: Path, root: Path) -> list[str]:
    """The relative links of md_file whose target is missing or lies outside `root`."""
    bad = []
    for target in relative_links(md_file.read_text(encoding="utf-8")):
        resolved = (md_file.parent / target).resolve()
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            bad.append(target)
    return bad


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_tracked_file_names_a_path_outside_the_repo():
    files = tracked_files("*.md", "*.py")
    assert len(files) > 50  # the listing really covers the repo
    found = [f"{f.relative_to(ROOT)}:{n}: {line}" for f in files
             for n, line in outside_path_mentions(f.read_text(encoding="utf-8", errors="replace"))]
    assert not found, "files name paths outside the repo:\n" + "\n".join(found)


def test_relative_markdown_links_resolve():
    docs = _docs()
    assert len(docs) > 5
    bad = [f"{d.relative_to(ROOT)} -> {t}" for d in docs for t in broken_links(d, ROOT)]
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def test_every_doc_is_linked_from_the_readme_or_another_doc():
    linked = set()
    for d in _docs():
        linked |= {(d.parent / t).resolve() for t in relative_links(d.read_text(encoding="utf-8"))}
    orphans = [str(d.relative_to(ROOT)) for d in sorted((ROOT / "docs").glob("*.md")) if d.resolve() not in linked]
    assert not orphans, f"docs no other doc links to: {orphans}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The checkers themselves: each finds a planted fault and passes a clean file."""
    outside = "see " + OUTSIDE_PATHS[0] + "/docs/x.md and " + OUTSIDE_PATHS[1] + "main/y.py"
    assert [n for n, _ in outside_path_mentions("fine\n" + outside + "\nfine")] == [2]
    assert outside_path_mentions("docs/ddtree.md, https://arxiv.org/abs/2604.12989") == []

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# a\n")
    page = tmp_path / "docs" / "b.md"
    page.write_text("[ok](a.md) [ok too](a.md#a) [web](https://example.org/x.md) [here](#a)\n"
                    "[gone](missing.md) [escapes](../../elsewhere.md) ![img](../pic.png)\n"
                    "```\n[in code](not_checked.md)\n```\n")
    assert broken_links(page, tmp_path) == ["missing.md", "../../elsewhere.md", "../pic.png"]
    (tmp_path / "pic.png").write_bytes(b"")
    assert broken_links(page, tmp_path) == ["missing.md", "../../elsewhere.md"]
