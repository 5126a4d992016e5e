"""The documentation's references hold: every ``docs/...md`` path cited in README.md, CONTRIBUTING.md, docs/, ctuq/
and scripts/ exists, every relative Markdown link of README.md, CONTRIBUTING.md and docs/ resolves (file and
``#anchor``), every script they name exists, and no two documentation files differ only in case (they collide on
macOS and Windows).

Reads text files only (no torch): a second or so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: ``docs/<name>.md`` (or ``docs/notebook/<name>.md``) as cited in prose, docstrings and messages.
DOC_PATH = re.compile(r"\bdocs/(?:[A-Za-z0-9_]+/)*[A-Za-z0-9_]+\.md\b")
#: ``[text](target)`` with a relative target (not a URL, not a bare anchor).
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: ``scripts/<name>.py`` as cited in the README and the guide.
SCRIPT_PATH = re.compile(r"\bscripts/[A-Za-z0-9_]+\.py\b")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*```")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]


def _guide_files() -> list[Path]:
    """README.md, CONTRIBUTING.md and the guide (docs/*.md): the pages that must name only what exists today. The
    notebook may cite files that are gone (it is a dated record that says where they are kept)."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]


def _citing_files() -> list[Path]:
    py = [p for d in ("ctuq", "scripts", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    return _markdown_files() + py


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped (letters, digits, ``_`` and ``-``
    kept, any script), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of a Markdown file (outside code fences), with GitHub's ``-1``, ``-2`` suffixes
    for repeated headings."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        m = None if in_code else HEADING.match(line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_cited_docs_path_exists():
    missing = [
        f"{_rel(f)}: {cited}"
        for f in _citing_files()
        for cited in sorted(set(DOC_PATH.findall(f.read_text(encoding="utf-8"))))
        if not (ROOT / cited).is_file()
    ]
    assert not missing, "cited documentation files that do not exist:\n" + "\n".join(missing)


def _links(path: Path) -> list[str]:
    """Relative link targets of a Markdown file, code spans and fences excluded."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in MD_LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_every_relative_markdown_link_resolves():
    broken = []
    for f in _markdown_files():
        for target in _links(f):
            file_part, _, anchor = target.partition("#")
            dest = f if not file_part else (f.parent / file_part).resolve()
            if not dest.exists():
                broken.append(f"{_rel(f)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{_rel(f)}: {target} (no heading with that anchor in {_rel(dest)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_script_the_readme_and_the_guide_name_exists():
    missing = [
        f"{_rel(f)}: {cited}"
        for f in _guide_files()
        for cited in sorted(set(SCRIPT_PATH.findall(f.read_text(encoding="utf-8"))))
        if not (ROOT / cited).is_file()
    ]
    assert not missing, "scripts named in the README or the guide that do not exist:\n" + "\n".join(missing)


def test_no_two_documentation_files_differ_only_in_case():
    paths = [p for p in [*DOCS.rglob("*"), *ROOT.glob("*.md")]]
    by_lower: dict[str, list[str]] = {}
    for p in paths:
        by_lower.setdefault(_rel(p).lower(), []).append(_rel(p))
    clashes = [names for names in by_lower.values() if len(names) > 1]
    assert not clashes, f"names that differ only in case: {clashes}"


@pytest.mark.parametrize(
    "heading, slug",
    [
        (
            "2.1 The g-prior's ridge (`gprior_floor`, 2026-11-25, third session)",
            "21-the-g-priors-ridge-gprior_floor-2026-11-25-third-session",
        ),
        (
            "What does work: τ alone, with the posterior kept as it is (k = 1)",
            "what-does-work-τ-alone-with-the-posterior-kept-as-it-is-k--1",
        ),
        ("`uq.calibration: bias` (applies τ alone)", "uqcalibration-bias-applies-τ-alone"),
    ],
)
def test_github_slug_matches_githubs_rule(heading, slug):
    assert github_slug(heading) == slug


def test_a_missing_anchor_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```\n# not a heading\n```\n\n## Part A\n\n## Part A\n", encoding="utf-8")
    assert anchors(page) == {"title", "part-a", "part-a-1"}
    assert "not-a-heading" not in anchors(page)
