"""Multi-LoRA through the paged engine and the LLM API, on the tiny model with PEFT adapters:
mixed batches against each request alone and against the adapter merged into the weights,
prefix caching kept apart per adapter, slot eviction, no recompilation, typed errors."""

import numpy as np
import pytest

from jaxgen import LLM, LoRARequest, SamplingParams, StructuredOutputs
from jaxgen.engine.runner import packed
from jaxgen.errors import InvalidPrompt, LoRAError, LoRANotLoaded
from jaxgen.model import load_adapter
from jaxgen.model.lora import TARGET_MODULES
from tests.helpers import LORA_ADAPTERS

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NAMES = list(LORA_ADAPTERS)
PROMPTS = [list(range(5 + i, 12 + 2 * i)) for i in range(6)]  # 7 to 12 tokens
ROWS = [NAMES[0], None, NAMES[1], NAMES[2], NAMES[0], None]  # each prompt's adapter


def make_llm(tiny, params=None, **kwargs):
    cfg, base, tokenizer = tiny
    options = dict(max_model_len=128, max_num_seqs=8, num_kv_pages=64, warmup=False) | kwargs
    return LLM.from_parts(cfg, base if params is None else params, tokenizer, **options)


def lora_llm(tiny, adapters, **kwargs):
    llm = make_llm(tiny, enable_lora=True, max_lora_rank=8, **kwargs)
    for name, path in adapters.items():
        llm.load_lora(name, path)
    return llm


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def merged(cfg, params, path):
    """params with the adapter at `path` merged into its linears: W + A B."""
    parents = {"self_attn": "attn", "mlp": "mlp"}
    layers = {k: dict(v) for k, v in params["layers"].items()}
    for module, (a, b) in load_adapter(path, cfg).modules.items():
        parent = layers[parents[TARGET_MODULES[module]]]
        kernel = np.asarray(parent[module]["kernel"])
        parent[module] = {"kernel": kernel + np.einsum("LIR,LRO->LIO", a, b)}
    return {**params, "layers": layers}


@pytest.fixture(scope="module")
def engine(tiny, tiny_adapters):
    return lora_llm(tiny, tiny_adapters)


@pytest.fixture(scope="module")
def mixed(engine):
    return token_ids(engine.generate(PROMPTS, GREEDY, lora_request=ROWS))


def test_mixed_batch_equals_each_request_alone(engine, mixed):
    for prompt, lora, want in zip(PROMPTS, ROWS, mixed, strict=True):
        assert token_ids(engine.generate([prompt], GREEDY, lora_request=lora)) == [want]
    # Every adapter changes the output (else the checks above prove nothing).
    same_prompt = token_ids(engine.generate([PROMPTS[0]] * 4, GREEDY, lora_request=[None, *NAMES]))
    assert len({tuple(t) for t in same_prompt}) == 4


def test_mixed_batch_equals_the_merged_model(tiny, tiny_adapters, engine, mixed):
    """Each row's tokens are those of the base model with its adapter merged into the weights
    (a plain engine without LoRA): the adapter math and every token's slot are right."""
    cfg, params, _ = tiny
    for name in [None, *NAMES]:
        weights = params if name is None else merged(cfg, params, tiny_adapters[name])
        want = token_ids(make_llm(tiny, weights).generate(PROMPTS, GREEDY))
        for row, lora in enumerate(ROWS):
            if lora == name:
                assert mixed[row] == want[row], (row, name)


def test_samples_and_preemption_keep_each_rows_adapter(tiny, tiny_adapters, engine, mixed):
    """n > 1 siblings (forked pages) run their request's adapter; so do sequences preempted
    for pages and recomputed (a pool of 5 pages for 6 sequences of 2 pages each)."""
    n2 = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    out = engine.generate(PROMPTS[:1], n2, lora_request=ROWS[:1])[0]
    assert [c.token_ids for c in out.outputs] == [mixed[0]] * 2
    tight = lora_llm(tiny, tiny_adapters, num_kv_pages=5)
    assert token_ids(tight.generate(PROMPTS, GREEDY, lora_request=ROWS)) == mixed
    assert tight.stats()["preemptions"] > 0


def test_prefix_cache_keeps_adapters_apart(engine):
    """The same 40-token prompt under two adapters: each gets its own output; cached pages are
    reused within an adapter only (the adapter changes every K/V after the first layer)."""
    prompt = list(range(100, 140))
    engine.reset_prefix_cache()

    def run(lora):
        out = engine.generate([prompt], GREEDY, lora_request=lora)[0]
        return out.outputs[0].token_ids, out.metrics.num_cached_prompt_tokens

    first_a, hits = run(NAMES[0])
    assert hits == 0
    b, hits = run(NAMES[1])
    assert hits == 0  # A's pages hold A's K/V
    again_a, hits = run(NAMES[0])
    assert (again_a, hits) == (first_a, 32)
    base, hits = run(None)
    assert hits == 0
    engine.reset_prefix_cache()
    assert run(NAMES[1]) == (b, 0)  # computed afresh: the same tokens
    assert len({tuple(first_a), tuple(b), tuple(base)}) == 3


def test_slot_eviction_without_recompiling(tiny, tiny_adapters, mixed):
    """max_loras=2 with three adapters: a batch mixing all three runs two adapters at a time
    (the third waits for a slot, as in vLLM), later calls evict the least recently used slot
    not in use, and loading or evicting an adapter compiles nothing."""
    small = lora_llm(tiny, tiny_adapters, max_loras=2)
    a, b, c = NAMES
    slots = small.engine.adapters

    def held():
        return [None if h is None else h.name for h in slots.held]

    assert token_ids(small.generate(PROMPTS, GREEDY, lora_request=ROWS)) == mixed
    # A and B took the free slots; C waited, then took B's (the least recently used).
    assert (held(), slots.loads, slots.evictions) == ([a, c], 3, 1)
    calls = [[0, 1], [2], [0], [1, 2], [0, 4], [2, 3]]  # prompts by index
    for call in calls:  # the steps of the calls below, compiled before counting
        small.generate([PROMPTS[i] for i in call], GREEDY)
    compiled, traced = small.num_compilations, packed.paged_step._cache_size()

    for call in calls[:-1]:
        got = small.generate(
            [PROMPTS[i] for i in call], GREEDY, lora_request=[ROWS[i] for i in call]
        )
        assert token_ids(got) == [mixed[i] for i in call]
    assert (held(), slots.evictions) == ([a, b], 2)  # B replaced C, the least recently used
    small.unload_lora(b)
    small.load_lora(b, tiny_adapters[b])  # a new adapter under the old name: a slot of its own
    got = small.generate([PROMPTS[2], PROMPTS[3]], GREEDY, lora_request=[b, c])
    assert token_ids(got) == [mixed[2], mixed[3]]
    assert (held(), slots.evictions) == ([c, b], 4)
    assert (small.num_compilations, packed.paged_step._cache_size()) == (compiled, traced)


def test_structured_outputs_with_adapters(tiny, tiny_adapters, engine):
    """A constrained step (forward dispatched first, sampled after the host's masks) runs each
    row's adapter too: the same tokens as the merged model under the same constraint."""
    cfg, params, _ = tiny
    constrained = SamplingParams(
        temperature=0.0, max_tokens=8, structured=StructuredOutputs(regex=r"[a-z ]{4,20}")
    )
    got = token_ids(engine.generate(PROMPTS[:2], constrained, lora_request=[NAMES[0], None]))
    want = make_llm(tiny, merged(cfg, params, tiny_adapters[NAMES[0]])).generate(
        PROMPTS[:1], constrained
    )
    assert got[0] == token_ids(want)[0]
    assert got[1] == token_ids(make_llm(tiny).generate(PROMPTS[1:2], constrained))[0]
    assert got[0] != got[1]


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2"])
def test_meshes_give_the_single_device_tokens(tiny, tiny_adapters, mixed, mesh):
    """Tensor parallel: the adapter stack is replicated beside the sharded weights; data
    parallel: each replica engine has a stack of its own."""
    llm = lora_llm(tiny, tiny_adapters, mesh=mesh)
    assert token_ids(llm.generate(PROMPTS, GREEDY, lora_request=ROWS)) == mixed


def test_unknown_adapters_are_typed_errors(tiny, tiny_adapters, engine, mixed, tmp_path):
    with pytest.raises(LoRANotLoaded, match=r"no LoRA adapter named 'nope' is loaded"):
        engine.generate(PROMPTS[:1], GREEDY, lora_request="nope")
    with pytest.raises(InvalidPrompt, match="2 LoRA requests for 1 prompts"):
        engine.generate(PROMPTS[:1], GREEDY, lora_request=[None, None])
    with pytest.raises(LoRAError, match="not a PEFT adapter"):
        engine.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("bad", str(tmp_path)))
    with pytest.raises(LoRAError, match="already loaded"):
        engine.load_lora(NAMES[0], tiny_adapters[NAMES[0]])
    with pytest.raises(LoRANotLoaded, match="'bad'"):
        engine.unload_lora("bad")
    assert engine.list_loras() == NAMES
    assert not engine.engine.scheduler.has_work  # nothing was queued
    assert token_ids(engine.generate(PROMPTS[:1], GREEDY, lora_request=ROWS[:1])) == mixed[:1]

    # A LoRARequest with a path loads the adapter on first use.
    out = engine.generate(
        PROMPTS[:1], GREEDY, lora_request=LoRARequest("again", tiny_adapters[NAMES[0]])
    )
    assert token_ids(out) == mixed[:1]
    engine.unload_lora("again")

    with pytest.raises(LoRANotLoaded, match="enable_lora=True"):
        make_llm(tiny).generate(PROMPTS[:1], GREEDY, lora_request=NAMES[0])
    narrow = make_llm(tiny, enable_lora=True, max_lora_rank=4, lora_target_modules=["q_proj"])
    with pytest.raises(LoRAError, match="rank 8 exceeds max_rank=4"):
        narrow.load_lora("rslora", tiny_adapters["rslora"])
    with pytest.raises(LoRAError, match="not in the stack's targets"):
        narrow.load_lora("all", tiny_adapters["all-modules"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_cache="contiguous"), "kv_cache='paged'"),
        (dict(speculative={"method": "ngram", "num_tokens": 2}), "speculative decoding"),
        (dict(mesh="pp=2"), "pipeline parallelism"),
        (dict(max_loras=0), "max_loras must be an int >= 1"),
        (dict(lora_target_modules=["lm_head"]), "non-empty subset"),
    ],
)
def test_engines_without_lora_support_say_so(tiny, kwargs, message):
    with pytest.raises(LoRAError, match=message):
        make_llm(tiny, enable_lora=True, **kwargs)
