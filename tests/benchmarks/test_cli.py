"""The studies run from the repository's root as `python -m benchmarks SECTION` (or their own
modules), and `jaxgen bench` keeps only the drivers."""

import subprocess
import sys

from benchmarks import cli as studies
from benchmarks import study_env
from jaxgen.bench import cli as drivers
from jaxgen.bench import harness


def run(*argv: str) -> str:
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=study_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_studies_and_drivers_are_apart():
    assert not set(studies.SECTIONS) & set(drivers.SECTIONS)
    assert {"disagg", "disagg-sim", "kvstore", "sharing", "overhead"} <= set(studies.SECTIONS)
    assert {"decode", "throughput", "serve", "startup"} <= set(drivers.SECTIONS)
    for name in studies.SECTIONS:
        assert harness.section_page(name)  # each study writes to a docs page


def test_the_documented_commands_answer():
    text = run("-m", "benchmarks", "--help")
    assert all(name in text for name in studies.SECTIONS)
    assert "disagg" not in run("-m", "jaxgen.cli", "bench", "--help").split("positional")[0]
    assert "--profile-only" not in run("-m", "benchmarks.disagg", "--help")
    assert "--out" in run("-m", "benchmarks.kvstore", "--help")
    assert "--write-docs" in run("-m", "benchmarks.quantization", "--help")
