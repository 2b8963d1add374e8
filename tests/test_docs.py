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


# --------------------------------------------------------------------------- reference pages
REFERENCE = ("README.md", "architecture.md", "concepts.md", "environments.md", "config.md",
             "run-directory.md", "gates.md")
"""docs/ pages that describe the tree as it is (results.md and performance.md are dated
notebooks: a name there is true of the commit it was written at)."""
DOTTED = re.compile(r"\bclosedloop(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"\b(?:closedloop|tests|benchmarks|configs|scripts)/[\w./-]*[\w/]")


def _reference_text() -> dict[str, str]:
    pages = {name: (ROOT / "docs" / name).read_text(encoding="utf-8") for name in REFERENCE}
    pages["../README.md"] = (ROOT / "README.md").read_text(encoding="utf-8")
    return pages


def _resolves(dotted: str) -> bool:
    """``closedloop.a.b.c``: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:n]))
        except ModuleNotFoundError:
            continue
        for attr in parts[n:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_in_the_reference_pages_exists() -> None:
    from closedloop.envs.discovery import ENTRY_POINT_GROUP

    names = {m for text in _reference_text().values() for m in DOTTED.findall(text)}
    assert len(names) > 60
    assert ENTRY_POINT_GROUP in names  # named in environments.md; a group, not a module
    missing = sorted(n for n in names - {ENTRY_POINT_GROUP} if not _resolves(n))
    assert missing == []


def test_every_path_in_the_reference_pages_exists() -> None:
    paths = {m for text in _reference_text().values() for m in PATH.findall(text)}
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []


def test_the_pages_link_to_pages_that_exist() -> None:
    pages = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    assert len(pages) >= 10
    broken = [f"{page.name}: {link}" for page in pages
              for link in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)",
                                     page.read_text(encoding="utf-8"))
              if not (page.parent / link).is_file()]
    assert broken == []


def test_the_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages == set(re.findall(r"\]\(([\w-]+\.md)\)", index)) - {"CONTRIBUTING.md"}


def test_the_notebooks_say_they_are_notebooks() -> None:
    for name in ("results.md", "performance.md"):
        head = (ROOT / "docs" / name).read_text(encoding="utf-8")[:400]
        assert "lab notebook" in head.lower(), name


# --------------------------------------------------------------------------- config reference
def _keys(obj: object, prefix: str = "") -> list[str]:
    import dataclasses

    out = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _keys(value, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_the_config_reference_lists_every_key_with_its_default() -> None:
    from closedloop.config import RunConfig

    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", text, flags=re.M))
    keys = _keys(RunConfig())
    assert len(keys) > 60
    assert sorted(set(keys) - set(rows)) == []  # a key the reference does not document
    assert sorted(set(rows) - set(keys)) == []  # a documented key that no longer exists
    defaults = {key: _default(RunConfig(), key) for key in keys}
    wrong = sorted(k for k in keys if rows[k] != defaults[k])
    assert wrong == []  # the default the page states is the code's


def _default(cfg: object, key: str) -> str:
    import json

    value: object = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return json.dumps(value, ensure_ascii=False)[1:-1] if isinstance(value, str) \
        else json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
