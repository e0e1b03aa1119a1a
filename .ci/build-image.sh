#!/usr/bin/env bash
# `make image`: builds the Dockerfile with podman or docker (podman is installed when neither is).
#   GPU=1       PyTorch's CUDA build instead of a CPU one
#   TARGET=gateway  the Dockerfile's gateway stage instead: SMG, for compose's gateway profile (no torch)
#   IMAGE       the tag (default nanoserve:latest, nanoserve:gpu with GPU=1, nanoserve-gateway:latest for the gateway)
#   BASE_IMAGE  the base (default the Dockerfile's official Python image). When it cannot be pulled
#               (no registry reachable), a Debian base is bootstrapped here with the host's apt sources.
# A CPU image takes the torch wheel that this host's pip resolves from PyTorch's CPU index (or from
# wherever the host's pip configuration points, a local mirror say), for the image's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/container-engine.sh
pick_engine

base=${BASE_IMAGE:-$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)}
torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile | head -1)
target=()
if [ "${TARGET:-}" = gateway ]; then torch=none; tag=${IMAGE:-nanoserve-gateway:latest}; target=(--target gateway)
elif [ -n "${GPU:-}" ]; then torch=cuda; tag=${IMAGE:-nanoserve:gpu}
else torch=cpu; tag=${IMAGE:-nanoserve:latest}
fi

SECONDS=0
if "$ENGINE" image inspect "$base" >/dev/null 2>&1 || timeout 300 "$ENGINE" pull -q "$base" >/dev/null 2>&1; then
    echo "== base $base"
else
    . /etc/os-release
    local_base="localhost/nanoserve-base:${VERSION_CODENAME:-local}"
    echo "== $base cannot be pulled: bootstrapping $local_base from this host's apt sources"
    # Made once per host and kept: remove it to take new packages or certificates.
    "$ENGINE" image inspect "$local_base" >/dev/null 2>&1 || .ci/bootstrap-base-image.sh "$ENGINE" "$local_base"
    base=$local_base
fi
echo "== base ready in ${SECONDS}s"

if [ "$torch" = cpu ]; then
    py=$("$ENGINE" run --rm "$base" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    rm -rf build/torch-wheel && mkdir -p build/torch-wheel
    # The host's pip configuration stays in force (its find-links, extra indexes, certificates).
    host_py=python3; [ -x .venv/bin/python ] && host_py=.venv/bin/python
    if "$host_py" -m pip download -q --no-deps --only-binary=:all: --retries 1 --timeout 30 \
            --python-version "$py" --implementation cp --platform "manylinux_2_28_$(uname -m)" \
            --index-url https://download.pytorch.org/whl/cpu --dest build/torch-wheel "torch==$torch_version" 2>/dev/null; then
        torch=wheel
        echo "== torch for Python $py: $(ls build/torch-wheel)"
    else
        echo "== this host's pip resolved no CPU torch $torch_version for Python $py: the build takes it from PyTorch's CPU index"
    fi
fi

format=(); [ "$ENGINE" = podman ] && format=(--format docker)  # docker format keeps HEALTHCHECK
torch_arg=(); [ "$torch" = none ] || torch_arg=(--build-arg TORCH="$torch")
SECONDS=0
"$ENGINE" build "${format[@]}" "${target[@]}" -t "$tag" --build-arg BASE_IMAGE="$base" "${torch_arg[@]}" .
size=$("$ENGINE" image inspect "$tag" --format '{{.Size}}')
echo "== built $tag (torch: $torch) in ${SECONDS}s: $((size / 1000000)) MB"
