# tokenfleet worker / gateway / producer image (CPU). For CUDA, start FROM a pytorch/pytorch CUDA image; for
# Ascend, from an image with CANN and install the `npu` extra.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# g++ builds the CPU paged-attention kernel on first start (cached in the container's ~/.cache);
# tcmalloc: fewer page faults on large per-step buffers (what vLLM-CPU's best setup preloads too)
RUN apt-get update && apt-get install -y --no-install-recommends g++ libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
ENV LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
WORKDIR /app
# CPU wheel of torch first, so the project's range does not pull a CUDA build
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<2.14"
COPY pyproject.toml README.md ./
COPY tokenfleet ./tokenfleet
RUN pip install '.[worker]'

# Models live on a volume: mount your HF model directory at /models/<name>.
VOLUME ["/models"]
ENTRYPOINT ["tokenfleet"]
CMD ["--help"]
