"""Structured outputs, measured on the default model: how many outputs parse and validate on a set
of JSON Schemas (greedy and sampled), and what the constraint costs in output tokens/s.

Validity: each of the SCHEMAS (nested objects, arrays, enums, patterns, formats, numeric bounds,
required and optional fields) is asked for by a chat prompt describing the task and showing the
schema; the output must be JSON (`json.loads`) that validates against the schema (`jsonschema`,
formats checked). Every output counts: one cut off by max_tokens is invalid.

Overhead: a batch of B chat prompts under one JSON Schema, timed; then the same prompts
unconstrained, each forced to generate exactly as many tokens as its constrained output had
(min_tokens = max_tokens = that count), so both runs have the same rows, lengths and batch
shrinkage, and differ only in the constraint; a batch of 1 runs OVERHEAD_PROMPTS calls in a
row. Ratio = constrained / unconstrained output tokens/s: the two runs alternate REPEATS times
after one untimed run each (which compiles), and their medians are compared. Also reported:
the host's mask time per constrained step (llguidance's bitmask for the batch), computed while
the device runs the step's forward pass.

    python -m benchmarks structured [--quick] [--json] [--out F] [--write-docs]
"""

from __future__ import annotations

import json
import statistics
import time

from jaxgen.bench import harness

MAX_TOKENS = 384
BATCHES = (1, 32)
OVERHEAD_PROMPTS = 8  # a batch of 1 runs this many calls in a row
REPEATS = 3  # timed constrained / unconstrained runs, alternating
SEED = 0
QUICK = dict(num_schemas=3, batches=(1, 2), max_tokens=48, overhead_prompts=2, repeats=1)
OVERHEAD_MUST = 0.85  # issue 27: constrained tok/s >= 0.85x unconstrained at batch 1 and 32


def _obj(props: dict, required=None) -> dict:
    """An object schema as OpenAI's strict mode writes them: no properties beyond `props`."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


STR, INT, NUM, BOOL = (
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
)

# (task given to the model, JSON Schema).
SCHEMAS = [
    ("a fictional person", _obj({"name": STR, "age": {"type": "integer", "minimum": 0}})),
    (
        "a book",
        _obj({"title": STR, "author": STR, "year": {**INT, "minimum": 1400, "maximum": 2030}}),
    ),
    (
        "the weather in a city",
        _obj({"city": STR, "celsius": NUM, "sky": {"enum": ["sunny", "cloudy", "rainy"]}}),
    ),
    (
        "a shopping list",
        _obj({"items": {"type": "array", "items": STR, "minItems": 1, "maxItems": 5}}),
    ),
    (
        "a user account",
        _obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"}, "active": BOOL}),
    ),
    (
        "a point in 3D space",
        _obj({"x": NUM, "y": NUM, "z": NUM}),
    ),
    (
        "a movie review",
        _obj({"movie": STR, "stars": {**INT, "minimum": 1, "maximum": 5}, "summary": STR}),
    ),
    (
        "a company with its address",
        _obj(
            {
                "name": STR,
                "address": _obj(
                    {"street": STR, "city": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                ),
            }
        ),
    ),
    (
        "a to-do item",
        _obj({"task": STR, "done": BOOL, "priority": {"enum": ["low", "medium", "high"]}}),
    ),
    (
        "a recipe",
        _obj(
            {
                "dish": STR,
                "ingredients": {
                    "type": "array",
                    "items": _obj({"name": STR, "grams": INT}),
                    "minItems": 1,
                    "maxItems": 4,
                },
            }
        ),
    ),
    ("a country", _obj({"country": STR, "capital": STR, "population_millions": NUM})),
    (
        "an email message",
        _obj({"to": {"type": "string", "format": "email"}, "subject": STR, "urgent": BOOL}),
    ),
    ("a color", _obj({"name": STR, "hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"}})),
    (
        "a meeting",
        _obj(
            {
                "title": STR,
                "date": {"type": "string", "format": "date"},
                "attendees": {"type": "array", "items": STR, "maxItems": 4},
            }
        ),
    ),
    (
        "an animal",
        _obj({"species": STR, "legs": {**INT, "minimum": 0, "maximum": 8}, "can_fly": BOOL}),
    ),
    (
        "a product in a store",
        _obj(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {**NUM, "minimum": 0},
                "in_stock": BOOL,
            }
        ),
    ),
    (
        "a sports match",
        _obj({"home": STR, "away": STR, "score": _obj({"home": INT, "away": INT})}),
    ),
    (
        "a yes/no answer to: is the sky blue?",
        _obj(
            {"answer": {"enum": ["yes", "no"]}, "confidence": {**NUM, "minimum": 0, "maximum": 1}}
        ),
    ),
    (
        "a playlist",
        _obj(
            {
                "name": STR,
                "songs": {
                    "type": "array",
                    "items": _obj({"title": STR, "seconds": INT}),
                    "maxItems": 3,
                },
            }
        ),
    ),
    (
        "a student with optional grades",
        _obj(
            {
                "name": STR,
                "grades": {
                    "type": "array",
                    "items": {**INT, "minimum": 0, "maximum": 100},
                    "maxItems": 4,
                },
                "nickname": STR,
            },
            required=["name"],
        ),
    ),
    (
        "a server configuration",
        _obj({"host": STR, "port": {**INT, "minimum": 1, "maximum": 65535}, "tls": BOOL}),
    ),
    (
        "a family tree of one parent and children",
        _obj(
            {
                "parent": STR,
                "children": {
                    "type": "array",
                    "items": _obj({"name": STR, "age": INT}),
                    "maxItems": 3,
                },
            }
        ),
    ),
    (
        "a classification of the text 'I love it'",
        _obj({"label": {"enum": ["positive", "negative", "neutral"]}}),
    ),
    (
        "a flight",
        _obj(
            {
                "flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
                "from": STR,
                "to": STR,
                "seats": {"anyOf": [INT, {"type": "null"}]},
            }
        ),
    ),
]


def chat_prompt(llm, task: str, schema: dict) -> str:
    """The task with its schema in the prompt, as users of structured outputs write them
    (OpenAI's strict mode shows the model its schema too): the mask alone does not tell the
    model what the fields are for."""
    message = (
        f"Write {task} as a JSON object that follows this JSON Schema:\n{json.dumps(schema)}\n"
        "Answer with the JSON only."
    )
    return llm.processor.apply_chat_template([{"role": "user", "content": message}])["prompt"]


def validity(llm, schemas, max_tokens: int, *, greedy: bool) -> dict:
    """Generates one output per schema (one batch) and checks each: parses, validates."""
    import jsonschema

    from jaxgen import SamplingParams, StructuredOutputs

    prompts = [chat_prompt(llm, task, schema) for task, schema in schemas]
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else 0.8,
            top_p=1.0 if greedy else 0.95,
            seed=SEED + i,
            structured=StructuredOutputs(json=schema),
        )
        for i, (_, schema) in enumerate(schemas)
    ]
    outs = llm.generate(prompts, params)
    failures, examples = [], []
    for (task, schema), o in zip(schemas, outs, strict=True):
        c = o.outputs[0]
        try:
            jsonschema.validate(
                json.loads(c.text), schema, format_checker=jsonschema.FormatChecker()
            )
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append(
                {
                    "task": task,
                    "finish": c.finish_reason,
                    "error": str(e)[:160],
                    "text": c.text[:160],
                }
            )
        if len(examples) < 3:
            examples.append({"task": task, "text": c.text})
    n = len(schemas)
    finished = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    finished_invalid = sum(f["finish"] == "stop" for f in failures)
    return {
        "mode": "greedy" if greedy else "sampled (T=0.8, top-p 0.95)",
        "outputs": n,
        "valid": n - len(failures),
        "valid_pct": 100.0 * (n - len(failures)) / n,
        "finished": finished,
        "finished_valid_pct": 100.0 * (finished - finished_invalid) / max(finished, 1),
        "mean_tokens": sum(len(o.outputs[0].token_ids) for o in outs) / n,
        "failures": failures,
        "examples": examples,
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def _run(llm, calls) -> tuple[float, int, list]:
    """(seconds, engine steps, outputs) of `calls` ([(prompts, params)]) run one after the
    other."""
    steps, t0 = llm.engine.num_steps, time.perf_counter()
    outs = [llm.generate(prompts, params) for prompts, params in calls]
    return time.perf_counter() - t0, llm.engine.num_steps - steps, outs


def overhead(llm, batch: int, schemas, max_tokens: int, num_prompts: int, repeats: int) -> dict:
    """Constrained vs unconstrained output tokens/s at one batch size (see the module doc):
    max(batch, num_prompts) prompts in calls of `batch`, one call after the other. The two
    runs alternate `repeats` times after one untimed run each (which compiles their shapes);
    the medians are compared, so that the machine's drift within minutes hits both."""
    from jaxgen import SamplingParams, StructuredOutputs

    total = max(batch, num_prompts)
    picks = [schemas[i % len(schemas)] for i in range(total)]
    prompts = [chat_prompt(llm, task, schema) for task, schema in picks]
    constrained = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=StructuredOutputs(json=s))
        for _, s in picks
    ]
    groups = range(0, total, batch)
    calls_c = [(prompts[i : i + batch], constrained[i : i + batch]) for i in groups]
    _, _, outs = _run(llm, calls_c)
    lens = [len(o.outputs[0].token_ids) for group in outs for o in group]
    free = [
        SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True) for n in lens
    ]
    calls_u = [(prompts[i : i + batch], free[i : i + batch]) for i in groups]
    _run(llm, calls_u)
    fill = llm.engine.runner.bitmasks
    fill.reset()
    runs_c, runs_u = [], []
    for _ in range(repeats):
        runs_c.append(_run(llm, calls_c)[:2])
        runs_u.append(_run(llm, calls_u)[:2])
    mask_ms = 1e3 * fill.seconds / max(fill.calls, 1)
    t_c = statistics.median(t for t, _ in runs_c)
    t_u = statistics.median(t for t, _ in runs_u)
    steps = runs_c[0][1]
    tokens = sum(lens)
    return {
        "batch": batch,
        "calls": len(groups),
        "tokens": tokens,
        "constrained_tok_s": tokens / t_c,
        "unconstrained_tok_s": tokens / t_u,
        "ratio": t_u / t_c,
        "ratios": [u / c for (c, _), (u, _) in zip(runs_c, runs_u, strict=True)],
        "mask_ms_per_step": mask_ms,
        "step_ms": 1e3 * t_c / max(steps, 1),
        "met": t_u / t_c >= OVERHEAD_MUST,
    }


def compare_engines(llm, schemas, outputs) -> list[dict]:
    """llguidance against xgrammar on the same schemas and token sequences (the greedy outputs):
    compile seconds per schema (no cache) and mask microseconds per token, row by row, on this
    host. xgrammar is not a dependency (its wheel needs torch, transformers and triton at run
    time); the rows are measured only where it is importable."""
    import llguidance as llg
    import numpy as np

    from jaxgen.engine.sample.structured import bitmask_width

    rows = []
    vocab, eos = llm.cfg.vocab_size, sorted(llm.eos_ids)
    t0 = time.perf_counter()
    lltok = llg.LLTokenizer(llm.tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t0
    mask = np.zeros(bitmask_width(vocab), np.int32)
    compile_s = mask_s = 0.0
    tokens = 0
    for (_, schema), out in zip(schemas, outputs, strict=True):
        t0 = time.perf_counter()
        matcher = llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_json_schema(schema))
        t1 = time.perf_counter()
        for token in out:
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            matcher.consume_token(token)
        compile_s, mask_s = compile_s + t1 - t0, mask_s + time.perf_counter() - t1
        tokens += len(out)
    rows.append(
        _engine_row("llguidance", llg.__version__, setup, compile_s, mask_s, schemas, tokens)
    )
    try:
        import torch
        import transformers
        import xgrammar as xgr
    except ImportError:
        return rows
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=llm.tokenizer.backend)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    compile_s = mask_s = 0.0
    for (_, schema), out in zip(schemas, outputs, strict=True):
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema))
        t1 = time.perf_counter()
        for token in out:
            matcher.fill_next_token_bitmask(bitmask)
            matcher.accept_token(token)
        compile_s, mask_s = compile_s + t1 - t0, mask_s + time.perf_counter() - t1
    version = getattr(xgr, "__version__", None) or _dist_version("xgrammar")
    rows.append(_engine_row("xgrammar", version, setup, compile_s, mask_s, schemas, tokens))
    del torch
    return rows


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _engine_row(name, version, setup, compile_s, mask_s, schemas, tokens) -> dict:
    return {
        "engine": f"{name} {version}",
        "tokenizer_s": setup,
        "compile_ms_per_schema": 1e3 * compile_s / len(schemas),
        "mask_us_per_token": 1e6 * mask_s / max(tokens, 1),
        "tokens": tokens,
    }


def run(quick: bool = False, model: str | None = None) -> dict:
    from jaxgen import LLM

    q = QUICK if quick else {}
    schemas = SCHEMAS[: q.get("num_schemas", len(SCHEMAS))]
    max_tokens = q.get("max_tokens", MAX_TOKENS)
    batches = q.get("batches", BATCHES)
    num_prompts = q.get("overhead_prompts", OVERHEAD_PROMPTS)
    llm = LLM(model, max_num_seqs=max(max(batches), len(schemas)))
    checks = [validity(llm, schemas, max_tokens, greedy=g) for g in (True, False)]
    outputs = [check.pop("token_ids") for check in checks][0]
    repeats = q.get("repeats", REPEATS)
    rows = [overhead(llm, b, schemas, max_tokens, num_prompts, repeats) for b in batches]
    engines = compare_engines(llm, schemas, outputs)  # last: xgrammar imports torch
    return {
        "machine": harness.machine_info(),
        "model": model or "SmolLM2-135M-Instruct (embedded default, f32)",
        "quick": quick,
        "num_schemas": len(schemas),
        "max_tokens": max_tokens,
        "validity": checks,
        "overhead": rows,
        "repeats": repeats,
        "engines": engines,
        "grammar_cache": {
            "compiled": llm.processor.grammars.misses,
            "hits": llm.processor.grammars.hits,
        },
    }


ENGINE_COLUMNS = [
    ("engine", "engine"),
    ("tokenizer_s", "tokenizer set-up s"),
    ("compile_ms_per_schema", "compile ms / schema"),
    ("mask_us_per_token", "mask µs / token"),
    ("tokens", "tokens replayed"),
]
VALIDITY_COLUMNS = [
    ("mode", "mode"),
    ("outputs", "outputs"),
    ("valid", "valid"),
    ("valid_pct", "valid %"),
    ("finished", "finished (EOS)"),
    ("finished_valid_pct", "valid % of finished"),
    ("mean_tokens", "mean tokens"),
]
OVERHEAD_COLUMNS = [
    ("batch", "batch"),
    ("calls", "calls"),
    ("tokens", "output tokens"),
    ("constrained_tok_s", "JSON Schema tok/s"),
    ("unconstrained_tok_s", "unconstrained tok/s"),
    ("ratio", "ratio"),
    ("mask_ms_per_step", "host mask ms / step"),
    ("step_ms", "ms / step"),
    ("met", f"≥ {OVERHEAD_MUST}×"),
]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    failures = [f for v in result["validity"] for f in v["failures"]]
    lines = "".join(
        f"\n- {f['task']} ({f['finish']}): {f['error']}; `{json.dumps(f['text'])}`"
        for f in failures
    )
    example = result["validity"][0]["examples"][0]
    return (
        f"### Structured outputs: JSON Schema validity and overhead ({m['device']})\n\n"
        f"`python -m benchmarks structured`{' --quick' if result['quick'] else ''}: "
        f"{result['model']}, "
        f"{m['cpu']}, {m['date']}. Grammar engine: llguidance. {result['num_schemas']} JSON "
        "Schemas (nested objects, arrays, enums, patterns, formats, bounds, optional fields, no "
        "extra properties), each asked for by a chat prompt that shows the schema; an output "
        "is valid if `json.loads` parses it and "
        f"`jsonschema` validates it (formats checked); max_tokens {result['max_tokens']}, so "
        "an output cut off counts as invalid.\n\n"
        + harness.markdown_table(result["validity"], VALIDITY_COLUMNS)
        + (f"\n\nInvalid outputs:{lines}" if failures else "")
        + f"\n\nExample ({example['task']}): `{json.dumps(example['text'])}`\n\n"
        "Overhead: the same chat prompts under a JSON Schema each, greedy, then unconstrained "
        "with each row forced to its constrained output's length (same rows, lengths and batch "
        "shrinkage); calls of `batch` prompts one after the other; the two runs alternate "
        f"{result.get('repeats', REPEATS)} times after an untimed run each, medians compared "
        "(ratios of each pair in the JSON). A "
        "constrained step dispatches its forward pass; while the device runs it, the host "
        "lands the step before it (whose tokens advance the grammars) and fills the batch's "
        "token bitmask (llguidance's thread pool); sampling is dispatched last, with the mask. "
        "Host mask ms: the bitmask fill per constrained step.\n\n"
        + harness.markdown_table(result["overhead"], OVERHEAD_COLUMNS)
        + f"\n\nGrammars compiled: {result['grammar_cache']['compiled']}, cache hits: "
        f"{result['grammar_cache']['hits']}.\n\n"
        "Grammar engines on the same schemas and the greedy outputs' tokens, one row at a time "
        "(tokenizer set-up once; compile: a schema's first matcher, no cache; mask: one "
        "token's bitmask over the 49,152-token vocabulary, then its acceptance). xgrammar is "
        "measured only where it is importable: it is not a dependency, its wheel requires "
        "torch, transformers and triton at run time, which jaxgen's runtime does not install."
        "\n\n" + harness.markdown_table(result["engines"], ENGINE_COLUMNS)
    )
