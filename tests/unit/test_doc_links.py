"""Every link between the README and docs/ leads somewhere: to a file of the repository, and,
where it names a heading (``file.md#anchor``), to a heading of that file. Anchors are made as
GitHub makes them, so a link that works here works on the project's page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, every character but letters, digits, spaces,
    ``-`` and ``_`` dropped, each space a ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown text's headings; a repeated one numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    """The links of ``doc`` (outside code blocks) to a file that is not there or to a heading
    its file does not have."""
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            broken.append(f"{target}: {file.name} has no heading with that anchor")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_leads_to_a_file_and_heading_there(doc: Path) -> None:
    assert broken_links(doc) == []


def test_a_link_to_a_heading_renamed_or_a_file_moved_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text(
        "# Title\n\n## Fitted bases: what a basis costs a frame\n\n## Notes\n\n## Notes\n"
        "```bash\n# not a heading\n```\n"
    )
    doc = tmp_path / "doc.md"
    good = [
        "other.md",
        "other.md#fitted-bases-what-a-basis-costs-a-frame",
        "other.md#notes-1",
        "#here-1",
        "https://example.org/x#y",
    ]
    bad = ["other.md#fitted-bases", "other.md#not-a-heading", "gone.md", "#nowhere"]
    links = " ".join(f"[x]({t})" for t in good + bad)
    doc.write_text(f"# Here 1\n\n{links}\n\n```text\n[x](inside-a-block.md)\n```\n")
    assert broken_links(doc) == [
        "other.md#fitted-bases: other.md has no heading with that anchor",
        "other.md#not-a-heading: other.md has no heading with that anchor",
        "gone.md: no such file",
        "#nowhere: doc.md has no heading with that anchor",
    ]
