"""DeepSeek-V3 (Multi-head Latent Attention + MoE) served by the continuous-batching engine over a
latent page pool (cache.PagedMLACache): greedy tokens through jaxgen.LLM equal the model's own
contiguous-cache decode and transformers' greedy generate, with and without q_lora_rank, through
chunked prefill over cached context, preemption and prefix caching; the pool's bytes per
token are the latent formula's."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.cache import MLACache, PagedMLACache
from jaxgen.cache.mla import latent_bytes_per_token
from jaxgen.engine.runner.steps import decode, prefill
from jaxgen.model import save_checkpoint
from tests.model.test_mla import _model

PROMPTS = [[5, 9, 17, 33, 2, 64], [100, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
NEW = 10


def _contiguous_greedy(cfg, params, prompt, new):
    """Greedy tokens of the model's own contiguous latent cache (MLACache), one prompt."""
    kv = MLACache.init(cfg, 1, len(prompt) + new)
    logits, kv = prefill(
        params, jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)]), kv, cfg=cfg
    )
    out = []
    for _ in range(new):
        token = int(np.argmax(np.asarray(logits)[0]))
        out.append(token)
        logits, kv = decode(params, jnp.asarray([token], jnp.int32), kv, cfg=cfg)
    return out


def _hf_greedy(hf, prompt, new):
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", ["v3-q-lora-grouped", "v3-no-q-lora-yarn"])
def test_engine_greedy_tokens_match_contiguous_and_transformers(case, tmp_path, default_tokenizer):
    hf, _, cfg, params = _model(case)
    save_checkpoint(str(tmp_path), cfg, params, default_tokenizer)
    want = [_contiguous_greedy(cfg, params, p, NEW) for p in PROMPTS]
    assert want == [_hf_greedy(hf, p, NEW) for p in PROMPTS]
    # Pages of 4 tokens and 8-token chunks: the longest prompt is prefilled in two chunks, the
    # second absorbed over its cached first chunk. 10 pages hold 40 of the 51 tokens the three
    # sequences reach: sequences are preempted and recomputed.
    llm = LLM(
        model=str(tmp_path),
        max_model_len=64,
        max_num_seqs=4,
        page_size=4,
        num_kv_pages=10,
        max_num_batched_tokens=8,
        warmup=False,
    )
    engine = llm.engine
    assert isinstance(engine.kv, PagedMLACache)
    kv = engine.kv
    per_token = kv.nbytes // (kv.num_pages * kv.page_size)
    mla = cfg.mla
    assert per_token == cfg.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    assert per_token == latent_bytes_per_token(cfg, jnp.float32)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    assert got == want
    assert engine.stats()["preemptions"] > 0
    # Again: the prompts' full pages come from the prefix cache (chunks over cached context).
    hits = engine.stats()["prefix_hit_tokens"]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    assert again == want
    assert engine.stats()["prefix_hit_tokens"] > hits


def test_engine_mla_typed_errors(tmp_path, default_tokenizer):
    _, _, cfg, params = _model("v3-q-lora-grouped")
    save_checkpoint(str(tmp_path), cfg, params, default_tokenizer)
    with pytest.raises(ValueError, match="unquantized latent pages"):
        LLM(model=str(tmp_path), max_model_len=64, kv_cache_dtype="int8", warmup=False)


def test_engine_runs_the_pallas_mla_kernel(tmp_path, default_tokenizer):
    """attn_impl="interpret": the packed steps' absorbed attention runs the Pallas paged MLA
    kernel (interpret mode; the model's R = 16 and Hr = 8 are powers of two), n-gram verify rows
    included; greedy tokens equal the contiguous decode's."""
    _, _, cfg, params = _model("v3-no-q-lora-yarn")
    save_checkpoint(str(tmp_path), cfg, params, default_tokenizer)
    prompts = [PROMPTS[0] * 2]
    want = [_contiguous_greedy(cfg, params, p, 5) for p in prompts]
    llm = LLM(
        model=str(tmp_path),
        max_model_len=32,
        max_num_seqs=1,
        page_size=4,
        attn_impl="interpret",
        speculative={"method": "ngram", "num_tokens": 2},
        warmup=False,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    assert llm.engine.stats()["speculative"]["verify_rows"] > 0
