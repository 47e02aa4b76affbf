"""Mixture-of-Experts decode speed, jaxgen vs transformers in the same run (issue 24).

Random-weight Mixtral, Qwen3-MoE and DeepSeek-V3 (MLA + MoE) models of a small size are built
by transformers from a config (f32), saved as safetensors and loaded by jaxgen from that
directory, so both run the same weights. Workload: B prompts of random token ids of one
length, greedy, a fixed number of new tokens; decode tokens/s = B / seconds per decode step,
measured as in `bench decode` (jaxgen: first to last token through `LLM.generate`;
transformers: generate N tokens minus generate 1, over N - 1), median of the repeats.

    python -m benchmarks moe [--quick] [--json] [--out F] [--write-docs]
"""

from __future__ import annotations

import gc
import tempfile

import numpy as np

from jaxgen.bench import harness
from jaxgen.bench.decode import hf_decode, ours_decode

COMMON = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
MODELS = {
    "mixtral": (
        "MixtralConfig",
        dict(COMMON, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            COMMON,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
        ),
    ),
    "deepseek_v3": (  # MLA attention, group-limited sigmoid routing, a shared expert
        "DeepseekV3Config",
        dict(
            COMMON,
            num_key_value_heads=None,  # MLA: one per head (transformers fills it in)
            intermediate_size=1024,
            moe_intermediate_size=256,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=192,
            kv_lora_rank=128,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
            rope_scaling=None,
        ),
    ),
}
BATCHES = (1, 8)
PROMPT_LEN = 32
NEW_TOKENS = 32
REPEATS = 3
QUICK = dict(hidden_size=64, vocab_size=256, num_hidden_layers=2, num_attention_heads=4)


def _hf_model(class_name: str, kwargs: dict, directory: str):
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, class_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(torch.float32)
    model.save_pretrained(directory)
    return model


def run(quick: bool = False) -> dict:
    from jaxgen import LLM
    from jaxgen.model import load_model, load_tokenizer

    batches, new_tokens, repeats = ((1, 2), 8, 2) if quick else (BATCHES, NEW_TOKENS, REPEATS)
    prompt_len = 8 if quick else PROMPT_LEN
    tokenizer = load_tokenizer(None)  # only decodes the outputs; prompts are token ids
    rows = []
    for class_name, kwargs in MODELS.values():
        if quick:
            kwargs = dict(kwargs, **QUICK)
        with tempfile.TemporaryDirectory(prefix="jaxgen-bench-moe-") as directory:
            hf = _hf_model(class_name, kwargs, directory)
            cfg, params = load_model(directory, show_progress=False)
        llm = LLM.from_parts(
            cfg, params, tokenizer, max_num_seqs=max(batches), max_model_len=256, warmup=False
        )
        rng = np.random.default_rng(0)
        for batch in batches:
            prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
            ours = batch / ours_decode(llm, prompts, new_tokens, repeats)
            theirs = batch / hf_decode(hf, prompts, new_tokens, repeats)
            moe = cfg.moe
            rows.append(
                dict(
                    model=f"{cfg.arch}: {cfg.num_layers} layers, D={cfg.hidden_size}, "
                    f"{moe.num_experts} experts, top-{moe.num_experts_per_tok}, "
                    f"F={moe.intermediate_size}",
                    params_m=cfg.num_params / 1e6,
                    batch=batch,
                    ours_tok_s=ours,
                    hf_tok_s=theirs,
                    ratio=ours / theirs,
                )
            )
        del llm, hf, params
        gc.collect()
    return dict(
        machine=harness.machine_info(),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        repeats=repeats,
        quick=quick,
        rows=rows,
    )


COLUMNS = [
    ("model", "model (random weights)"),
    ("params_m", "params (M)"),
    ("batch", "batch"),
    ("ours_tok_s", "jaxgen decode tok/s"),
    ("hf_tok_s", "transformers tok/s"),
    ("ratio", "ratio"),
]


def to_markdown(result: dict) -> str:
    return "\n".join(
        [
            "### Mixture-of-Experts decode (CPU, beside transformers)",
            "",
            f"{result['machine'].get('cpu', '')}: greedy, {result['prompt_len']}-token prompts, "
            f"{result['new_tokens']} new tokens, median of {result['repeats']}; both load the "
            "same safetensors (f32).",
            "",
            harness.markdown_table(result["rows"], COLUMNS),
        ]
    )
