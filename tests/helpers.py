"""Shared test helpers: tiny random Hugging Face models and the transformers reference."""

from __future__ import annotations

import copy
import os

import numpy as np

# Small enough to build and compile in about a second, large enough to exercise GQA.
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

HF_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "deepseek_v2": "DeepseekV2Config",
    "deepseek_v3": "DeepseekV3Config",
}


def tiny_hf_model(
    directory: str, arch: str = "llama", seed: int = 0, max_shard_size=None, **overrides
):
    """Builds a random-weight transformers model, saves it (safetensors) and returns it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    kwargs = dict(TINY, **overrides)
    config = getattr(transformers, HF_CONFIGS[arch])(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.eval().to(torch.float32)
    # Random norms and biases too, so a skipped scale or bias cannot pass unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **save_kwargs)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def default_gguf():
    from jaxgen.model.loading import default_gguf_path

    path = default_gguf_path()
    return os.path.dirname(path), os.path.basename(path)


# Three adapters: every target module; rsLoRA on a few; per-module rank and alpha patterns.
LORA_ADAPTERS = {
    "all-modules": dict(
        r=4,
        lora_alpha=8,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj", "up_proj", "down_proj"],
        rank_pattern={"layers.1.self_attn.q_proj": 2, "down_proj": 6},
        alpha_pattern={"o_proj": 3},
    ),
}


def save_peft_adapter(base, directory, seed=0, **lora_kwargs):
    """A PEFT LoRA adapter on a copy of `base` with random A and B (PEFT starts B at zero, which
    would make every adapter the identity), saved; returns the copy with the adapter merged."""
    import peft
    import torch

    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora_kwargs))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model.merge_and_unload().eval()


def docs_pages() -> dict[str, str]:
    """Every Markdown page under docs/ by path, to check that a benchmark run without
    --write-docs left each one as it was (sections live on their topic's page)."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    pages = {str(p): p.read_text() for p in sorted(docs.rglob("*.md"))}
    assert pages, f"no pages under {docs}"
    return pages


def run_quick_bench(name: str, tmp_path, *flags: str) -> tuple[dict, str]:
    """`jaxgen bench NAME --quick [flags]` (or, for a study, `python -m benchmarks NAME ...`)
    in a fresh process: (its JSON result, its stdout), after checking that it succeeded and
    left every docs page alone."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks import cli as studies
    from benchmarks import study_env

    before = docs_pages()
    out_json = Path(tmp_path) / f"{name}.json"
    command = ["benchmarks"] if name in studies.SECTIONS else ["jaxgen.cli", "bench"]
    cmd = [sys.executable, "-m", *command, name, "--quick", "--out", str(out_json), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=study_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert docs_pages() == before
    return json.loads(out_json.read_text()), out.stdout
