"""Every benchmark record a document names exists: `bench/results/...` paths in README.md, bench/README.md
and docs/ (brace alternatives `{a,b}` expanded, `*` a glob that must match), and every image a doc shows."""
import glob
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
RECORD = re.compile(r"bench/results/[A-Za-z0-9_.\-{},*]+")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def expand(path: str):
    """``a.{json,md}`` → [a.json, a.md]; several groups multiply out."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand(path[:m.start()] + alt + path[m.end():])]


def cited(text: str):
    for m in RECORD.finditer(text):
        yield from (p.rstrip(".,") for p in expand(m.group(0).rstrip(".,")))


def test_expand_and_cited():
    assert expand("bench/results/a{,-b}.{json,md}") == ["bench/results/a.json", "bench/results/a.md",
                                                        "bench/results/a-b.json", "bench/results/a-b.md"]
    assert list(cited("see `bench/results/x.json`, and bench/results/y.*.")) == ["bench/results/x.json",
                                                                                 "bench/results/y.*"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_every_cited_record_exists(doc):
    text = doc.read_text()
    missing = [p for p in cited(text) if not glob.glob(str(REPO / p))]
    assert not missing, f"{doc.relative_to(REPO)} cites records that do not exist: {missing}"
    for link in IMAGE.findall(text):
        if "://" not in link:
            assert (doc.parent / link).is_file(), f"{doc.relative_to(REPO)}: image {link} does not exist"


def test_the_docs_cite_records_at_all():
    assert sum(1 for doc in DOCS for _ in cited(doc.read_text())) > 50


def test_every_record_is_cited():
    """bench/results/ keeps only what a document cites: by path (``bench/results/<record>.json``, braces and
    globs expanded) or by name or label in backticks (`learning_curve-paper`, `converge_2k`, `verify_cost.*`)."""
    text = "\n".join(d.read_text() for d in DOCS)
    named = set()
    for p in cited(text):
        named |= {Path(g).name.split(".")[0] for g in glob.glob(str(REPO / p))}
    ticked = set(re.findall(r"`([A-Za-z0-9_\-]+)(?:\.[^`\s]*)?`", text))      # `name`, `name.*`, `name.{json,md}`
    uncited = []
    for f in sorted((REPO / "bench" / "results").glob("*.json")):
        stem = f.name.split(".")[0]                     # a record's parts (<record>.<part>.json) go with it
        label = stem.split("-", 1)[1] if "-" in stem else None
        if stem not in named and stem not in ticked and label not in ticked:
            uncited.append(f.name)
    assert not uncited, f"records no document cites (cite them or delete them; git keeps them): {uncited}"
