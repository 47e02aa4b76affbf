"""docs/ stays a set of pages, not an archive: the index reaches every page, every file under
docs/ is referenced by a page or by the code that reads it, the folder stays small, and prose
lines stay as `harness.wrap_prose` leaves them (tables, headings and code are left whole)."""

import re
from pathlib import Path

from jaxgen.bench import harness

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_BYTES = 3 << 20  # docs/ is published with the repository; archived runs go to git history
SOURCES = ["README.md", "Makefile", "jaxgen", "tests", "notebooks"]


def pages() -> list[Path]:
    """The pages: Markdown at the top of docs/ (a run's folder holds its own raw report)."""
    return sorted(DOCS.glob("*.md"))


def links(page: Path) -> set[Path]:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    return {(page.parent / t).resolve() for t in targets if "://" not in t}


def test_index_reaches_every_page():
    seen, todo = set(), [DOCS / "index.md"]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        todo += [p for p in links(page) if p.suffix == ".md" and p.is_relative_to(DOCS)]
    unreached = [str(p.relative_to(ROOT)) for p in pages() if p.resolve() not in seen]
    assert not unreached, f"pages no link from docs/index.md reaches: {unreached}"


def test_every_file_is_referenced():
    """A file is referenced when a page names its path (relative to docs/, as a link or in
    backticks) or the code names `docs/PATH`; a run's folder (two levels down, such as
    gpu/DATE-run1/) named references the files in it."""
    text = "\n".join(p.read_text() for p in pages())
    for name in SOURCES:
        path = ROOT / name
        files = [path] if path.is_file() else path.rglob("*")
        readable = [
            f for f in files if f.is_file() and f.suffix in (".py", ".md", ".sh", ".ipynb", "")
        ]
        text += "\n".join(f.read_text(errors="ignore") for f in readable)
    unreferenced = []
    for f in sorted(DOCS.rglob("*")):
        if not f.is_file() or f == DOCS / "index.md":
            continue
        relative = f.relative_to(DOCS)
        runs = [parent for parent in relative.parents if len(parent.parts) >= 2]
        names = [str(relative), *(f"{run}/" for run in runs)]
        if not any(n in text or f"docs/{n}" in text for n in names):
            unreferenced.append(str(relative))
    assert not unreferenced, f"files under docs/ that nothing references: {unreferenced}"


def test_docs_stay_small():
    size = sum(f.stat().st_size for f in DOCS.rglob("*") if f.is_file())
    assert size <= MAX_BYTES, f"docs/ holds {size / 2**20:.1f} MiB (at most {MAX_BYTES >> 20})"


def test_prose_lines_are_wrapped():
    for page in pages():
        text = page.read_text()
        assert harness.wrap_prose(text) == text, (
            f"{page.relative_to(ROOT)} has prose lines over {harness.PROSE_WIDTH} characters: "
            "rewrap them (jaxgen.bench.harness.wrap_prose)"
        )
