"""Score a GPU evaluation's greedy differences offline: SmolLM2 in float32 on the CPU decodes each
first-turn prompt greedily up to its first difference and scores the two tokens the GPU decoders
chose there. Rows where the CPU reaches neither token took another path earlier (its prefix
differs) and say nothing.

    python bench/divergence_gaps.py RESULTS.json MTBENCH.jsonl [N]
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyas.assets import smollm2_dir
from eyas.evaluate import render


def main(results: str, bench: str, n: int = 40) -> None:
    d = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    questions = {str(json.loads(ln)["question_id"]): json.loads(ln) for ln in open(bench)}
    r = json.load(open(results))
    divs = [(rec["id"], mode, rec[mode]["first_divergence"]) for rec in r["records"] if rec["turn"] == 0
            for mode in ("chain", "tree") if rec.get(mode, {}).get("first_divergence")]
    divs.sort(key=lambda x: x[2]["position"])
    rows = []
    for qid, mode, fd in divs[:n]:
        ids = render(tok, [{"role": "user", "content": questions[qid]["turns"][0]}])
        pos, a, b = fd["position"], fd["target_only"], fd["speculative"]
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=pos + 1, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        if len(g.logits) <= pos or a is None or b is None:
            continue
        logits_V = g.logits[pos][0].float()
        la, lb = float(logits_V[a]), float(logits_V[b])
        choice = int(g.sequences[0, len(ids) + pos])
        rows.append({"question": qid, "mode": mode, "position": pos, "same_fork": choice in (a, b),
                     "gap": abs(la - lb), "relative_gap": abs(la - lb) / max(abs(la), abs(lb), 1.0)})
        print(json.dumps(rows[-1]), flush=True)
    fork = [x for x in rows if x["same_fork"]]
    print(f"{len(rows)} differences scored, {len(fork)} reach the same fork on the CPU; relative gaps there: "
          + " ".join(f"{x['relative_gap']:.4f}" for x in sorted(fork, key=lambda x: x["relative_gap"])))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 40)
