"""Variants of trained drafts made on the CPU without training, to measure with
`eyas evaluate --evaluate.mode=simulate` or tools/vocab_coverage.py before spending GPU time on them:

* mean: the first draft averaged with the others (eyas.average.average_drafts, what
  `eyas export --export.average_with` does to a trained checkpoint), e.g. the ends of two
  trainings, one started from the other;
* whole-vocab: the draft moved to the whole target vocabulary (W = V), its lm_head rows copied
  by token and the new ones fitted from the target's rows (eyas.vocab.with_vocab, what
  `--prepare.draft_vocab_size=V --train.init_vocab=remap` does at a training's start).

    python tools/draft_variants.py mean OUT_DIR DRAFT DRAFT [DRAFT ...] [--target.model=...]
    python tools/draft_variants.py whole-vocab OUT_DIR DRAFT [--target.model=...]

Inputs: each DRAFT any draft directory eyas reads (a checkpoint such as RUN/train/final, an export
root such as RUN/export, or one layout inside it); the target (--target.model, default
embedded:smollm2) must be the drafts' own: it names the verifier, checks the aux layers, and gives
whole-vocab its lm_head.
Outputs: OUT_DIR/speculators (bf16, the layout `vllm serve` loads, with the first draft's chain
length) and OUT_DIR/variant.json (the kind, each input's directory and weights' sha256, the lm_head
rows copied). OUT_DIR/speculators must not exist yet. For example:

    python tools/draft_variants.py mean variants/mean runs/second/export runs/first/export
    eyas evaluate recipes/smollm2-sharegpt.yaml --evaluate.draft=variants/mean/speculators \\
        --evaluate.mode=simulate --evaluate.target_outputs=target_outputs.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch


def speculative_tokens(files) -> int:
    """The chain length a speculators export proposes (3, eyas's default, for any other form)."""
    if files.kind != "speculators":
        return 3
    config = json.loads(files.config.read_text())
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens", 3))


def main(kind: str, out_dir: str, drafts: list[str], target_model: str) -> None:
    from eyas.artifacts import atomic_write_text
    from eyas.assets import sha256_file
    from eyas.average import average_drafts
    from eyas.config import load_config
    from eyas.draft_files import export_draft, locate, open_draft, whole_vocab
    from eyas.export import check_target
    from eyas.target import load_config as load_target_config
    from eyas.target import load_model, model_path
    from eyas.vocab import with_vocab

    if kind == "mean" and len(drafts) < 2:
        raise SystemExit("mean needs two drafts or more")
    if kind == "whole-vocab" and len(drafts) != 1:
        raise SystemExit("whole-vocab takes one draft")
    out = Path(out_dir)
    if (out / "speculators").exists():
        raise SystemExit(f"{out / 'speculators'} exists: pick another OUT_DIR or remove it")
    cfg = load_config(None, [f"--target.model={target_model}", "--target.dtype=float32"])
    tcfg = load_target_config(cfg.target)
    files = [locate(d, "DRAFT") for d in drafts]
    models = [open_draft(f.dir, what="DRAFT").float() for f in files]
    for m in models:
        check_target(m.config, tcfg)
    model = models[0]
    if kind == "mean":
        counts = {"lm_head_rows_shared": [s["lm_head_rows_shared"] for s in average_drafts(model, models[1:], drafts[1:])]}
        print(f"mean of {len(models)} drafts; lm_head rows shared with the first: {counts['lm_head_rows_shared']}")
    else:
        target = load_model(cfg.target, device=torch.device("cpu"))
        d2t, _ = whole_vocab(replace(model.config, draft_vocab_size=model.config.vocab_size))
        model, counts = with_vocab(model, d2t, target.get_output_embeddings().weight.detach())
        print(f"whole vocabulary: {counts['copied']:,} lm_head rows copied, {counts['new']:,} fitted")
    written = export_draft(model, out, ("speculators",), "bfloat16", num_target_layers=tcfg.num_hidden_layers,
                           verifier=model_path(cfg.target), verifier_arch=list(getattr(tcfg, "architectures", None) or []),
                           num_speculative_tokens=speculative_tokens(files[0]))
    inputs = [{"dir": str(f.dir.resolve()), "weights_sha256": sha256_file(f.weights)} for f in files]
    atomic_write_text(out / "variant.json", json.dumps({"kind": kind, "inputs": inputs, "target": target_model,
                                                        **counts}, indent=1) + "\n")
    print(f"-> {written['speculators']} (what it was made from: {out / 'variant.json'})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("mean", "whole-vocab"))
    ap.add_argument("out_dir")
    ap.add_argument("drafts", nargs="+", help="draft directories: checkpoints, export roots or layouts")
    ap.add_argument("--target.model", dest="target_model", default="embedded:smollm2",
                    help="the drafts' target: a directory, hub id or embedded:NAME (default: %(default)s)")
    a = ap.parse_args()
    main(a.kind, a.out_dir, a.drafts, a.target_model)
