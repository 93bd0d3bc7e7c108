"""How much the old per-sample held-out split flattered a draft: teacher-forced accuracy of an
exported draft on held-out conversations that had a piece of the same ShareGPT conversation (or an
identical prompt) in training, against held-out conversations that had none.

    python bench/heldout_leak.py REGENERATED.jsonl[.xz] EXPORTED_DRAFT_DIR [--per-set 40] [--max-len 1024]

REGENERATED is the conversations the draft was trained on (the train stage's prepare input, in its
order), EXPORTED_DRAFT_DIR an `eyas export` layout. The split is the one sessions 3-5 used
(`split_indices` without groups, eval_fraction 0.02, seed 0). For each held-out conversation the
target (SmolLM2, float32, CPU) gives the aux states; the draft's TTT forward gives, per step i, its
top-1 at every assistant token (the label's loss mask is 1), as training's acc_T.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas.capture import capture  # noqa: E402
from eyas.config import load_config  # noqa: E402
from eyas.export import load_exported  # noqa: E402
from eyas.prepared import Prepared  # noqa: E402
from eyas.spec.simulate import teacher_forced_steps  # noqa: E402
from eyas.target import load_model  # noqa: E402
from eyas.train.data import split_groups, split_indices  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("conversations")
    p.add_argument("draft")
    p.add_argument("--per-set", type=int, default=40)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=7)
    a = p.parse_args()
    opener = lzma.open if a.conversations.endswith(".xz") else open
    with opener(a.conversations, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train, held = split_indices(len(rows), 0.02, 0)
    first = [next((m["content"] for m in r["messages"] if m["role"] == "user"), "").strip() for r in rows]
    groups = split_groups([r["id"] for r in rows], first)  # what the grouped split keeps together
    in_train = {groups[i] for i in train}
    leaked = [i for i in held if groups[i] in in_train]
    clean = [i for i in held if groups[i] not in in_train]
    print(f"held out {len(held)}: {len(leaked)} with a sibling or the same prompt in training, {len(clean)} without")
    sets = {"leaked": leaked[: a.per_set], "clean": clean[: a.per_set]}
    tmp = Path(tempfile.mkdtemp(prefix="eyas-leak-"))
    data = tmp / "subset.jsonl"
    data.write_text("".join(json.dumps(rows[i]) + "\n" for s in sets.values() for i in s))
    cfg = load_config(None, [f"--run_dir={tmp}", "--target.model=embedded:smollm2", "--target.dtype=float32",
                             f"--prepare.data={data}", "--prepare.format=openai", f"--prepare.max_length={a.max_len}",
                             "--prepare.draft_vocab_size=32000"])
    from eyas.prepare import main as prepare

    prepare(cfg)
    prep = Prepared(cfg.stage_dir("prepare"))
    by_id = {x: k for k, x in enumerate(prep.ids)}
    target = load_model(cfg.target, device=torch.device("cpu"))
    draft = load_exported(a.draft, target.get_input_embeddings().weight.detach()).eval()
    layer_ids = list(draft.config.aux_layer_ids)
    for name, idx in sets.items():
        correct = torch.zeros(a.steps)
        valid = torch.zeros(a.steps)
        kept = [i for i in idx if rows[i]["id"] in by_id]  # prepare drops a conversation with nothing left to train
        for i in kept:
            s = prep[by_id[rows[i]["id"]]]
            ids_S, mask_S = s["input_ids"], s["loss_mask"].bool()
            with torch.no_grad():
                aux_1SKD, _ = capture(target, ids_S[None], layer_ids=layer_ids)
                correct_TS = teacher_forced_steps(draft, aux_1SKD[0], ids_S, a.steps)
            n = ids_S.shape[0]
            for t in range(a.steps):  # row r predicts ids[r + 2 + t]: counted where that label is trained
                lab = torch.zeros(n, dtype=torch.bool)
                lab[: max(0, n - 2 - t)] = mask_S[2 + t :]
                correct[t] += (correct_TS[t] & lab).sum()
                valid[t] += lab.sum()
        acc = (correct / valid.clamp(min=1)).tolist()
        tau, run = 1.0, 1.0
        for x in acc:
            run *= x
            tau += run
        print(f"{name:>6}: {len(kept)} conversations ({len(idx) - len(kept)} dropped by prepare), {int(valid[0])} trained tokens; acc " +
              " ".join(f"{x:.3f}" for x in acc) + f"; tau_hat {tau:.2f}", flush=True)


if __name__ == "__main__":
    main()
