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


@pytest.mark.slow
def test_bench_overhead_quick(tmp_path):
    out_json = tmp_path / "overhead.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxgen.cli",
            "bench",
            "overhead",
            "--quick",
            "--out",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    assert [(r["batch"], r["overlap"]) for r in rows] == [
        (1, "on"),
        (1, "off"),
        (4, "on"),
        (4, "off"),
    ]
    for r in rows:
        parts = sum(r[f"{k}_ms"] for k in ("schedule", "pack", "dispatch", "wait", "update"))
        assert 0 < parts <= r["step_ms"] and r["outside_engine_ms"] >= 0
        assert r["host_ms"] == pytest.approx(r["step_ms"] - r["wait_ms"])
        assert 0 < r["device_ms"] and 0 < r["alone_over_step"] <= 1.5  # replay vs in-loop noise
        assert 0 < r["device_busy"] <= 1  # a share of the traced call's wall time
        assert r["steps"] >= 4  # a prefill step and decode steps
    assert [g["shape"] for g in result["gemm"]] == [
        "[32,576] x [576,1536]",
        "[32,1536] x [1536,576]",
        "[32,576] x [576,49152]",
    ]
    assert all(g["xla_gflops"] > 0 and g["torch_gflops"] > 0 for g in result["gemm"])
    whole = result["whole_calls"]
    assert [(r["batch"], r["overlap"]) for r in whole] == [
        (1, "on"),
        (1, "off"),
        (2, "on"),
        (2, "off"),
    ]
    for r in whole:
        assert r["ratio"] == pytest.approx(r["hf_s"] / r["ours_s"]) and r["ours_s"] > 0
        assert r["ours_decode_tok_s"] > 0 and r["hf_decode_tok_s"] > 0
    assert "| batch | overlap | step ms | device ms |" in out.stdout
    assert "| batch | overlap | jaxgen s | transformers s |" in out.stdout


def test_union_of_spans_is_clipped_and_counts_overlaps_once():
    from jaxgen.bench.overhead import _union_ms

    spans = [(5, 8), (0, 2), (1, 3), (7, 12), (20, 30)]
    # [0,3) + [5,12) inside [1, 25): [1,3) + [5,12) + [20,25)
    assert _union_ms(spans, 1, 25) == 2 + 7 + 5
    assert _union_ms(spans, 13, 19) == 0
    assert _union_ms([], 0, 10) == 0
