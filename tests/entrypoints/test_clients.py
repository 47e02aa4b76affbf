"""The clients people point at vLLM, unchanged, against `jaxgen serve` (the default model) on
loopback: lm-evaluation-harness's `local-completions` (a loglikelihood task and a
loglikelihood_rolling task over wikitext-2, compared with its `hf` backend on the same GGUF),
instructor in its JSON_SCHEMA, TOOLS and JSON modes, and guidellm's default requests. One
server for the module; nothing comes from a hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jaxgen.bench.serve_load import free_port

pytestmark = pytest.mark.slow
WIKITEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2" / "test.txt"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, the HF tokenizer directory the clients read) of a `jaxgen serve` process."""
    from jaxgen.model import load_tokenizer

    root = tmp_path_factory.mktemp("clients")
    tokenizer_dir = str(root / "tokenizer")
    load_tokenizer(None).save_pretrained(tokenizer_dir)
    port = free_port()
    log = open(root / "serve.log", "w")  # noqa: SIM115 (the process holds it)
    cmd = [sys.executable, "-m", "jaxgen.cli", "serve", "--port", str(port),
           "--max-num-seqs", "8", "--max-model-len", "1024"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):  # model load and the ahead-of-time compiles, then /health
            assert proc.poll() is None, (root / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield base, tokenizer_dir
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


# ------------------------------------------------------------------------------------------------
# lm-evaluation-harness
# ------------------------------------------------------------------------------------------------
QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " miles"], 0),
    ("The opposite of hot is", [" blue", " cold", " seven"], 1),
    ("A week has seven", [" apples", " planets", " days"], 2),
    ("Cats and dogs are", [" animals", " numbers", " colours"], 0),
    ("The sun rises in the", [" west", " east", " sea"], 1),
]


def write_tasks(directory: Path) -> None:
    """A multiple-choice task (loglikelihood) and a wikitext-2 perplexity task
    (loglikelihood_rolling), from local JSON files."""
    questions = directory / "questions.jsonl"
    questions.write_text(
        "".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS)
    )
    text = WIKITEXT.read_text(encoding="utf-8")
    articles = [a.strip() for a in text.split("\n = ") if len(a.strip()) > 400][:3]
    pages = directory / "pages.jsonl"
    pages.write_text("".join(json.dumps({"page": a[:1500]}) + "\n" for a in articles))
    (directory / "jaxgen_mc.yaml").write_text(
        f"""task: jaxgen_mc
dataset_path: json
dataset_kwargs:
  data_files: {{test: {questions}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""
    )
    (directory / "jaxgen_wikitext.yaml").write_text(
        f"""task: jaxgen_wikitext
dataset_path: json
dataset_kwargs:
  data_files: {{test: {pages}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
    )


def test_lm_eval_local_completions_equals_its_hf_backend(served, tmp_path, hf_default_model):
    """Accuracy equal, perplexity within 0.1%, through lm-eval's own request code."""
    import lm_eval
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    base, tokenizer_dir = served
    write_tasks(tmp_path)
    tasks = ["jaxgen_mc", "jaxgen_wikitext"]
    manager = TaskManager(include_path=str(tmp_path))
    args = (f"model=default,base_url={base}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer_dir},tokenized_requests=True,max_length=512,num_concurrent=4,"
            "max_retries=1")  # fmt: skip
    served_run = lm_eval.simple_evaluate(
        model="local-completions", model_args=args, tasks=tasks, task_manager=manager
    )["results"]
    hf = HFLM(
        pretrained=hf_default_model,
        tokenizer=transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
        max_length=512,
        batch_size=1,
        device="cpu",
    )
    reference = lm_eval.simple_evaluate(model=hf, tasks=tasks, task_manager=manager)["results"]
    print("lm-eval local-completions:", served_run, "hf:", reference)
    assert served_run["jaxgen_mc"]["acc,none"] == reference["jaxgen_mc"]["acc,none"]
    assert reference["jaxgen_mc"]["acc,none"] >= 0.5  # the task tells models apart
    for metric in ("word_perplexity,none", "byte_perplexity,none"):
        ours, theirs = served_run["jaxgen_wikitext"][metric], reference["jaxgen_wikitext"][metric]
        assert abs(ours - theirs) <= 1e-3 * theirs, (metric, ours, theirs)


# ------------------------------------------------------------------------------------------------
# instructor
# ------------------------------------------------------------------------------------------------
def _models():
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str
        age: int

    class Sentiment(BaseModel):
        label: Literal["positive", "negative", "neutral"]
        confidence: float

    class Todo(BaseModel):
        task: str
        done: bool
        priority: int = Field(ge=1, le=5)

    return [
        (Person, ["Alice is 30 years old.", "Dave turned 60 last week."]),
        (Sentiment, ["I love this product!", "This is terrible."]),
        (Todo, ["Buy milk, not done, priority 2.", "Fix the bike, done, priority 3."]),
    ]


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS", "JSON"])
def test_instructor_modes(served, mode):
    """No failure is the server's: no 4xx, no key outside the schema, no malformed or unparsed
    tool call. The only failures allowed are the 135M model running to max_tokens inside a value
    the schema allows (JSON_SCHEMA, TOOLS), or, in JSON mode (where only "a JSON object" is
    enforced, the schema being in the prompt), an object that does not fit the schema."""
    import instructor
    import openai

    raw = openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    valid, ran_out = 0, 0
    for model, prompts in _models():
        for prompt in prompts:
            try:
                _, completion = client.chat.completions.create_with_completion(
                    model="default", response_model=model, max_retries=0, temperature=0,
                    max_tokens=96, messages=[{"role": "user", "content": f"Extract: {prompt}"}],
                )  # fmt: skip
                valid += 1
            except Exception as e:  # instructor's retry error (its module moves between releases)
                assert "Error code: 4" not in str(e), e
                completion = getattr(e, "last_completion", None)
                assert completion is not None, e
                choice = completion.choices[0]
                if choice.finish_reason == "length":
                    ran_out += 1
                    continue
                assert mode == "JSON", (mode, prompt, choice)
                assert isinstance(json.loads(choice.message.content), dict)
                continue
            choice = completion.choices[0]
            text = (
                choice.message.tool_calls[0].function.arguments
                if mode == "TOOLS"
                else choice.message.content
            )
            if mode != "JSON":
                assert set(json.loads(text)) <= set(model.model_json_schema()["properties"])
    print(f"instructor {mode}: {valid} valid of 6, {ran_out} ran to max_tokens")
    if mode != "JSON":
        assert valid + ran_out == 6


# ------------------------------------------------------------------------------------------------
# guidellm
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "route,profile",
    [
        ("/v1/chat/completions", "kind=synchronous"),
        ("/v1/completions", "kind=concurrent,streams=2"),
    ],
)
def test_guidellm_default_requests(served, tmp_path, route, profile):
    """guidellm's own request bodies (streaming, stream_options with continuous_usage_stats,
    chat content as parts, ignore_eos): a few requests, none errored."""
    base, tokenizer_dir = served
    out = tmp_path / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={base},model=default,request_format={route}",
           "--profile", profile, "--constraint", "kind=max_requests,count=4",
           "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--output", f"kind=json,path={out}", "--disable-console"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["successful"] >= 2, totals


# ------------------------------------------------------------------------------------------------
# openai
# ------------------------------------------------------------------------------------------------
def test_openai_client_routes(served):
    """The official client's chat, completions and responses calls, streamed and whole."""
    import openai

    client = openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content
    text = client.completions.create(model="default", prompt="Hi", max_tokens=4, temperature=0)
    assert text.usage.completion_tokens == 4 or text.choices[0].finish_reason == "stop"
    reply = client.responses.create(model="default", input="Hi", max_output_tokens=8)
    assert reply.output_text and reply.usage.output_tokens <= 8
    with client.responses.stream(model="default", input="Say hello.", max_output_tokens=48,
                                 temperature=0) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert stream.get_final_response().output_text == "".join(deltas)
