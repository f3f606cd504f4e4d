# syntax=docker/dockerfile:1.7
#
# vaed GPU image: the gRPC VAE decode server on a pinned CUDA PyTorch base.
#
#   docker build -t vaed:0.1.0 .
#   docker run --gpus 1 -p 50051:50051 -p 9090:9090 -p 8000:8000 \
#       -v /srv/models:/models:ro vaed:0.1.0
#
# A CPU image for kind, minikube and laptops (target "cpu": CPU torch on a slim
# Python base, no CUDA layers; serves random:wan2.1-tiny unless told otherwise):
#
#   docker build --target cpu -t vaed:dev-cpu .
#   docker run -p 50051:50051 -p 8000:8000 vaed:dev-cpu
#
# Stages: "wheel" builds the vaed wheel from source; "cpu" and "runtime" (the
# default target, last) each install the dependencies (cached while
# pyproject.toml is unchanged) and then that wheel.

# torch 2.11 + cuDNN 9, the torch and cuDNN line the README's figures were
# measured on (those with torch 2.11.0+cu130 and cuDNN 9.19; this image's CUDA
# 12.8 build reports its own versions in the identity). Pinned tag, never "latest".
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
# The CPU image's base and torch: the torch the README's CPU setup installs.
ARG CPU_BASE_IMAGE=python:3.12.8-slim-bookworm
ARG CPU_TORCH_VERSION=2.13.0

# ---------------------------------------------------------------- wheel
# vaed is pure Python: the wheel builds on the small base, so the cpu target
# never pulls the CUDA image.
FROM ${CPU_BASE_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY client/ client/
COPY vaed/ vaed/
# --no-deps: only vaed itself; its dependencies go into their own layer below.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- cpu
FROM ${CPU_BASE_IMAGE} AS cpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The same user, paths and caches as the GPU image below (the manifests rely on them).
ARG VAED_UID=10001
RUN groupadd --system --gid "${VAED_UID}" vaed \
    && useradd --system --uid "${VAED_UID}" --gid "${VAED_UID}" \
       --home-dir /cache --no-create-home --shell /usr/sbin/nologin vaed \
    && mkdir -p /cache /models \
    && chown "${VAED_UID}:${VAED_UID}" /cache \
    && chmod 0770 /cache

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/cache \
    USER=vaed \
    XDG_CACHE_HOME=/cache \
    TORCH_HOME=/cache/torch \
    HF_HOME=/cache/huggingface

# CPU torch from its own index first: from PyPI pip takes the CUDA build and
# ~15 nvidia wheels (GBs). Then the dependencies, torch held by a constraint.
ARG CPU_TORCH_VERSION
RUN pip install --no-cache-dir "torch==${CPU_TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml /tmp/deps/pyproject.toml
RUN python -c 'import importlib.metadata as md, tomllib; \
deps = tomllib.load(open("/tmp/deps/pyproject.toml", "rb"))["project"]["dependencies"]; \
have = {d.metadata["Name"].lower(): d.version for d in md.distributions()}; \
open("/tmp/deps/requirements.txt", "w").write("\n".join(deps) + "\n"); \
open("/tmp/deps/constraints.txt", "w").write("".join(f"{n}=={have[n]}\n" for n in ("torch",)))' \
    && pip install --no-cache-dir -r /tmp/deps/requirements.txt -c /tmp/deps/constraints.txt \
    && rm -rf /tmp/deps

RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-deps /wheels/*.whl \
    && vaed --help > /dev/null

COPY scripts/fetch_weights.py /opt/vaed/fetch_weights.py

USER 10001:10001
WORKDIR /cache

# gRPC, Prometheus metrics, the HTTP front (remote_decode, /health)
EXPOSE 50051 9090 8000

# Nothing to compile or warm up on the CPU: SERVING within seconds.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["vaed", "health", "--server", "localhost:50051", "--timeout", "5"]

ENTRYPOINT ["vaed"]
# The tiny random model needs no weights; mount a folder at /models and pass
# --model /models/... for a real one (slow on a CPU).
CMD ["serve", "--device", "cpu", "--host", "0.0.0.0", "--port", "50051", \
     "--metrics-port", "9090", "--http-port", "8000", "--model", "random:wan2.1-tiny", "--warmup-shapes", "none", \
     "--grace", "30"]

# ---------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# gcc + libc6-dev: Triton JIT-compiles a small C launcher per kernel and the
# runtime base ships no C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

# Numeric, fixed UID/GID so Kubernetes runAsNonRoot can verify it and
# fsGroup-owned volumes line up. /cache holds every writable cache; in
# Kubernetes it is an emptyDir, so the root filesystem can stay read-only.
ARG VAED_UID=10001
RUN groupadd --system --gid "${VAED_UID}" vaed \
    && useradd --system --uid "${VAED_UID}" --gid "${VAED_UID}" \
       --home-dir /cache --no-create-home --shell /usr/sbin/nologin vaed \
    && mkdir -p /cache /models \
    && chown "${VAED_UID}:${VAED_UID}" /cache \
    && chmod 0770 /cache

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/cache \
    USER=vaed \
    XDG_CACHE_HOME=/cache \
    TORCH_HOME=/cache/torch \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor \
    TRITON_CACHE_DIR=/cache/triton \
    HF_HOME=/cache/huggingface

# Dependency layer: rebuilt only when pyproject.toml changes. The base
# image's torch/triton are pinned as constraints so pip keeps them (a
# resolver upgrade would pull a multi-GB CUDA build and a mismatched triton).
# The cuDNN frontend serves the fast tier's tuned conv plans (--conv-plans): its
# Python binding alone (--no-deps), as vaed runs cuDNN's own engines only and not
# the frontend's CUTLASS-DSL ones (their CUDA 13 packages: ~110 MB of wheels).
COPY pyproject.toml /tmp/deps/pyproject.toml
RUN python -c 'import importlib.metadata as md, tomllib; \
deps = tomllib.load(open("/tmp/deps/pyproject.toml", "rb"))["project"]["dependencies"]; \
have = {d.metadata["Name"].lower(): d.version for d in md.distributions()}; \
open("/tmp/deps/requirements.txt", "w").write("\n".join(deps) + "\n"); \
open("/tmp/deps/constraints.txt", "w").write("".join(f"{n}=={have[n]}\n" for n in ("torch", "triton") if n in have))' \
    && pip install --no-cache-dir -r /tmp/deps/requirements.txt -c /tmp/deps/constraints.txt \
    && pip install --no-cache-dir --no-deps "nvidia-cudnn-frontend==1.32.0" \
    && rm -rf /tmp/deps

# Source layer: the vaed wheel alone, without touching the dependencies.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-deps /wheels/*.whl \
    && vaed --help > /dev/null

# The weights fetcher the Kubernetes weights Job and the decoders' init
# container run (k8s/weights, k8s/base): fills /models/<name>/vae only.
# huggingface_hub comes with diffusers.
COPY scripts/fetch_weights.py /opt/vaed/fetch_weights.py

USER 10001:10001
WORKDIR /cache

# gRPC, Prometheus metrics, the HTTP front (remote_decode, /health)
EXPOSE 50051 9090 8000

# Kubernetes ignores HEALTHCHECK and uses its native gRPC probes instead
# (k8s/); this one serves plain `docker run`. start-period covers weight load,
# Triton compilation and the warm-up decode.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
    CMD ["vaed", "health", "--server", "localhost:50051", "--timeout", "5"]

# vaed runs as PID 1 and installs its own SIGTERM handler (drain, then exit),
# so no init shim is needed; Triton's compiler subprocesses are waited for.
ENTRYPOINT ["vaed"]
# A diffusers Wan folder (or its vae/ subfolder) mounted read-only at /models;
# the same path k8s/models/wan21 serves and fills (vae/ only, ~0.51 GB).
# --grace 30: in-flight streams get 30 s after SIGTERM; `docker stop` kills
# after 10 s unless told otherwise, so stop with `docker stop -t 40`.
# Kubernetes sets its own --grace (k8s/base) and the keepalive/connection-age
# flags; the server's defaults for those suit a single container.
CMD ["serve", "--gpu", "0", "--host", "0.0.0.0", "--port", "50051", \
     "--metrics-port", "9090", "--http-port", "8000", "--model", "/models/Wan2.1-T2V-1.3B-Diffusers", \
     "--grace", "30"]
