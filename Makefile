# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
# Each creates .venv with the pinned versions in constraints.txt on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export GPTPIPE_HOME ?= $(CURDIR)/var

.PHONY: install demo test test-images test-durations test-quick readme-counts stop bench bench-smoke gpu-check lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	# GPU users: see README "Installing on a GPU machine".
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,dask,docker,kubernetes]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m devstack.demo

stop: install
	$(PY) -m devstack.demo --stop

# everything (CI): real servers, torchrun, the demo's CLI; fails on a skip not listed in tests/conftest.py's
# EXPECTED_SKIPS; ends with the 30 slowest tests and the suite's time report (tests/suite_report.py:
# wall, cores busy, minutes per file). Two pytest-xdist workers, a whole file each at a time
# (--dist loadfile: a module's fixtures are built once; the files of the one server stack, prefect_stack,
# go to one worker together: tests/suite_report.py); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: install
	$(PY) -m pytest -q $(XDIST) --fail-on-unexpected-skips --durations=30

# the whole suite, then each file's seconds into tests/file_durations.json (the longest files start first)
test-durations: install
	$(PY) -m pytest -q $(XDIST) --fail-on-unexpected-skips --write-file-durations

# the images built from docker/Dockerfile and the compose stack started from them, on a Docker engine
# (.ci/run installs and starts one): tests/images. Base images: SERVICES_BASE, BASE_IMAGE and POSTGRES_IMAGE
# when all are set, else stand-ins made from Debian and PyPI (docker/standin-bases.sh; TORCH_WHEEL: a local
# CPU torch wheel, found where this machine kind keeps one)
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl))
test-images: install
	TORCH_WHEEL=$(TORCH_WHEEL) $(PY) -m pytest -q tests/images --durations=10

# the inner loop: the in-process tests only (no server, no torchrun, no spawned trainer fixtures)
test-quick: install
	$(PY) -m pytest -q $(XDIST) -m "not slow and not server and not spawns" --durations=10

# README's table of test counts, from collecting the suite (tests/test_suite.py checks it)
readme-counts: install
	$(PY) -m tests.readme_counts --write

# each prints its ratios against a baseline measured in the same run (docs/*.md "Speed")
bench: install
	$(PY) -m benchmarks.bench_tokenize
	$(PY) -m benchmarks.bench_train
	$(PY) -m benchmarks.bench_hellaswag
	$(PY) -m benchmarks.bench_rerun
	$(PY) -m benchmarks.bench_recipe --steps 160
	$(PY) -m benchmarks.bench_checkpoint
	$(PY) -m benchmarks.bench_eval

# on a fresh CUDA machine before a long run (on a machine without CUDA it says so and exits 0)
# every benchmark at its smallest setting (--smoke): that it runs and prints its ratio lines, not a timing
bench-smoke: install
	$(PY) -m pytest -q tests/test_benchmarks.py --durations=0

gpu-check: install
	$(PY) -m benchmarks.gpu_check $(if $(wildcard reference/build-nanogpt/train_gpt2.py),--reference reference/build-nanogpt/train_gpt2.py) --out $(GPTPIPE_HOME)/gpu_check.json

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) var
