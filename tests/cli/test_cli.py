"""The `jaxgen` command line, run as a user would."""

import json
import os
import re
import subprocess
import sys

import pytest

WIKITEXT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "wikitext-2")


def run_cli(*args, stdin=None, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "jaxgen.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
        env=env,
    )


def test_generate_answers_sensibly():
    out = run_cli("generate", "What is the capital of France?", "--max-tokens", "16")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_generate_json_from_file_and_stdin(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 2?\nName a colour.\n")
    out = run_cli("generate", "--file", str(prompts), "--json", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["What is 2 + 2?", "Name a colour."]
    assert all(x["outputs"][0]["token_ids"] and x["metrics"]["ttft_s"] > 0 for x in lines)
    piped = run_cli("generate", "-", "--json", "--max-tokens", "4", stdin="Hello there")
    assert piped.returncode == 0 and json.loads(piped.stdout)["prompt"] == "Hello there"


def test_chat_multi_turn():
    out = run_cli(
        "chat", "--max-tokens", "12", "--stats", stdin="My name is Ada.\nWhat is my name?\n/exit\n"
    )
    assert out.returncode == 0, out.stderr
    replies = [r for r in out.stdout.split("> ") if r.strip()]
    assert len(replies) == 2
    # The second turn's prompt carries the first exchange (multi-turn history).
    sizes = [int(x) for x in re.findall(r"^\[(\d+) prompt tokens", out.stderr, re.M)]
    assert len(sizes) == 2 and sizes[1] > sizes[0] + 10


@pytest.mark.slow
def test_perplexity_prints_json_last():
    out = run_cli(
        "perplexity",
        "--text",
        os.path.join(WIKITEXT, "test.txt"),
        "--max-tokens",
        "600",
        "--max-length",
        "256",
        "--stride",
        "128",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 599 and 5 < result["perplexity"] < 100


def test_bad_flags_are_clear_errors(tmp_path):
    out = run_cli("generate", "hi", "--temperature", "-1")
    assert out.returncode == 2 and "temperature must be >= 0" in out.stderr
    out = run_cli("generate", "hi", "--model", str(tmp_path / "missing"))
    assert out.returncode == 2 and "no such file or directory" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_cli("generate", "hi", "--cover-new-shapes", "0.5")
    assert out.returncode == 2 and "cover_new_shapes must be 0 (off) or >= 1" in out.stderr
    assert "Traceback" not in out.stderr


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("generate", "chat", "perplexity", "convert", "bench"):
        assert command in out.stdout


@pytest.mark.slow
def test_second_process_start_hits_compilation_cache(tmp_path):
    """The persistent compilation cache (asked for) makes the second start skip XLA compilation;
    without asking, LLM leaves jax.config alone."""
    code = (
        "import jax, jax.monitoring as m\n"
        "hits, misses = [], []\n"
        "m.register_event_listener(lambda e, **k: hits.append(e) if e.endswith('cache_hits') else "
        "(misses.append(e) if e.endswith('cache_misses') else None))\n"
        "from jaxgen import LLM, SamplingParams\n"
        "llm = LLM(compilation_cache=True)\n"
        "llm.generate(['Hi'], SamplingParams(max_tokens=4, temperature=0))\n"
        "print(len(hits), len(misses), llm.startup['compile_s'])\n"
    )
    env = dict(os.environ, JAXGEN_CACHE=str(tmp_path))
    env.pop("JAXGEN_CACHE_XLA", None)
    # Share the converted model with the default cache so only the XLA cache is fresh.
    from jaxgen.model.loading import default_model_dir

    os.makedirs(tmp_path / "models", exist_ok=True)
    os.symlink(default_model_dir(), tmp_path / "models" / os.path.basename(default_model_dir()))
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    hits1, misses1, _ = first.stdout.split()
    hits2, misses2, _ = second.stdout.split()
    assert int(misses1) > 0
    assert int(hits2) >= int(misses1) and int(misses2) == 0


def test_generate_reads_stdin_only_for_dash():
    """From a script (stdin not a terminal) without a prompt, the default prompt is used."""
    import io

    from jaxgen.cli.generate import DEFAULT_PROMPT, read_prompts
    from jaxgen.cli.main import build_parser

    parser = build_parser()
    real = sys.stdin
    try:
        sys.stdin = io.StringIO("from stdin")
        assert read_prompts(parser.parse_args(["generate"])) == [DEFAULT_PROMPT]
        assert read_prompts(parser.parse_args(["generate", "-"])) == ["from stdin"]
    finally:
        sys.stdin = real


def _subcommands():
    from jaxgen.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices


def test_every_subcommand_describes_itself_and_every_option_its_default():
    for name, p in _subcommands().items():
        assert p.description, name
        text = p.format_help()
        for action in p._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, (name, action.option_strings)
            # argparse appends "(default: ...)" to each option's help.
            assert p.formatter_class.__name__ == "HelpFormatter", name
            assert action.option_strings[-1] in text
        assert text.count("(default:") >= sum(
            1 for a in p._actions if a.option_strings and a.dest != "help"
        ), name


def test_options_that_do_not_apply_are_not_offered():
    commands = _subcommands()
    flags = {
        name: {s for a in p._actions for s in a.option_strings} for name, p in commands.items()
    }
    assert "--n" not in flags["chat"] and "--logprobs" not in flags["chat"]
    assert {"--speculative", "--mesh", "--kv-cache", "--compile-buckets"}.isdisjoint(
        flags["perplexity"]
    )
    assert "--no-write" not in flags["bench"] and "--write-docs" in flags["bench"]


def test_tool_call_parser_is_offered_where_chats_are_served():
    from jaxgen.cli.main import build_parser

    parser = build_parser()
    for command in ("serve", "batch"):
        args = ["in.jsonl", "out.jsonl"] if command == "batch" else []
        got = parser.parse_args([command, *args, "--tool-call-parser", "mistral"])
        assert got.tool_call_parser == "mistral"
        assert parser.parse_args([command, *args]).tool_call_parser is None  # from the template
    assert "--tool-call-parser" not in {
        s for a in _subcommands()["generate"]._actions for s in a.option_strings
    }
    assert run_cli("serve", "--tool-call-parser", "qwen").returncode == 2


def test_help_needs_no_jax():
    code = (
        "import sys; from jaxgen.cli.main import build_parser; build_parser(); "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_logprobs_and_labelled_completions():
    out = run_cli(
        "generate",
        "Name a colour.",
        "--max-tokens",
        "3",
        "--logprobs",
        "2",
        "--n",
        "2",
        "--temperature",
        "0.8",
        "--seed",
        "1",
    )
    assert out.returncode == 0, out.stderr
    assert "--- completion 1 of 2 ---" in out.stdout and "--- completion 2 of 2 ---" in out.stdout
    assert out.stdout.count("top: ") == 6 and out.stdout.count("cumulative logprob") == 2
    js = run_cli("generate", "Name a colour.", "--max-tokens", "3", "--logprobs", "2", "--json")
    assert js.returncode == 0, js.stderr
    (completion,) = json.loads(js.stdout)["outputs"]
    assert len(completion["logprobs"]) == 3
    for row, token in zip(completion["logprobs"], completion["token_ids"], strict=True):
        assert row["token_id"] == token and row["logprob"] <= 0 and len(row["top"]) == 2
        assert row["top"][0]["logprob"] >= row["top"][1]["logprob"]


def test_serve_compiles_the_serving_buckets_before_it_answers(monkeypatch):
    """`jaxgen serve` declares decode buckets up to --max-num-seqs (a first burst of clients
    decodes together), unless --compile-buckets is given."""
    import jaxgen.entrypoints.server as server
    from jaxgen.cli import main as cli
    from jaxgen.cli import serve as command

    seen = []
    monkeypatch.setattr(command, "make_llm", lambda args, **kw: seen.append(args.compile_buckets))
    monkeypatch.setattr(server, "serve", lambda llm, **kw: None)
    assert cli.main(["serve", "--max-num-seqs", "8"]) == 0
    assert cli.main(["serve", "--compile-buckets", "prefill:32"]) == 0
    buckets = seen[0].split(",")
    assert {"decode:1@256", "decode:2@256", "decode:4@256", "decode:8@256"} <= set(buckets)
    assert "prefill:128" in buckets and seen[1] == "prefill:32"
