# syntax=docker/dockerfile:1
# nanoserve, one image for every role: `serve` (all in one), `frontend`, `scheduler`, `executor`; and, as the
# stage `gateway`, SMG's image for compose's gateway profile.
#
#   make image                  # CPU torch; podman or docker; a local Debian base when no registry answers
#   make image GPU=1            # PyTorch's CUDA build (hosts with an NVIDIA driver and container toolkit)
#   docker build -t nanoserve .                                   # the same CPU image, by hand
#   docker build -t nanoserve:gpu --build-arg TORCH=cuda .        # the same GPU image, by hand
#   docker run --init -p 50051:50051 -v ~/.cache/nanoserve/models:/models:ro nanoserve   # `nanoserve serve`
#
# Build args:
#   BASE_IMAGE     a Debian-based image with Python 3.10+ (default: the official python:3.11-slim-bookworm)
#   TORCH          where torch comes from: cpu (PyTorch's CPU index, the default), cuda (its CUDA index),
#                  wheel (a torch wheel that `make image` put in build/torch-wheel/ from the host's pip)
#   TORCH_VERSION  the torch release (default 2.13.0, as `make install` takes)
#   CUDA_INDEX_URL the PyTorch CUDA index (default .../whl/cu130, CUDA 13.0; the wheels carry the CUDA runtime)
#
# The model is not in the image: mount a directory of models at /models (compose does). The embedded
# default, /models/SmolLM2-135M-Instruct, is what `make model` writes under ~/.cache/nanoserve/models.

ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm
ARG TORCH=cpu

FROM ${BASE_IMAGE} AS python
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv

# ------------------------------------------------------------------ the gateway: `--target gateway`
# SMG (Shepherd Model Gateway), compose's gateway profile: a Rust binary from PyPI, no torch, no model (it
# takes the tokenizer from the replicas over GetTokenizer). Its version is the one pin, pyproject.toml's
# `gateway` extra (tomllib: Python 3.11+).
#   make gateway-image          # or: docker build -t nanoserve-gateway --target gateway .
FROM python AS gateway
COPY pyproject.toml /tmp/pyproject.toml
RUN pip install $(python3 -c "import tomllib; print(*tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['optional-dependencies']['gateway'])") \
 && rm /tmp/pyproject.toml \
 && echo "nanoserve:x:10001:10001:nanoserve:/home/nanoserve:/usr/sbin/nologin" >> /etc/passwd \
 && echo "nanoserve:x:10001:" >> /etc/group \
 && mkdir -p /home/nanoserve && chown nanoserve:nanoserve /home/nanoserve
USER nanoserve
WORKDIR /home/nanoserve
EXPOSE 30000 29000
# Ready once a worker is healthy behind it (/readiness answers 503 before).
HEALTHCHECK --interval=10s --timeout=5s --start-period=1m --retries=3 \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/readiness', timeout=3)"
ENTRYPOINT ["smg"]
CMD ["launch", "--help"]

# ------------------------------------------------------------------ torch: one of three stages, by TORCH
# CPU images drop torch's own tests and its C++ headers (nothing compiles there).
FROM python AS torch-cpu
ARG TORCH_VERSION=2.13.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
 && rm -rf /opt/venv/lib/python3*/site-packages/torch/test /opt/venv/lib/python3*/site-packages/torch/include

# The host resolved a CPU wheel for this image's Python (its pip may take it from a local mirror);
# torch's own dependencies come from PyPI.
FROM python AS torch-wheel
RUN --mount=type=bind,source=build/torch-wheel,target=/tmp/torch-wheel pip install /tmp/torch-wheel/torch-*.whl \
 && rm -rf /opt/venv/lib/python3*/site-packages/torch/test /opt/venv/lib/python3*/site-packages/torch/include

# Triton (a dependency of CUDA torch) compiles a small C launcher per kernel at run time: it needs a
# C compiler and Python's headers. The CPU images carry no compiler.
FROM python AS torch-cuda
ARG TORCH_VERSION=2.13.0
ARG CUDA_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN headers=$(python3 -c "import os, sysconfig; print('' if os.path.exists(sysconfig.get_paths()['include'] + '/Python.h') else 'python3-dev')") \
 && apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev $headers \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "${CUDA_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && rm -rf /opt/venv/lib/python3*/site-packages/torch/test

# ------------------------------------------------------------------ nanoserve on the chosen torch
FROM torch-${TORCH}

# The stubs are generated here from protos/*.proto (as `make proto` does), then installed with the
# package. torch is already there, so pip keeps it.
COPY pyproject.toml README.md /tmp/src/
COPY protos/ /tmp/src/protos/
COPY scheduler_svc/ /tmp/src/scheduler_svc/
COPY executor_svc/ /tmp/src/executor_svc/
COPY kernels/ /tmp/src/kernels/
RUN cd /tmp/src \
 && pip install grpcio-tools==1.84.0 \
 && python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/*.proto \
 && pip install . \
 && cd / && rm -rf /tmp/src \
 && python -c "from protos import generation_pb2_grpc, engine_pb2; import scheduler_svc.entrypoints.cli"

# A plain passwd entry: minimal bases have no useradd.
RUN echo "nanoserve:x:10001:10001:nanoserve:/home/nanoserve:/usr/sbin/nologin" >> /etc/passwd \
 && echo "nanoserve:x:10001:" >> /etc/group \
 && mkdir -p /home/nanoserve /models \
 && chown nanoserve:nanoserve /home/nanoserve
USER nanoserve
WORKDIR /home/nanoserve

# In a container the front end listens on every interface (its own default is 127.0.0.1); the
# network namespace and the published ports decide who reaches it.
ENV NANOSERVE_MODEL_DIR=/models/SmolLM2-135M-Instruct \
    NANOSERVE_HOST=0.0.0.0 \
    NANOSERVE_PORT=50051 \
    NANOSERVE_METRICS_PORT=8000 \
    HF_HUB_OFFLINE=1

# gRPC, and Prometheus /metrics.
EXPOSE 50051 8000

# SERVING once every executor has shaken hands. Compose gives each role its own check.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m --retries=3 \
    CMD nanoserve client health --addr "127.0.0.1:${NANOSERVE_PORT}" --timeout 3 || exit 1

ENTRYPOINT ["nanoserve"]
CMD ["serve"]
