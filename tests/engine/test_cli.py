"""The `jaxgen` command line, run as a user would."""

import subprocess
import sys


def run_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_default_prompt_answers_sensibly():
    out = run_cli("generate", "What is the capital of France?", "--max-tokens", "16")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_generate_unknown_model_is_a_clear_error(tmp_path):
    out = run_cli("generate", "hi", "--model", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "no such file or directory" in out.stderr and "Traceback" not in out.stderr


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0 and "generate" in out.stdout and "convert" in out.stdout
