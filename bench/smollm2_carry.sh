#!/usr/bin/env bash
# Builds the .carry/ folders that bench/smollm2_gpu.sh takes to the device machine (here, on the
# CPU machine, from the installed embedded assets: `make setup` first). A call carries at most
# 64 MiB with the repository (~24 MB with data/), so the 98 MB GGUF travels xz-compressed in three parts:
#   .carry/p1   gguf wheel, the .xz's first part (smolpart.00), MT-bench question.jsonl  -> `keep`
#   .carry/p2   the .xz's second part (smolpart.01)                                -> `stash` after keep
#   .carry/p3   the .xz's last part (smolpart.02)                                  -> the first phase that
#               loads SmolLM2 (or `stash` too)
#   .carry/r2   sharegpt_rest.jsonl.xz: the ShareGPT records whose conversation is not in
#               data/smollm2-sharegpt-regenerated.jsonl.xz (by id)                 -> `regenerate_rest`
#               with ALL=1 instead sharegpt_all.jsonl.xz, all 17,671 (19.6 MB)     -> `source`
#   .carry/cfg  smolcfg/: SmolLM2's config and tokenizer, no weights (2 MB)        -> `check`, or `keep`'s profile
#   .carry/d1, .carry/d2, ...  with DRAFT=DIR (a train call's returned folder: draft_model.safetensors.part*
#               and train_files.tar): the draft's parts, as many per folder as one call carries, the
#               last folder also the speculators export's config.json and the joined weights' sha256:
#               `STASH=.carry/dN ... stash` each, then `evaluate_draft` or a train from /root/init
# and prints what each call would carry against the 64 MiB (failing when one is over). .carry/ is
# in .gitignore.
#     bash bench/smollm2_carry.sh            # then the calls of bench/smollm2_gpu.sh's header
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
C=.carry
mkdir -p $C/p1 $C/p2 $C/p3 $C/r2 $C/cfg/smolcfg
gguf=$($PY -c "from eyas import assets; print(assets.package_file(assets.SMOLLM2_PACKAGE, assets.SMOLLM2_GGUF))")
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $gguf" | sha256sum -c
# xz takes the GGUF from 98.4 to 90.5 MB (once, ~1 min; kept in .carry/ while it still decompresses to
# the GGUF), which leaves room beside it for the data/ files every call carries with the tree
xzf=$C/smollm2.gguf.xz
if [[ ! -f $xzf ]] || ! xz -dc $xzf | cmp -s - "$gguf"; then
    xz -T0 -6 -c "$gguf" > $xzf.tmp && mv $xzf.tmp $xzf
fi
rm -f $C/p[123]/smolpart.*
split -n 3 -d -a 2 $xzf $C/smolpart.
mv $C/smolpart.00 $C/p1/ && mv $C/smolpart.01 $C/p2/ && mv $C/smolpart.02 $C/p3/
cmp <(cat $C/p1/smolpart.00 $C/p2/smolpart.01 $C/p3/smolpart.02 | xz -dc) "$gguf"
rm -f $C/p1/gguf-*.whl
$PY -m pip download -q --no-deps --only-binary=:all: -d $C/p1 "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
cp "$($PY -c 'from eyas import assets; print(assets.mtbench_path())')" $C/p1/mtbench.jsonl
rm -f $C/r2/*
$PY - "${ALL:-0}" $C/r2 data/smollm2-sharegpt-regenerated.jsonl.xz <<'PY'
import json, lzma, sys
from eyas import assets
from eyas.chat import load_conversations
everything, out, done_file = sys.argv[1] == "1", sys.argv[2], sys.argv[3]
recs = assets.load_sharegpt()
if everything:
    name, keep = "sharegpt_all", recs
else:
    done = {c.id for c in load_conversations(done_file, "openai")[0]}
    name, keep = "sharegpt_rest", [r for r in recs if str(r.get("id")) not in done]
with lzma.open(f"{out}/{name}.jsonl.xz", "wt", encoding="utf-8", preset=6) as f:
    for r in keep:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
print(f"{len(keep)} of {len(recs)} ShareGPT records -> {out}/{name}.jsonl.xz")
PY
# what travels with every call: tracked files and untracked ones git does not ignore
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r stat -c %s -- 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
# what one call may carry: 64 MiB less 1 MB (the device refused a call this script counted at 67.0 MB)
CALL_BYTES=$(( 67108864 - 1000000 ))
if [[ -n ${DRAFT:-} ]]; then
    # the parts in name order into d1, d2, ...: each folder as many as fit one call beside the
    # working tree; the last folder also holds config.json and the joined weights' sha256
    rm -rf $C/d[0-9]* && mkdir -p $C/d1
    mapfile -t dparts < <(ls "$DRAFT"/draft_model.safetensors.part* 2>/dev/null | sort)
    (( ${#dparts[@]} )) || { echo "no draft_model.safetensors.part* in DRAFT=$DRAFT" >&2; exit 2; }
    # a train call's tar names the whole draft's sha256 and part count (draft_parts.txt, session 20 on):
    # parts of two calls, or a draft_rest not fetched, are refused here instead of loading later
    have=$(cat "${dparts[@]}" | sha256sum | cut -d' ' -f1)
    if tar tf "$DRAFT/train_files.tar" ./draft_parts.txt > /dev/null 2>&1; then
        read -r want nwant < <(tar xOf "$DRAFT/train_files.tar" ./draft_parts.txt)
        [[ $have == "$want" && ${#dparts[@]} == "$nwant" ]] || {
            echo "DRAFT=$DRAFT: ${#dparts[@]} parts, sha256 $have; its train_files.tar names $nwant parts, $want" >&2; exit 2; }
    fi
    room=$(( CALL_BYTES - tree )) i=1 used=0
    for p in "${dparts[@]}"; do
        n=$(stat -c %s "$p")
        if (( used > 0 && used + n > room )); then i=$(( i + 1 )) used=0; mkdir -p $C/d$i; fi
        cp "$p" $C/d$i/draft.${p##*.}
        used=$(( used + n ))
    done
    tar xOf "$DRAFT/train_files.tar" ./export_speculators_config.json > $C/d$i/config.json
    echo "$have" > $C/d$i/sha256
fi
smol=$($PY -c "from eyas import assets; print(assets.smollm2_dir())")
cp "$smol"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} $C/cfg/smolcfg/

size() { du -cb "$@" | tail -1 | cut -f1; }
over=0
call() {  # NAME FOLDER...: the call's bytes with the working tree
    local n=$(( tree + $(size "${@:2}") ))
    awk -v name="$1" -v n=$n -v max=$CALL_BYTES 'BEGIN {printf "  %-34s %6.1f MB of %.1f\n", name, n / 1e6, max / 1e6}'
    (( n <= CALL_BYTES )) || { echo "    over what a call carries" >&2; over=1; }
}
awk -v n=$tree 'BEGIN {printf "per call (the working tree: %.1f MB):\n", n / 1e6}'
call "keep (p1)" $C/p1
call "stash (p2)" $C/p2
if [[ ${ALL:-0} == 1 ]]; then
    call "source (r2)" $C/r2
    call "regenerate (p3)" $C/p3
else
    call "regenerate_rest (p3 r2)" $C/p3 $C/r2
fi
call "train, evaluate_draft, ... (p3)" $C/p3
call "check (r2 cfg)" $C/r2 $C/cfg
if [[ -n ${DRAFT:-} ]]; then
    for d in $C/d[0-9]*; do call "stash (${d##*/})" $d; done
fi
exit $over
