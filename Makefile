# make demo: the main job on a simulated GPU.  make test: lint, types, tests.
# Both build .venv from nothing with the first Python >= 3.11 found.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	&& { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_WHEELS ?= /opt/wheels

.PHONY: demo test lint typecheck unit bench clean system-deps

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: need Python >= 3.11 on PATH (or PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# PyTorch's CPU build for the `gpushare run` tests, from the wheel on disk where
	@# there is one (a plain `pip install torch` would fetch a multi-GB CUDA build).
	@v=$$($(BIN)/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")'); \
	w=$$(ls $(TORCH_WHEELS)/torch-*+cpu-$$v-*.whl 2>/dev/null | head -n 1); \
	if [ -n "$$w" ]; then echo "installing $$w"; $(BIN)/python -m pip install -q "$$w"; \
	else echo "make: no PyTorch CPU wheel in $(TORCH_WHEELS): the PyTorch tests will be skipped"; fi
	touch $(STAMP)

# Real servers the tests use, from Debian's packages: Prometheus (the exporter's
# scraper) and tmux (the terminal `top` runs in). Installed when absent and root.
SYSTEM_TOOLS := prometheus tmux
system-deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing (Debian packages)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "make: missing$$missing (needs root and apt-get): the tests that use them will be skipped"; fi; \
	fi

demo: $(STAMP)
	$(BIN)/gpushare demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# Two workers: most tests wait on real processes and sockets, so the suite takes half
# the time; hermetic tests (no fixed port or path) make it safe.
unit: $(STAMP) system-deps
	$(BIN)/pytest -q -n 2 --dist worksteal

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python benchmarks/handoff.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
