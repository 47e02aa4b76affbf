"""The benchmark scripts run end to end at tiny sizes (their numbers are not judged here)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import docs_pages


@pytest.mark.slow
def test_bench_decode_quick(tmp_path):
    """Also: without --write-docs a benchmark leaves every docs page as it was."""
    out_json = tmp_path / "decode.json"
    before = docs_pages()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxgen.cli",
            "bench",
            "decode",
            "--quick",
            "--batches",
            "1,2",
            "--new-tokens",
            "4",
            "--prefill-len",
            "16",
            "--repeats",
            "1",
            "--out",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out_json.read_text())
    rows = {r["what"]: r for r in result["rows"]}
    assert set(rows) == {"decode batch 1", "decode batch 2", "prefill 16 tokens"}
    assert all(r["ours_tok_s"] > 0 for r in rows.values())
    assert 0 < rows["decode batch 1"]["mbu"] and result["limits"]["read_gbps"] > 0
    assert "| decode batch 1 |" in out.stdout
    assert docs_pages() == before


def test_plot_writes_a_png(tmp_path):
    from jaxgen.bench import harness

    rel = harness.plot(
        "t.png",
        {"a": ([1, 8, 32], [50.0, 280.0, 500.0]), "b": ([1, 8, 32], [23.0, None, 320.0])},
        xlabel="batch",
        ylabel="tok/s",
        title="t",
        logx=True,
        directory=str(tmp_path),
    )
    assert rel.endswith("t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_section_has_a_page_that_holds_it(tmp_path):
    """Each section `jaxgen bench` writes goes to a page that exists, every section found on the
    pages is on the page the map names, and write_section replaces a section in place and wraps
    its prose."""
    import re
    from pathlib import Path

    from jaxgen.bench import cli, harness

    for name in [*cli.SECTIONS, "throughput:pp=2", "e2e-gpu", "kernels-flash"]:
        assert Path(harness.section_page(name)).exists(), name
    found = 0
    for page in Path(harness.DOCS).glob("*.md"):
        for name in re.findall(r"^<!-- bench:(.*?) -->$", page.read_text(), re.M):
            found += 1
            assert Path(harness.section_page(name)) == page, (name, page.name)
    assert found >= len(cli.SECTIONS) - 1
    with pytest.raises(ValueError, match="SECTION_PAGES"):
        harness.section_page("no-such-section")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- bench:decode -->\nold\n<!-- /bench:decode -->\n\nafter\n")
    harness.write_section("decode", "new " + "word " * 40, str(page))
    text = page.read_text()
    assert "old" not in text and text.endswith("<!-- /bench:decode -->\n\nafter\n")
    assert max(len(line) for line in text.splitlines()) <= harness.PROSE_WIDTH
