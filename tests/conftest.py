"""Test configuration: 8 host devices for sharding tests, set before JAX is imported."""

import gc
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # Modules holding long (`slow`) tests first, in their order, then the rest: under
    # pytest-xdist (`make test` runs two workers, a module at a time) the longest units start
    # first, so neither worker is left alone with a long module at the end.
    slow = {item.module.__name__ for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.module.__name__ not in slow)  # stable: order kept within
    if jax.default_backend() == "gpu":
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module.

    XLA:CPU maps each program's machine code into memory regions of its own. A process that
    kept every program of the suite reached the kernel's limit on mappings (vm.max_map_count,
    65530; the core held 65134): the next compile failed, and unwinding its error crashed the
    process. Engines the session fixtures keep recompile what they need."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def default_model():
    """(cfg, params) of the embedded SmolLM2-135M-Instruct, float32."""
    from jaxgen.model import load_model

    return load_model(None, show_progress=False)


@pytest.fixture(scope="session")
def default_tokenizer():
    from jaxgen.model import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own load of the same GGUF (PyTorch, CPU, float32): the reference."""
    import torch
    import transformers

    from tests.helpers import default_gguf

    directory, name = default_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def llm():
    """One engine on the default model, shared by the engine tests (it must survive them)."""
    from jaxgen import LLM

    return LLM()
