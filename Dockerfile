# syntax=docker/dockerfile:1
# One image, three commands (splitspec-target, splitspec-draft, splitspec-gateway). Two targets:
#   cuda (default): torch + flashinfer on CUDA 12, for GPU nodes
#   cpu:            the CPU build of torch, for the demo pair (docker-compose.cpu.yml)

FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY splitspec splitspec
COPY common common
COPY target_service target_service
COPY draft_service draft_service

FROM base AS cpu
# a C compiler: the native attention kernels (and --compile's Inductor) are built on the machine at load
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
 && pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install .
COPY demo demo
EXPOSE 50051 9400 9401 8000

FROM base AS cuda
# the PyPI wheel of torch is the CUDA build; FlashInfer JIT-compiles its kernels on first use
RUN pip install torch==2.13.0 \
 && pip install '.[cuda]'
# CUDA IPC cannot export expandable segments: the pool must be plain cudaMalloc memory
ENV PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
EXPOSE 50051 9400 9401 8000
