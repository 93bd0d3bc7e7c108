"""The labels a draft misses although the target was sure of them: on the target's own greedy
answers to MT-bench first turns (CPU, float32), every label j whose target top-1 probability (its
softmax at row j-1; on greedy text the label's own probability) is at least --sure and whose TTT
step-0 prediction differs (row j-2 reads the target's states at j-2 and token j-1 and predicts
token j, as the draft serves), with the text before it, the draft's token, the probability the
target gave that token, how sure the target was of the label before, whether the label is in
the draft vocabulary, and whether the label with the two tokens before it already occurred earlier
in the answer (a repeat the draft could have copied). Label 0 of an answer counts too (serving takes it from the prefill), as in
bench/acc_by_position.py.

    python bench/misses.py --draft EXPORTED_DRAFT_DIR --bench question.jsonl [--questions 8] [--new 256] [--sure 0.99]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas.capture import capture  # noqa: E402
from eyas.config import load_config  # noqa: E402
from eyas.export import load_exported  # noqa: E402
from eyas.spec.simulate import teacher_forced_steps  # noqa: E402
from eyas.spec.propose import to_target_ids  # noqa: E402
from eyas.target import load_model, load_tokenizer  # noqa: E402
from eyas.train.ttt import sdpa_masks, ttt_forward  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True)
    p.add_argument("--bench", required=True)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--sure", type=float, default=0.99)
    a = p.parse_args()
    cfg = load_config(None, [f"--run_dir={tempfile.mkdtemp(prefix='eyas-misses-')}",
                             "--target.model=embedded:smollm2", "--target.dtype=float32"])
    target = load_model(cfg.target, device=torch.device("cpu"))
    tok = load_tokenizer(cfg.target)
    draft = load_exported(a.draft, target.get_input_embeddings().weight.detach()).eval()
    sure = missed = 0
    for q in [json.loads(line) for line in open(a.bench, encoding="utf-8") if line.strip()][: a.questions]:
        text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ids_S = target.generate(prompt, max_new_tokens=a.new, do_sample=False, pad_token_id=tok.eos_token_id)[0]
            aux_1SKD, final_1SD = capture(target, ids_S[None], layer_ids=list(draft.config.aux_layer_ids))
            probs_SV = torch.softmax(target.get_output_embeddings()(final_1SD[0]).float(), -1)
            s = ids_S.shape[0]
            step0 = ttt_forward(draft, aux_1SKD, ids_S[None], torch.arange(s)[None],
                                sdpa_masks(torch.zeros(1, s, dtype=torch.long), 1))[0]
            pred_S = to_target_ids(draft, draft.logits(step0[0]).argmax(-1))  # row r predicts ids[r + 2]
            start = prompt.shape[1]
            # this script's row/label offsets against the evaluation's teacher-forced path (acc_by_position's)
            correct_S = teacher_forced_steps(draft, aux_1SKD[0], ids_S, 1, first_label=start)[0]
        assert torch.equal(correct_S[start - 2 : s - 2], pred_S[start - 2 : s - 2] == ids_S[start:]), q["question_id"]
        for j in range(start, s):
            if probs_SV[j - 1].max() < a.sure:
                continue
            sure += 1
            guess = int(pred_S[j - 2])
            if guess == int(ids_S[j]):
                continue
            missed += 1
            before = tok.decode(ids_S[max(start, j - 6) : j])
            tri = ids_S[j - 2 : j + 1].tolist()
            repeat = any(ids_S[i - 2 : i + 1].tolist() == tri for i in range(start + 2, j))
            print(f"q{q['question_id']} answer token {j - start:3d}  {before!r:42} target {tok.decode([ids_S[j]])!r:14} "
                  f"draft {tok.decode([guess])!r:14} p_target(draft's) {probs_SV[j - 1][guess]:.3f}  "
                  f"p_top1 of the label before {probs_SV[j - 2].max():.2f}  "
                  f"in the draft vocab {bool(draft.t2d[ids_S[j]])}  repeat {repeat}")
    print(f"{missed} of {sure} labels with target p_top1 >= {a.sure} missed by step 0 ({missed / max(sure, 1):.1%})")


if __name__ == "__main__":
    main()
