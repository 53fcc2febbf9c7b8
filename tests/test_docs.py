"""The docs stay true to the tree: every role and module named, every link resolving, nothing
pointing outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def text_files() -> list[Path]:
    suffixes = {".md", ".py", ".yml", ".yaml", ".j2", ".sh", ".cfg", ".toml", ".txt", ""}
    return [p for p in tracked_files() if p.suffix in suffixes]


def test_architecture_names_every_role():
    roles = sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_dir())
    missing = [r for r in roles if f"`{r}`" not in ARCHITECTURE]
    assert not missing, f"docs/ARCHITECTURE.md does not name the roles {missing}"


def test_architecture_names_every_module():
    modules = sorted(p.name for p in (ROOT / "nanochat_cpu").glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if f"`{m}`" not in ARCHITECTURE]
    assert not missing, f"docs/ARCHITECTURE.md does not name the modules {missing}"


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for md in (p for p in tracked_files() if p.suffix == ".md"):
        for target in MARKDOWN_LINK.findall(md.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def github_anchors(md: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated heading's anchor suffixed -1, -2, ... (code blocks hold no headings)."""
    anchors, seen, fenced = set(), {}, False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6} (.*)", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_anchor_in_the_docs_resolves():
    """A link to a section (`FILE.md#section`, `#section`) names a heading the file has."""
    broken = []
    for md in (p for p in tracked_files() if p.suffix == ".md"):
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", md.read_text()):
            if "://" in target:
                continue
            dest = md.parent / target if target else md
            if dest.suffix == ".md" and dest.exists() and anchor not in github_anchors(dest):
                broken.append(f"{md.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, "links to no heading:\n" + "\n".join(broken)


def test_nothing_refers_outside_the_repository():
    """The catalogue of failures is docs/FAILURES.md, and work items are named by what they are:
    no path above the checkout, no "issue N" that only a tracker outside the repo can explain."""
    outside = re.compile(r"shared/(?:FAILURES|field-reports)|\bissues? #?\d+\b", re.IGNORECASE)
    bare_catalogue = re.compile(r"(?<![\w/])FAILURES(?:\.md\b| rows?\b)")  # outside docs/ it is docs/FAILURES.md
    hits = []
    for path in text_files():
        if path == Path(__file__).resolve():
            continue
        in_docs = path.parent == ROOT / "docs"
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line) or (not in_docs and bare_catalogue.search(line)):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_readme_is_a_manual_and_the_log_lives_in_benchmarks():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md is the manual; measurements go to docs/BENCHMARKS.md"
    top = "\n".join(readme.splitlines()[:8])
    assert "make demo" in top and "make test" in top, "the README opens with its two commands"
    assert "docs/BENCHMARKS.md" in readme
    prose = re.sub(r"\]\([^)]*\)", "]", readme)  # a link to a log entry names its date in the anchor
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", prose), "dated measurements belong in docs/BENCHMARKS.md"


def test_each_readme_result_is_one_short_line_linking_its_log_entry():
    """The Results table holds a headline figure per row, its machine and a link to the log entry
    with the history: a cell that grows past a line belongs in docs/BENCHMARKS.md."""
    readme = (ROOT / "README.md").read_text()
    results = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in results.splitlines() if line.startswith("| ") and not line.startswith("|---")][1:]
    assert rows, "README.md has a Results table"
    for row in rows:
        assert re.search(r"\]\(docs/BENCHMARKS\.md#[^)]+\)", row), f"links no log entry: {row[:80]}"
        for cell in row.strip().strip("|").split(" | "):
            text = re.sub(r"\]\([^)]*\)", "]", cell.strip())
            assert len(text) <= 100, f"a Results cell of {len(text)} characters: {text[:80]}..."
