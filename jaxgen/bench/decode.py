"""Decode and prefill speed of jaxgen vs transformers (same weights, same dtype, same run).

Decode tokens/s at several batch sizes (greedy, fixed output length), prefill tokens/s at 512
tokens, and achieved memory bandwidth at each decode point (bytes of weights + KV read per
step / step time) as a fraction of the machine's read bandwidth measured in the same run.
"""

from __future__ import annotations

import os
import time

import numpy as np

from jaxgen.bench import harness
from jaxgen.engine.roofline import param_bytes, step_cost

WIKITEXT = os.path.join(harness.REPO, "..", "shared", "data", "wikitext-2", "valid.txt")


def prompt_ids(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of exactly `length` tokens of real text (wikitext-2 valid; read again
    from its start when a workload needs more tokens than the file holds)."""
    from jaxgen.model.tokenizer import read_text_tokens

    need = batch * length + 1
    ids = read_text_tokens(tokenizer, WIKITEXT, need)
    ids = (ids * -(-need // len(ids)))[:need]
    return [ids[i * length : (i + 1) * length] for i in range(batch)]


def ours_decode(llm, prompts, new_tokens: int, repeats: int) -> float:
    """Seconds per decode step (median over repeats) for the batch, via LLM.generate."""
    from jaxgen import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True
    )
    llm.generate(prompts, params)  # compile
    per_step = []
    for _ in range(repeats):
        outs = llm.generate(prompts, params)
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        per_step.append((last - first) / (new_tokens - 1))
    return float(np.median(per_step))


def ours_prefill(llm, prompts, repeats: int) -> float:
    """Seconds to prefill one prompt and return its first token (TTFT through the engine).
    Each repeat uses a different prompt, so the prefix cache cannot serve it."""
    from jaxgen import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompts[0]], params)
    times = []
    for prompt in prompts[1 : repeats + 1]:
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def hf_model(source=None):
    import torch
    import transformers

    from jaxgen.model.loading import default_gguf_path, resolve_source

    if source is None:
        path = default_gguf_path()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            resolve_source(source), dtype=torch.float32
        )
    return model.eval()


def hf_decode(model, prompts, new_tokens: int, repeats: int) -> float:
    """Seconds per decode step: (generate N tokens - generate 1 token) / (N - 1)."""
    import torch

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    gen(2)
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gen(1)
        t1 = time.perf_counter()
        gen(new_tokens)
        t2 = time.perf_counter()
        per_step.append(((t2 - t1) - (t1 - t0)) / (new_tokens - 1))
    return float(np.median(per_step))


def hf_prefill(model, prompt, repeats: int) -> float:
    import torch

    ids = torch.tensor([prompt])

    def run():
        with torch.no_grad():
            model(ids, use_cache=True)

    return harness.timeit(run, warmup=1, repeats=repeats).median


def run(
    llm,
    *,
    batches=(1, 8, 32),
    prompt_len=32,
    new_tokens=64,
    prefill_len=512,
    compare_hf=True,
    compare_llamacpp=False,
    repeats=3,
    limits=None,
) -> dict:
    """Measures everything; returns a JSON-able dict with rows and the machine limits.
    llama.cpp (`compare_llamacpp`, default model only) runs batch 1 and the prefill."""
    cfg = llm.cfg
    limits = limits or harness.machine_limits()
    weights = param_bytes(llm.params)
    hf = hf_model() if compare_hf else None
    lcpp = None
    if compare_llamacpp:
        from jaxgen.bench import llamacpp

        lcpp = llamacpp.load(n_ctx=max(prefill_len, prompt_len + new_tokens) + 16)
    rows = []
    for batch in batches:
        prompts = prompt_ids(llm.tokenizer, batch, prompt_len)
        step = ours_decode(llm, prompts, new_tokens, repeats)
        mean_context = prompt_len + new_tokens / 2
        cost = step_cost(
            cfg,
            weights,
            new_tokens=batch,
            context_tokens=int(batch * mean_context),
            kv_itemsize=llm.dtype.itemsize,
        )
        row = {
            "what": f"decode batch {batch}",
            "ours_tok_s": batch / step,
            "bandwidth_gbps": cost["bytes"] / step / 1e9,
            "mbu": cost["bytes"] / step / 1e9 / limits["read_gbps"],
            "mfu": cost["flops"] / step / 1e9 / limits["f32_gflops"],
        }
        if hf is not None:
            row["hf_tok_s"] = batch / hf_decode(hf, prompts, new_tokens, repeats)
            row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
        if lcpp is not None and batch == 1:
            row["llamacpp_tok_s"] = 1 / llamacpp.decode_step_s(
                lcpp, prompts[0], new_tokens, repeats
            )
            row["llamacpp_ratio"] = row["ours_tok_s"] / row["llamacpp_tok_s"]
        rows.append(row)
    fresh = prompt_ids(llm.tokenizer, repeats + 1, prefill_len)
    prompt = fresh[0]
    seconds = ours_prefill(llm, fresh, repeats)
    cost = step_cost(
        cfg,
        weights,
        new_tokens=prefill_len,
        context_tokens=prefill_len,
        kv_itemsize=llm.dtype.itemsize,
        attended_pairs=prefill_len * (prefill_len + 1) // 2,
    )
    row = {
        "what": f"prefill {prefill_len} tokens",
        "ours_tok_s": prefill_len / seconds,
        "mfu": cost["flops"] / seconds / 1e9 / limits["f32_gflops"],
    }
    if hf is not None:
        row["hf_tok_s"] = prefill_len / hf_prefill(hf, prompt, repeats)
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
    if lcpp is not None:
        row["llamacpp_tok_s"] = prefill_len / llamacpp.prefill_s(lcpp, prompt, repeats)
        row["llamacpp_ratio"] = row["ours_tok_s"] / row["llamacpp_tok_s"]
    rows.append(row)
    return {
        "machine": harness.machine_info(),
        "limits": limits,
        "settings": {
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "dtype": str(llm.dtype),
            "model": cfg.name or cfg.arch,
            "weight_bytes": weights,
        },
        "rows": rows,
    }


COLUMNS = [
    ("what", "measurement"),
    ("ours_tok_s", "jaxgen tok/s"),
    ("hf_tok_s", "transformers tok/s"),
    ("ratio", "jaxgen / transformers"),
    ("llamacpp_tok_s", "llama.cpp tok/s"),
    ("llamacpp_ratio", "jaxgen / llama.cpp"),
    ("bandwidth_gbps", "achieved GB/s"),
    ("mbu", "MBU"),
    ("mfu", "MFU"),
]


def to_markdown(result: dict) -> str:
    m, lim, s = result["machine"], result["limits"], result["settings"]
    head = (
        f"### Decode and prefill ({s['model']}, {s['dtype']}, {m['backend']})\n\n"
        f"`jaxgen bench decode --compare hf` on {m['cpu']} ({m['cores']} cores), {m['date']}; "
        f"jax {m['jax']}, torch {m.get('torch', '–')}. Prompts of {s['prompt_len']} tokens, "
        f"{s['new_tokens']} greedy tokens each. Measured in the same run: read bandwidth "
        f"{lim['read_gbps']:.1f} GB/s, f32 matmul {lim['f32_gflops']:.0f} GFLOP/s. MBU counts "
        f"weights ({s['weight_bytes'] / 1e6:.0f} MB) + valid KV per step.\n\n"
    )
    columns = [c for c in COLUMNS if any(c[0] in r for r in result["rows"])]
    if any("llamacpp_tok_s" in r for r in result["rows"]):
        head += (
            "llama.cpp (`llama-cpp-python`, one sequence at a time: batch 1 and prefill only) "
            "runs the same GGUF file on its own quantized weights (4-6 bits per weight against "
            "jaxgen's 32: far fewer bytes read per token).\n\n"
        )
    text = head + harness.markdown_table(result["rows"], columns)
    if result.get("plot"):
        text += f"\n\n![decode tokens/s against batch size]({result['plot']})"
    return text


def plot(result: dict) -> str | None:
    """Decode tokens/s against batch size, jaxgen and its peers (docs/img/decode_batch.png)."""
    rows = [r for r in result["rows"] if r["what"].startswith("decode batch")]
    batch = [int(r["what"].split()[-1]) for r in rows]
    series = {"jaxgen": (batch, [r["ours_tok_s"] for r in rows])}
    for key, label in (("hf_tok_s", "transformers"), ("llamacpp_tok_s", "llama.cpp")):
        if any(key in r for r in rows):
            series[label] = (batch, [r.get(key) for r in rows])
    return harness.plot(
        "decode_batch.png",
        series,
        xlabel="batch size",
        ylabel="decode tokens/s",
        title=f"Decode throughput ({result['settings']['model']}, CPU)",
        logx=True,
        logy=True,
    )
