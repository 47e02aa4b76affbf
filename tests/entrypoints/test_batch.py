"""Batch jobs over JSONL: equal to LLM.generate, resumable after SIGKILL, bad lines reported,
split across processes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxgen import SamplingParams
from jaxgen.entrypoints.batch import BatchJobError, check_paths, stable_seed


def write_jobs(path, n=50, extra=None):
    with open(path, "w") as f:
        for i in range(n):
            record = {"id": f"q{i}", "prompt": f"Question {i}: what is {i} plus {i}?"}
            if i % 7 == 3:
                record = {"id": f"q{i}", "messages": [{"role": "user", "content": f"Say {i}."}]}
            f.write(json.dumps(record) + "\n")
        for line in extra or []:
            f.write(line + "\n")


def read_out(path):
    with open(path) as f:
        return {r["custom_id"]: r for r in map(json.loads, f)}


def test_job_equals_generate_greedy_and_seeded(llm, tmp_path):
    jobs = tmp_path / "in.jsonl"
    write_jobs(jobs)
    for params in (
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=6),
    ):
        out = tmp_path / f"out-{params.temperature}.jsonl"
        summary = llm.generate_file(str(jobs), str(out), params, seed=11, progress=False)
        assert summary["done"] == 50 and summary["bad_lines"] == 0
        got = read_out(out)
        assert len(got) == 50
        for i in (0, 3, 17, 49):
            with open(jobs) as f:
                record = json.loads(f.readlines()[i])
            # A flat "prompt" goes through the chat template, as `jaxgen generate` does.
            messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
            prompt = llm.apply_chat_template(messages)
            want_params = SamplingParams(**{**params.__dict__, "seed": stable_seed(11, f"q{i}")})
            want = llm.generate([prompt], want_params)[0].outputs[0]
            choice = got[f"q{i}"]["response"]["body"]["choices"][0]
            assert choice["token_ids"] == want.token_ids and choice["text"] == want.text


def test_flat_prompts_get_answers_and_the_summary_says_how(llm, tmp_path):
    """A chat model answering a raw prompt often ends its turn at once: flat prompts go through
    the chat template by default, --raw sends them as they are, and the summary counts empty
    outputs and finish reasons either way."""
    jobs = tmp_path / "in.jsonl"
    with open(jobs, "w") as f:
        for i in range(6):
            f.write(json.dumps({"id": f"p{i}", "prompt": f"Name a colour number {i}."}) + "\n")
        f.write(json.dumps({"id": "ids", "prompt": [1, 2, 3]}) + "\n")  # token ids: untouched
    params = SamplingParams(temperature=0, max_tokens=8)
    out = tmp_path / "templated.jsonl"
    summary = llm.generate_file(str(jobs), str(out), params, progress=False)
    assert summary["chat_templated_prompts"] == 6 and summary["empty_outputs"] == 0
    assert sum(summary["finish_reasons"].values()) == 7
    got = read_out(out)
    want = llm.chat([{"role": "user", "content": "Name a colour number 0."}], params)
    want = want[0].outputs[0]
    assert got["p0"]["response"]["body"]["choices"][0]["text"] == want.text
    raw = tmp_path / "raw.jsonl"
    summary = llm.generate_file(str(jobs), str(raw), params, progress=False, raw=True)
    assert summary["chat_templated_prompts"] == 0
    assert summary["empty_outputs"] == sum(
        not r["response"]["body"]["choices"][0]["text"] for r in read_out(raw).values()
    )


def test_openai_batch_format_matches_the_server_shape(llm, tmp_path):
    jobs = tmp_path / "in.jsonl"
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    lines = [
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "default",
                **chat,
                "max_tokens": 12,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
        },
        {
            "custom_id": "t",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "default",
                "prompt": "The sky is",
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": 1,
            },
        },
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {
            "custom_id": "bad-field",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "colour": 1},
        },
        {
            "custom_id": "stream",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "stream": True},
        },
    ]
    jobs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = llm.generate_file(str(jobs), str(tmp_path / "out.jsonl"), None, progress=False)
    assert summary["done"] == 2 and summary["bad_lines"] == 3
    with open(summary["errors_file"]) as f:
        errors = [json.loads(x)["error"] for x in f]
    assert "'url' must be one of" in errors[0] and "colour" in errors[1] and "stream" in errors[2]
    got = read_out(tmp_path / "out.jsonl")
    c = got["c"]["response"]
    assert c["status_code"] == 200 and c["body"]["object"] == "chat.completion"
    want = llm.chat(chat["messages"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    message = c["body"]["choices"][0]["message"]
    assert message == {"role": "assistant", "content": want.text}
    assert c["body"]["usage"]["completion_tokens"] == len(want.token_ids)
    content = c["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == len(want.token_ids) and all(len(x["top_logprobs"]) == 2 for x in content)
    t = got["t"]["response"]["body"]
    want = llm.generate(["The sky is"], SamplingParams(temperature=0, max_tokens=5))[0]
    assert t["object"] == "text_completion" and t["choices"][0]["text"] == want.outputs[0].text
    assert len(t["choices"][0]["logprobs"]["text_offset"]) == len(want.outputs[0].token_ids)


def test_bad_lines_are_reported_and_skipped(llm, tmp_path):
    jobs = tmp_path / "in.jsonl"
    write_jobs(
        jobs,
        n=3,
        extra=[
            "{not json",
            json.dumps({"id": "x"}),
            json.dumps({"id": "t", "prompt": "hi", "temperature": -1}),
            json.dumps({"id": "u", "prompt": "hi", "colour": "red"}),
        ],
    )
    out = tmp_path / "out.jsonl"
    summary = llm.generate_file(
        str(jobs), str(out), SamplingParams(temperature=0, max_tokens=3), progress=False
    )
    assert summary["done"] == 3 and summary["bad_lines"] == 4
    with open(summary["errors_file"]) as f:
        errors = [json.loads(x) for x in f]
    assert [e["line"] for e in errors] == [4, 5, 6, 7]
    assert "invalid JSON" in errors[0]["error"] and "temperature" in errors[2]["error"]
    assert set(read_out(out)) == {"q0", "q1", "q2"}


def test_unreadable_input_or_unwritable_output_fail_first(tmp_path):
    with pytest.raises(BatchJobError, match="not readable"):
        check_paths(str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl"))
    (tmp_path / "in.jsonl").write_text("{}\n")
    with pytest.raises(BatchJobError, match="not writable"):
        check_paths(str(tmp_path / "in.jsonl"), str(tmp_path / "no-such-dir" / "out.jsonl"))
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxgen.cli",
            "batch",
            str(tmp_path / "missing.jsonl"),
            str(tmp_path / "o.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "not readable" in result.stderr
    assert time.perf_counter() - start < 60  # failed before loading a model


def test_ray_without_ray_is_a_typed_error_naming_the_extra(monkeypatch, tmp_path):
    from jaxgen.entrypoints.ray_batch import RayNotInstalled, run_ray_batch

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    (tmp_path / "in.jsonl").write_text("{}\n")
    with pytest.raises(RayNotInstalled, match=r"pip install 'jaxgen\[ray\]'"):
        run_ray_batch(None, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))


def cli_batch(jobs, out, *extra):
    return [
        sys.executable,
        "-m",
        "jaxgen.cli",
        "batch",
        str(jobs),
        str(out),
        "--max-tokens",
        "12",
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--max-num-seqs",
        "4",
        *extra,
    ]


@pytest.mark.slow
def test_killed_job_resumes_to_the_same_result(tmp_path):
    jobs = tmp_path / "in.jsonl"
    write_jobs(jobs, n=40)
    full = tmp_path / "full.jsonl"
    subprocess.run(cli_batch(jobs, full), check=True, capture_output=True, timeout=900)
    out = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        cli_batch(jobs, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 600
    while time.time() < deadline:
        if out.exists() and out.read_text().count("\n") >= 8:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = out.read_text().count("\n")
    assert 8 <= partial < 40
    subprocess.run(cli_batch(jobs, out), check=True, capture_output=True, timeout=900)
    with open(out) as f:
        records = [json.loads(line) for line in f]
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(f"q{i}" for i in range(40))  # every id exactly once
    assert len({r["id"] for r in records}) == 40  # output ids unique across the two runs
    a, b = read_out(full), read_out(out)
    for k in a:
        assert a[k]["response"]["body"]["choices"] == b[k]["response"]["body"]["choices"]


@pytest.mark.slow
def test_two_processes_split_the_job(tmp_path):
    jobs = tmp_path / "in.jsonl"
    write_jobs(jobs, n=12)
    single = tmp_path / "single.jsonl"
    subprocess.run(cli_batch(jobs, single), check=True, capture_output=True, timeout=900)
    out = tmp_path / "split.jsonl"
    procs = [
        subprocess.Popen(
            cli_batch(jobs, out, "--num-processes", "2", "--process-id", str(r)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in (0, 1)
    ]
    for p in procs:
        assert p.wait(timeout=900) == 0, p.stderr.read()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxgen.cli",
            "batch",
            str(jobs),
            str(out),
            "--merge",
            "--world",
            "2",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    a, b = read_out(single), read_out(out)
    assert set(a) == set(b) and len(b) == 12
    for k in a:
        assert a[k]["response"]["body"]["choices"] == b[k]["response"]["body"]["choices"]


def test_two_callers_share_one_engine_and_get_their_own_rows(llm):
    """The Ray replica's overlap: two threads admit their own blocks into one engine through
    `EngineDriver`; each gets exactly its own rows, equal to `LLM.generate` of its prompts
    (greedy), and the engine ran both blocks' requests in the same steps."""
    import threading

    from jaxgen.entrypoints.batch import EngineDriver

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    driver = EngineDriver(llm)
    blocks = {
        name: [
            (n, json.dumps({"id": f"{name}{n}", "prompt": f"Count {n} {name}.", "max_tokens": m}))
            for n, m in zip(range(1, 5), (2, 6, 3, 6), strict=True)
        ]
        for name in ("a", "b")
    }
    got, batch_sizes = {}, []
    step = llm.engine.step

    def counting_step():
        batch_sizes.append(len(llm.engine.scheduler.running))
        return step()

    def caller(name):
        admitted = driver.admit(blocks[name], params, 0, False, None)
        got[name] = [rec for rec, _ in driver.finished_records(admitted.pending, "default")]

    llm.engine.step = counting_step
    try:
        threads = [threading.Thread(target=caller, args=(n,)) for n in blocks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        del llm.engine.step
    assert not llm.engine.has_work and not driver.watched and not driver.finished_ids
    for name, lines in blocks.items():
        assert sorted(r["custom_id"] for r in got[name]) == [f"{name}{n}" for n in range(1, 5)]
        for record in got[name]:
            n = int(record["custom_id"][1:])
            prompt = llm.apply_chat_template([{"role": "user", "content": f"Count {n} {name}."}])
            max_tokens = json.loads(lines[n - 1][1])["max_tokens"]
            want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))
            choice = record["response"]["body"]["choices"][0]
            assert choice["token_ids"] == want[0].outputs[0].token_ids
    assert max(batch_sizes) > 4  # requests of both blocks ran in one step
