"""Two local processes x 4 CPU devices (jax.distributed over 127.0.0.1, gloo collectives)
generate the same tokens as one process with 8 devices."""

import json
import os
import subprocess
import sys

import pytest

from jaxgen.entrypoints.mooncake_local import free_port

SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
from jaxgen.sharding.distributed import initialize
initialize(sys.argv[1], 2, int(sys.argv[2]))
import jax
from jaxgen import LLM, SamplingParams
from jaxgen.model import load_tokenizer
from tests.sharding.test_multihost import CFG, PROMPTS, make_params
assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
llm = LLM.from_parts(CFG, make_params(), load_tokenizer(None), mesh="tp=8",
                     kv_cache="contiguous", max_model_len=256, max_num_seqs=4, warmup=False)
outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]))
"""

PROMPTS = [[5, 9, 1, 30, 7], [100, 3], [42] * 11, [8, 8, 9]]


def _cfg():
    from jaxgen.model import ModelConfig

    return ModelConfig(
        arch="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )


CFG = _cfg()


def make_params():
    import jax

    from jaxgen.model import init_params

    return init_params(CFG, jax.random.key(3))


@pytest.mark.slow
def test_two_processes_equal_one_process(default_tokenizer):
    from jaxgen import LLM, SamplingParams

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("XLA_FLAGS", None)
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, address, str(i)],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        line = [x for x in out.splitlines() if x.startswith("TOKENS ")][-1]
        results.append(json.loads(line[len("TOKENS ") :]))
    llm = LLM.from_parts(
        CFG,
        make_params(),
        default_tokenizer,
        mesh="tp=8",
        kv_cache="contiguous",
        max_model_len=256,
        max_num_seqs=4,
        warmup=False,
    )
    want = [
        o.outputs[0].token_ids
        for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ]
    assert results[0] == results[1] == want
