"""Every citation of docs/ in the code resolves: the file exists and has the cited section
(`docs/bagel_layout.md §4.1`, `docs/opsd_loss.md a.1` or `§c.2`; a range `§4.1-4.3` cites its
first section, `§10 item 8` an item of section 10's list)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# "docs/<file>.md" and the sections that follow it: "§4.1", "a.1", "section a", "§4.1-4.3",
# "§10 item 8", several joined by commas.
PART = (
    r"(?:section |§)?([0-9]+(?:\.[0-9]+)?|[a-c](?:\.[0-9]+)?)\b(?:-[0-9.]+)?(?: items? ([0-9]+))?"
)


def citations(text: str):
    found = []
    for m in re.finditer(
        r"docs/(\w+\.md)((?:,? (?:section |§)?(?:[0-9]+(?:\.[0-9]+)?|[a-c](?:\.[0-9]+)?)"
        r"\b(?:-[0-9.]+)?(?: items? [0-9]+)?)*)",
        text,
    ):
        parts = re.findall(PART, m.group(2))
        found += [(m.group(1), section, item or None) for section, item in parts] or [
            (m.group(1), None, None)
        ]
    return found


def sections(doc: str) -> set[str]:
    """The section numbers a doc's headings give: '4.1', '10', 'a', 'a.1', 'c.2'."""
    found = set()
    for line in doc.splitlines():
        m = re.match(r"#+ (?:\(([a-z])\)|([0-9]+(?:\.[0-9]+)?)\.?|([a-z]\.[0-9]+)) ", line)
        if m:
            found.add(next(g for g in m.groups() if g))
    return found


def items(doc: str, section: str) -> set[str]:
    """The numbered items of a section's list ('1.', '2.', ... at a line start)."""
    part = re.split(rf"\n#+ {re.escape(section)}\.? ", doc, maxsplit=1)[-1]
    part = re.split(r"\n#+ ", part, maxsplit=1)[0]
    return set(re.findall(r"^([0-9]+)\. ", part, re.M))


def test_every_docs_citation_in_the_code_resolves():
    files = [
        p
        for d in ("models", "opsd_jax", "configs", "scripts", "bench", "tests")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "test_docs.py"
    ] + [ROOT / "train.py"]
    cited = [(p, c) for p in files for c in citations(p.read_text(encoding="utf-8"))]
    assert len(cited) >= 30  # the scan sees the citations
    problems = []
    for path, (name, section, item) in cited:
        doc_path = ROOT / "docs" / name
        where = f"{path.relative_to(ROOT)}: docs/{name}"
        if not doc_path.is_file():
            problems.append(f"{where}: no such file")
            continue
        doc = doc_path.read_text(encoding="utf-8")
        if section and section not in sections(doc):
            problems.append(f"{where} §{section}: no such section")
        elif section and item and item not in items(doc, section):
            problems.append(f"{where} §{section} item {item}: no such item")
    assert not problems, "\n".join(problems)


def test_a_missing_section_or_file_is_found():
    assert citations("see docs/opsd_loss.md §c.9 and docs/bagel_layout.md §10 item 4") == [
        ("opsd_loss.md", "c.9", None),
        ("bagel_layout.md", "10", "4"),
    ]
    assert "c.9" not in sections((ROOT / "docs" / "opsd_loss.md").read_text(encoding="utf-8"))
    assert "a.1" in sections((ROOT / "docs" / "opsd_loss.md").read_text(encoding="utf-8"))
    assert citations("docs/bagel_layout.md §4.1-4.3, §10 items 8") == [
        ("bagel_layout.md", "4.1", None),
        ("bagel_layout.md", "10", "8"),
    ]
    layout = (ROOT / "docs" / "bagel_layout.md").read_text(encoding="utf-8")
    assert "8" in items(layout, "10") and "99" not in items(layout, "10")
