# make demo: the main job on a simulated GPU.  make test: lint, types, tests.
# Both build .venv from nothing with the first Python >= 3.11 found.
# make unit runs pytest alone; make system-deps installs the real servers some tests use
# (make test calls it; make unit does not, so it never installs anything on the system).
SHELL := /bin/bash
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	&& { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_WHEELS ?= /opt/wheels
# The PyTorch the tests run (no PyTorch test skips for want of it).
TORCH ?= torch==2.13.0
# One line per package as pip resolves it (no progress bars: they are noise in a log), and
# a line every 15 s while it installs (the long silent part).
PIP := PYTHONUNBUFFERED=1 $(BIN)/python -m pip
# Two workers: most tests wait on real processes and sockets, so the suite takes half
# the time; hermetic tests (no fixed port or path) make it safe.
PYTEST := $(BIN)/pytest -q -n 2 --dist worksteal

.PHONY: demo test lint typecheck unit test-loaded bench clean system-deps pre-commit

# Rebuilt when the dependencies or the version change (the installed metadata holds it).
$(STAMP): pyproject.toml src/gpushare/_version.py
	@test -n "$(PYTHON)" || { echo "make: need Python >= 3.11 on PATH (or PYTHON=...)"; exit 1; }
	@echo "make: creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version 2>&1))"
	$(PYTHON) -m venv $(VENV)
	@echo "make: installing gpushare and its extras node, plot, cli, k8s, nvml, test, lint" \
	  "(about 80 packages: a line each as pip finds it, then a minute or more to install)"
	@# The full log in $(VENV)/pip.log; on screen a line per package, and the log's end on failure.
	@start=$$(date +%s); \
	( while sleep 15; do echo "  ... $$(( $$(date +%s) - start )) s, still installing"; done ) & ticker=$$!; \
	$(PIP) install --progress-bar off -e '.[dev]' 2>&1 | tee $(VENV)/pip.log \
	  | grep -E --line-buffered '^(Collecting|Processing|Installing collected)' \
	  | sed -u -E 's/ \(from [^)]*\)$$//; s/^Processing .*\/([^/]+)\.whl$$/Processing \1/; s/^(.{1,96}).*/  \1/'; \
	status=$${PIPESTATUS[0]}; kill $$ticker 2>/dev/null; \
	if [ $$status -ne 0 ]; then tail -n 30 $(VENV)/pip.log; echo "make: pip failed (full log: $(VENV)/pip.log)"; exit $$status; fi; \
	echo "make: pip finished in $$(( $$(date +%s) - start )) s"
	@# PyTorch for the `gpushare run`, compile and torch-backend tests: a CPU build's wheel
	@# from $(TORCH_WHEELS) where one lies there, else $(TORCH) from PyPI (a CUDA build that
	@# runs on the CPU: several GB, once per machine; pip's cache keeps it for later venvs).
	@v=$$($(BIN)/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")'); \
	w=$$(ls $(TORCH_WHEELS)/torch-*+cpu-$$v-*.whl 2>/dev/null | head -n 1); \
	what=$${w:-$(TORCH)}; \
	echo "make: installing PyTorch ($$what$${w:+, a wheel on disk}$${w:-, from PyPI: several GB the first time})"; \
	start=$$(date +%s); \
	( while sleep 15; do echo "  ... $$(( $$(date +%s) - start )) s, still installing PyTorch"; done ) & ticker=$$!; \
	$(PIP) install --progress-bar off "$$what" >> $(VENV)/pip.log 2>&1; status=$$?; \
	kill $$ticker 2>/dev/null; \
	if [ $$status -ne 0 ]; then tail -n 30 $(VENV)/pip.log; \
	  echo "make: pip could not install $$what (full log: $(VENV)/pip.log; TORCH=... names another)"; exit 1; fi; \
	echo "make: PyTorch $$($(BIN)/python -c 'import torch; print(torch.__version__)') installed in $$(( $$(date +%s) - start )) s"
	touch $(STAMP)

# Real servers the tests use, from Debian's packages: Prometheus (the exporter's
# scraper) and tmux (the terminal `top` runs in). Installed when absent and root;
# otherwise the tests that need them skip, saying why.
SYSTEM_TOOLS := prometheus tmux
system-deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make: installing$$missing (Debian packages)"; \
	    apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "make: missing$$missing (needs root and apt-get): the tests that use them will be skipped"; fi; \
	fi

demo: $(STAMP)
	$(BIN)/gpushare demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports
	@# What ruff does not see: radon's complexity (no D or worse, but a grandfathered
	@# list that only shrinks) and modules over 700 lines (none) (tests/test_layers.py).
	$(BIN)/pytest -q -n 0 -p no:cacheprovider tests/test_layers.py -k 'radon or lines'

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(PYTEST)

# make unit under load, as a busy machine runs it: a busy loop per CPU and a writer of
# 512 MiB files, each flushed to disk (in $TMPDIR, default /var/tmp), beside it; all
# ended when it ends, also on Ctrl-C (benchmarks/load.py).
test-loaded: $(STAMP)
	$(BIN)/python benchmarks/load.py --busy $$(nproc) --writer auto -- $(PYTEST)

# The cluster suite's real servers (tests/cluster): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kubelet built once from Go modules with the
# machine's Go (minutes); and the node's image built from deploy/Dockerfile with buildah on
# a Debian base. Both cached in ~/.cache/gpushare; where they cannot be built (no Go; not
# root, no apt-get for the image) the script says why and the tests skip.
# Each prints a line at least every 30 s through its long steps.
.PHONY: cluster-deps image
cluster-deps:
	@bash tests/cluster/build-k8s.sh >/dev/null || [ $$? = 3 ]
	@bash tests/cluster/build-dra.sh >/dev/null || [ $$? = 3 ]

image: $(STAMP)
	@PYTHON=$(BIN)/python bash deploy/build-image.sh >/dev/null || [ $$? = 3 ]

# lint, typecheck, then unit's tests once the system tools are there (those tests skip
# without them): tests/make-test.sh builds cluster-deps' and image's servers in the
# background meanwhile, runs the tests that need neither, then, once both are built, the
# cluster tests; a failed build fails it.
test: $(STAMP) system-deps
	@BIN=$(BIN) PYTEST="$(PYTEST)" bash tests/make-test.sh

# The same checks before each commit: `make pre-commit` once per clone installs the hook.
pre-commit: $(STAMP)
	$(BIN)/pre-commit install

bench: $(STAMP)
	$(BIN)/python benchmarks/handoff.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
