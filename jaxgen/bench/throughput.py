"""Offline throughput: continuous batching vs static batching vs transformers, same run.

A fixed-seed workload (default 256 requests, prompts of 32-512 tokens of real text, outputs of
16-256 tokens, greedy, each request's own length) through:
  - jaxgen continuous batching (paged cache, the scheduler);
  - jaxgen static batching (contiguous cache: batches padded to the longest prompt, each batch
    running until its slowest request is done);
  - transformers `generate` in batches of the same size (left padding, max_new_tokens = the
    batch's longest request; only each request's own tokens are counted);
  - llama.cpp when installed (`--compare llamacpp`): its Python binding serves one request at
    a time, so it runs the first `llamacpp_requests` requests in turn (its own tokens/s).
Reported: useful output tokens/s and total seconds of each, and the ratios.
"""

from __future__ import annotations

import time

import numpy as np

from jaxgen.bench import harness
from jaxgen.engine.params import SamplingParams


def workload(
    tokenizer, num_requests: int, seed: int = 0, prompt_range=(32, 512), output_range=(16, 256)
):
    from jaxgen.bench.decode import prompt_ids

    rng = np.random.RandomState(seed)
    lengths = rng.randint(prompt_range[0], prompt_range[1] + 1, num_requests)
    outputs = rng.randint(output_range[0], output_range[1] + 1, num_requests)
    text = prompt_ids(tokenizer, 1, int(lengths.sum()) + 1)[0]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    prompts = [text[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(m), min_tokens=int(m), ignore_eos=True)
        for m in outputs
    ]
    return prompts, params


def run_llm(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(p.max_tokens for p in params), "a request stopped early"
    return seconds


def run_hf(model, prompts, params, batch_size: int) -> float:
    import torch

    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        longest = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in chunk])
        new = max(p.max_tokens for p in params[start : start + batch_size])
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - t0


def run(
    model=None,
    *,
    num_requests=256,
    batch_size=32,
    compare_hf=True,
    compare_llamacpp=False,
    llamacpp_requests=32,
    quick=False,
    mesh=None,
    prompt_range=(32, 512),
    output_range=(16, 256),
) -> dict:
    """`mesh`: both jaxgen engines run on it (the continuous engine with pipelined
    microbatches where it has stages, the static engine with GPipe over its batches).
    `prompt_range` / `output_range`: request lengths are drawn uniformly from these (equal
    bounds: every request the same length, static batching's best case)."""
    from jaxgen import LLM

    if quick:
        num_requests, batch_size = 6, 4
        prompt_range, output_range = (8, 40), (2, 8)
    continuous = LLM(model, max_num_seqs=batch_size, max_model_len=1024, mesh=mesh)
    prompts, params = workload(
        continuous.tokenizer, num_requests, prompt_range=prompt_range, output_range=output_range
    )
    useful = sum(p.max_tokens for p in params)
    # Warm-up with the whole workload: every bucket shape it needs is compiled before timing.
    # The prompts' cached pages are then dropped: the timed run must compute every prompt.
    run_llm(continuous, prompts, params)
    continuous.reset_prefix_cache()
    rows = [
        {
            "system": "jaxgen continuous batching",
            "seconds": run_llm(continuous, prompts, params),
            "stats": {k: v for k, v in continuous.stats().items() if not isinstance(v, dict)},
        }
    ]
    del continuous
    static = LLM(
        model, max_num_seqs=batch_size, max_model_len=1024, kv_cache="contiguous", mesh=mesh
    )
    run_llm(static, prompts, params)
    rows.append({"system": "jaxgen static batching", "seconds": run_llm(static, prompts, params)})
    del static
    if compare_hf:
        from jaxgen.bench.decode import hf_model

        hf = hf_model(model)
        rows.append(
            {
                "system": "transformers generate (batches)",
                "seconds": run_hf(hf, prompts, params, batch_size),
            }
        )
    for row in rows:
        row["output_tok_s"] = useful / row["seconds"]
    if compare_llamacpp:
        from jaxgen.bench import llamacpp

        n = min(llamacpp_requests, num_requests)
        seconds, produced = llamacpp.serve_sequentially(
            llamacpp.load(n_ctx=1024), prompts[:n], params[:n]
        )
        rows.append(
            {
                "system": f"llama.cpp, one request at a time (first {n} requests)",
                "seconds": seconds,
                "output_tok_s": produced / seconds,
            }
        )
    for row in rows:
        row["speedup_vs_this"] = row["output_tok_s"] / rows[0]["output_tok_s"]
    return {
        "machine": harness.machine_info(),
        "mesh": mesh,
        "num_requests": num_requests,
        "batch_size": batch_size,
        "prompt_range": prompt_range,
        "output_range": output_range,
        "output_tokens": useful,
        "rows": rows,
    }


COLUMNS = [("system", "system"), ("seconds", "total s"), ("output_tok_s", "output tok/s")]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    rows = result["rows"]
    base = rows[0]["output_tok_s"]
    table = [dict(r, ratio=base / r["output_tok_s"]) for r in rows]
    mesh = f", mesh {result['mesh']}" if result.get("mesh") else ""
    note = ""
    if result.get("mesh") and m["device"] == "cpu":
        note = (
            " The mesh's devices are XLA host devices sharing this machine's cores, so the "
            "stages do not run in parallel: the ratio compares the two engines on the same "
            "mesh, not the mesh against one device."
        )
    flag = f" --mesh {result['mesh']}" if result.get("mesh") else ""
    lens = (tuple(result["prompt_range"]), tuple(result["output_range"]))
    if lens != ((32, 512), (16, 256)):
        flag += " --prompt-lens {},{} --output-lens {},{}".format(*lens[0], *lens[1])
    return (
        f"### Offline throughput ({m['device']}, float32{mesh})\n\n"
        f"`jaxgen bench throughput{flag}`: {result['num_requests']} requests, prompts "
        f"{result['prompt_range'][0]}-{result['prompt_range'][1]} tokens, outputs "
        f"{result['output_range'][0]}-{result['output_range'][1]} tokens (fixed seed, greedy), "
        f"{result['output_tokens']} output tokens in all; batches / max_num_seqs "
        f"{result['batch_size']}; {m['cpu']}, {m['date']}.{note}\n\n"
        + harness.markdown_table(table, COLUMNS + [("ratio", "continuous is ×")])
    )
