"""The runtime needs neither torch nor transformers (they are the test extra's reference only).

A subprocess in which `import torch` and `import transformers` fail converts the default model
from its GGUF file into an empty jaxgen cache, generates with `LLM`, and shows the help of every
runtime command. CI's first stage does the same from a venv that holds the runtime only.
"""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import contextlib, io, sys
sys.modules["torch"] = None          # `import torch` now raises ModuleNotFoundError
sys.modules["transformers"] = None
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("torch imported despite the block")

import jaxgen.cache, jaxgen.model, jaxgen.quant, jaxgen.sharding  # the lower-level packages
from jaxgen import LLM, SamplingParams
from jaxgen.cli.main import main

for command in ("generate", "chat", "serve", "batch", "bench", "perplexity", "convert"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    assert "usage:" in out.getvalue(), command

llm = LLM(warmup=False, max_num_seqs=2, max_model_len=256)
prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
print("ANSWER:", out.text)
"""


@pytest.mark.slow
def test_runtime_runs_without_torch_or_transformers(tmp_path):
    env = dict(os.environ, JAXGEN_CACHE=str(tmp_path / "cache"))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ANSWER:" in proc.stdout and "Paris" in proc.stdout, proc.stdout[-2000:]
    # First use: the conversion says what it does and where it wrote the model.
    assert "converted in" in proc.stderr and str(tmp_path / "cache") in proc.stderr
    assert (tmp_path / "cache" / "models").is_dir()
    converted = next((tmp_path / "cache" / "models").iterdir())
    assert (converted / "tokenizer.json").is_file()
    assert (converted / "tokenizer_config.json").is_file()
