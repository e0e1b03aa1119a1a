# nanoserve build plumbing. `make test` and `make run` do everything from a clean clone.

# Prerequisites run in the order written: install, then proto, then model.
.NOTPARALLEL:
.DEFAULT_GOAL := help

# PYTHON creates the venv; PY runs everything else (override it to use another interpreter).
PYTHON ?= python3
VENV := .venv
PY ?= $(VENV)/bin/python
# Newer than pyproject.toml once the venv matches it; makes a second `make install` instant.
STAMP := $(VENV)/.installed
# Stubs need grpc_tools: from the venv, unless PY points elsewhere (the GPU image).
PROTO_NEEDS := $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
# The GPU machine has no venv; its image's python3 already has what the gpu tests need.
GPU_PY := $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)

PROTOS := $(wildcard protos/*.proto)
STUBS := $(PROTOS:.proto=_pb2.py)

.PHONY: help install proto model test test-gpu run image gateway-image compose-test clean

help:
	@echo "make run       install, build stubs, fetch the model, start 'nanoserve serve'"
	@echo "make test      install, build stubs, fetch the model, run the CPU test suite"
	@echo "make test-gpu  build stubs and run the tests marked gpu (deps already installed)"
	@echo "make image     build the container image with podman or docker (GPU=1: PyTorch's CUDA build)"
	@echo "make gateway-image the gateway's image (SMG, for compose's gateway profile)"
	@echo "make compose-test  build the images, run compose.yaml, serve a request, the failure drill, the gateway"
	@echo "make install   create $(VENV) and install nanoserve with its test and convert extras"
	@echo "make proto     generate the python stubs for protos/*.proto"
	@echo "make model     fetch and convert the embedded model (cached outside the repo)"
	@echo "make clean     remove generated stubs and caches (keeps $(VENV) and the model)"

install: $(STAMP)

# torch first and pinned: 2.13.0 is a CPU wheel on local disk, so the project's `torch>=2.5`
# is already satisfied and pip never reaches for a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[test,convert]'
	touch $@

proto: $(STUBS)

# One protoc call per file; the _pb2_grpc.py and _pb2.pyi come along with the _pb2.py.
protos/%_pb2.py: protos/%.proto | $(PROTO_NEEDS)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $<

model: install
	$(PY) -m executor_svc.fetch_model

test: install proto model
	$(PY) -m pytest -q -m "not gpu"

test-gpu:
	$(MAKE) --no-print-directory proto PY=$(GPU_PY)
	$(GPU_PY) -m pytest -q -m gpu

run: install proto model
	$(VENV)/bin/nanoserve serve

# Podman is installed when neither engine is present; see .ci/build-image.sh for GPU, IMAGE, BASE_IMAGE.
image:
	GPU=$(GPU) TARGET= .ci/build-image.sh

gateway-image:
	TARGET=gateway .ci/build-image.sh

# The real thing, with every role as a container; not part of `make test` (it builds an image).
compose-test: install proto model
	$(PY) tests/compose/check_compose.py

clean:
	rm -f protos/*_pb2.py protos/*_pb2.pyi protos/*_pb2_grpc.py
	rm -rf .pytest_cache .hypothesis build *.egg-info
	find . \( -path ./$(VENV) -o -path ./.git \) -prune -o -name __pycache__ -type d -exec rm -rf {} +
