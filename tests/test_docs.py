"""The documentation stays a reference a reader can follow: code cites ideas by their page in
docs/, never a document outside the repository, and every concept a comment cites has its
section in docs/concepts.md.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONCEPTS = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
OUTSIDE = re.compile(r"[Ss]eeds? ?0\d\d|seeds?/0|design\.md|design §|RESULTS\.md|the seed's")
"""A citation of a document that is not in the repository (the specification texts, a design
note, a results file that does not exist)."""


def _sources() -> list[Path]:
    files = sorted((ROOT / "closedloop").rglob("*.py"))
    assert len(files) > 150  # the whole package, not an empty glob
    return files


def test_no_module_cites_a_document_outside_the_repository() -> None:
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in _sources()
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if OUTSIDE.search(line)]
    assert hits == []


def test_the_pattern_catches_a_citation() -> None:
    assert OUTSIDE.search("(seed 000 §6, admission)") and OUTSIDE.search("design.md §7")
    assert not OUTSIDE.search("(docs/concepts.md, staleness admission)")


def anchors() -> set[str]:
    return set(re.findall(r'^<a id="([a-z0-9-]+)"></a>$', CONCEPTS, flags=re.M))


def test_every_concept_has_an_anchor_a_heading_and_an_index_row() -> None:
    ids = anchors()
    assert len(ids) >= 25
    index = set(re.findall(r"^\| \[`([a-z0-9-]+)`\]\(#\1\) \|", CONCEPTS, flags=re.M))
    assert index == ids
    lines = CONCEPTS.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("<a id="):
            assert lines[i + 1].startswith("#"), line  # the anchor sits on its heading


def test_a_concept_cited_in_the_code_has_a_section() -> None:
    headings = {h.strip().lower() for h in re.findall(r"^#{2,3} (.+)$", CONCEPTS, flags=re.M)}
    cited = {m.group(1).strip().lower()
             for path in _sources()
             for m in re.finditer(r"docs/concepts\.md,\s+([^):;]+)",
                                  " ".join(path.read_text(encoding="utf-8").split()))}
    assert len(cited) >= 15
    missing = sorted(c for c in cited if not any(c == h or c in h for h in headings))
    assert missing == []
