"""The docs' cross-references, read from the text: a section cited by name exists where it is cited."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
CITATION = re.compile(r'(?:docs/)?([A-Za-z_]+)\.md,?\s+"([^"]+)"')
"""``docs/x.md "Section"`` or ``docs/x.md, "Section"``, the way the project's files cite a section."""


def sections(doc: pathlib.Path) -> list[str]:
    """What a citation may name in ``doc``: its headings, and the bold lead-ins of its paragraphs and items."""
    text = doc.read_text()
    return ([line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
            + re.findall(r"\*\*([^*]+)\*\*", text))


def citations() -> list[tuple[str, str, str]]:
    """(citing file, cited file, cited name) of every citation in the README, the docs and the Python sources."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [path for where in ("titan_recover", "benchmarks", "scripts", "tests")
              for path in sorted((ROOT / where).rglob("*.py")) if path != pathlib.Path(__file__).resolve()]
    found = []
    for path in files:
        for match in CITATION.finditer(path.read_text()):
            name = " ".join(word for word in match.group(2).split() if word != "#")  # wrapped, maybe in a comment
            found.append((str(path.relative_to(ROOT)), match.group(1), name))
    return found


def test_every_section_cited_by_name_exists_in_the_file_it_is_cited_from():
    found = citations()
    assert len(found) > 50  # the pattern still matches how the files cite
    missing = []
    for citing, cited, name in found:
        doc = ROOT / "README.md" if cited == "README" else ROOT / "docs" / f"{cited}.md"
        if not doc.exists():
            missing.append(f"{citing}: {cited}.md does not exist")
        elif not any(name in section for section in sections(doc)):
            missing.append(f'{citing}: {cited}.md has no section "{name}"')
    assert not missing, "\n".join(missing)
