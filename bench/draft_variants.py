"""Variants of exported drafts made on the CPU without training, to be measured by
`eyas evaluate --evaluate.mode=simulate` or bench/vocab_coverage.py before a GPU session spends time
on them:

* mean: the first draft averaged with the others (eyas.average.average_drafts, what
  `eyas export --export.average_with` does to a trained checkpoint), e.g. two checkpoints of one
  schedule;
* whole-vocab: the draft moved to the whole target vocabulary (W = V), its lm_head rows carried
  over by token and the new ones fitted from the target's rows (eyas.train.build.with_vocab, what
  `--prepare.draft_vocab_size=V --train.init_vocab=remap` does at a training's start).

    python bench/draft_variants.py mean OUT_DIR DRAFT DRAFT [DRAFT ...] [--target.model=...]
    python bench/draft_variants.py whole-vocab OUT_DIR DRAFT [--target.model=...]

Each writes OUT_DIR/speculators (bf16, the layout eyas's GPU runs return). The target (default
embedded:smollm2) names the verifier, checks the aux layers, and gives whole-vocab its lm_head.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch


def main(kind: str, out_dir: str, drafts: list[str], target_model: str) -> None:
    from eyas.average import average_drafts
    from eyas.config import load_config
    from eyas.export import export_draft, load_exported, whole_vocab
    from eyas.target import load_config as load_target_config
    from eyas.target import load_model, model_path
    from eyas.train.build import with_vocab

    cfg = load_config(None, [f"--target.model={target_model}", "--target.dtype=float32"])
    tcfg = load_target_config(cfg.target)
    models = [load_exported(d) for d in drafts]
    if kind == "mean":
        if len(models) < 2:
            raise SystemExit("mean needs two drafts or more")
        model = models[0]
        shared = average_drafts(model, models[1:], drafts[1:])
        print(f"mean of {len(models)} drafts; lm_head rows shared with the first: {[s['lm_head_rows_shared'] for s in shared]}")
    else:
        if len(models) != 1:
            raise SystemExit("whole-vocab takes one draft")
        target = load_model(cfg.target, device=torch.device("cpu"))
        lm_head_VD = target.get_output_embeddings().weight.detach()
        d2t, t2d = whole_vocab(replace(models[0].config, draft_vocab_size=lm_head_VD.shape[0]))
        model, record = with_vocab(models[0], d2t, t2d, lm_head_VD)
        print(f"whole vocabulary: {record['copied']:,} lm_head rows copied, {record['new']:,} fitted")
    written = export_draft(model, Path(out_dir), ("speculators",), "bfloat16", num_target_layers=tcfg.num_hidden_layers,
                           verifier=model_path(cfg.target), verifier_arch=list(getattr(tcfg, "architectures", None) or []))
    print(f"-> {written['speculators']}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("mean", "whole-vocab"))
    ap.add_argument("out_dir")
    ap.add_argument("drafts", nargs="+", help="exported draft directories (config.json + model.safetensors)")
    ap.add_argument("--target.model", dest="target_model", default="embedded:smollm2")
    a = ap.parse_args()
    main(a.kind, a.out_dir, a.drafts, a.target_model)
