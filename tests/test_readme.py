"""Every code block of the README and of every docs page it links runs: Python blocks in a
fresh interpreter each, shell lines as commands on the default model (the server block is
started and the client blocks run against it). A block this file does not know how to run fails
the test, so a new example cannot slip in untested; the only lines not run are the set-up
commands this suite itself runs under (`make run` is CI's first stage on a fresh clone, `make
test` is this suite)."""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jaxgen.bench.serve_load import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def linked_pages(page: Path) -> list[Path]:
    """The Markdown pages of this repository that `page` links (relative links, anchors off)."""
    targets = re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text())
    pages = []
    for target in dict.fromkeys(targets):
        path = (page.parent / target).resolve()
        assert path.is_file(), f"{page.name} links {target}, which does not exist"
        pages.append(path)
    return pages


PAGES = [README, *linked_pages(README)]
NOT_RUN = {  # line prefix -> why
    "make ": "the set-up this suite runs under (CI: `make run` on a fresh clone, `make test`)",
}
TIMEOUT = 900


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, code, line number) of each fenced block."""
    out, lang, start, lines = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence and lang is None:
            lang, start, lines = fence.group(1) or "text", number, []
        elif line.startswith("```") and lang is not None:
            out.append((lang, "\n".join(lines) + "\n", start))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, f"{path}: unclosed code block at line {start}"
    return out


ALL = [(page, *b) for page in PAGES for b in blocks(page)]


def shell_lines(code: str) -> list[str]:
    return [ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def jaxgen_argv(line: str, substitutions: dict[str, str]) -> list[str]:
    for old, new in substitutions.items():
        line = line.replace(old, new)
    words = shlex.split(line, comments=True)
    assert words[0] in (".venv/bin/jaxgen", "jaxgen"), f"not a jaxgen command: {line}"
    return [sys.executable, "-m", "jaxgen.cli", *words[1:]]


def run_python(code: str, cwd, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd,
        **kwargs,
    )
    assert out.returncode == 0, f"{code}\n--- stderr ---\n{out.stderr[-4000:]}"
    return out


def test_every_block_is_run_by_this_file():
    assert ALL, "no code blocks found"
    assert len(PAGES) > 1, "the README links no docs page"
    for page, lang, code, line in ALL:
        assert lang in ("sh", "python"), f"{page.name}:{line}: a ```{lang} block is not run"
        if lang == "sh":
            for ln in shell_lines(code):
                runnable = ln.startswith((".venv/bin/jaxgen ", "jaxgen "))
                assert runnable or ln.startswith(tuple(NOT_RUN)), f"{page.name}:{line}: {ln}"


SERVER_BLOCKS = [b for b in ALL if "jaxgen serve" in b[2] or "base_url=" in b[2]]
PLAIN = [b for b in ALL if b not in SERVER_BLOCKS]


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A real (random-weight) Hugging Face model directory for the `convert` example."""
    from jaxgen.model import load_tokenizer
    from tests.helpers import tiny_hf_model

    directory = tmp_path_factory.mktemp("hf")
    tiny_hf_model(str(directory), "llama")
    load_tokenizer(None).save_pretrained(str(directory))
    return str(directory)


@pytest.mark.slow
@pytest.mark.parametrize("page,lang,code,line", PLAIN, ids=[f"{b[0].name}:{b[3]}" for b in PLAIN])
def test_block_runs(page, lang, code, line, tmp_path, tiny_hf_dir):
    if lang == "python":
        run_python(code, tmp_path)
        return
    substitutions = {"path/to/hf_model_dir": tiny_hf_dir, "/tmp/my-model": str(tmp_path / "m")}
    for ln in shell_lines(code):
        if ln.startswith(tuple(NOT_RUN)):
            continue
        argv = jaxgen_argv(ln, substitutions)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
        assert out.returncode == 0, f"{ln}\n--- stderr ---\n{out.stderr[-4000:]}"
        assert out.stdout.strip(), f"{ln}: printed nothing"


@pytest.mark.slow
def test_server_and_client_blocks_run(tmp_path):
    (serve,) = [b for b in SERVER_BLOCKS if "jaxgen serve" in b[2]]
    clients = [b for b in SERVER_BLOCKS if "base_url=" in b[2]]
    assert clients, "the README's server section has no client example"
    port = str(free_port())
    (line,) = shell_lines(serve[2])
    argv = jaxgen_argv(line.replace("8000", port), {})
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + TIMEOUT
        while time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).text == "ok":
                    break
            except httpx.HTTPError:
                time.sleep(1)
        for _, _, code, _ in clients:
            out = run_python(code.replace("8000", port), tmp_path, env=dict(os.environ))
            assert "Paris" in out.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=60)
