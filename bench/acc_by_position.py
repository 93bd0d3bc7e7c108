"""Where a draft predicts well: teacher-forced top-1 accuracy by position inside an answer, on the
train stage's held-out answers against the target's own greedy MT-bench answers (CPU, float32).

    python bench/acc_by_position.py CONVERSATIONS.jsonl[.xz] [MORE.jsonl[.xz] ...] --draft EXPORTED_DRAFT_DIR \\
        --bench question.jsonl [--held-out 40] [--stride 1] [--questions 24] [--new 256]

CONVERSATIONS are the files the draft was trained on, concatenated in that order (what `prepare`
read); prepare runs on them with recipes/smollm2-sharegpt.yaml's settings (openai format,
max_length 2048, draft vocabulary 32000) and the train stage's grouped held-out split is rebuilt
from its output with the defaults (eval_fraction 0.02, seed 0) over all of prepare's samples, as
an online run splits them (an offline run splits the samples its extract output holds). The held-out
samples come in the files' order (with the ShareGPT file first, its first ~330 are all ShareGPT
ones); --stride k takes every k-th of them, reaching the later files. For each scored sample the first
assistant answer is scored; for each MT-bench question (first turn) the target answers greedily
(`--new` tokens), and that answer is scored. "Repeat" marks a label whose preceding 8 tokens
already occurred earlier in the same answer (a loop); "p_top1" buckets a label by the target's
largest next-token probability at the row that predicts it (how sure the target was there; for the
target's own greedy answers that is the label's probability, for held-out answers regenerated in
bf16 on the GPU nearly always).
Prints acc of TTT step 0 (and tau_hat over all steps) per position bucket, per repeat/non-repeat
label and per p_top1 bucket; per set of answers also the greedy chain (k = --steps drafts)
teacher-forced two ways: tau_chain per pass (eyas.spec.simulate.simulate_chain: the decoder's own
passes, each starting after the previous one's miss or bonus, tokens / passes, what `eyas evaluate`
measures) and tau_chain per row (1 + the mean run of leading correct steps over every answer row,
what the train stage's tau_chain_rows logs; it weighs easy stretches more than a decoder does). The
held-out answers are also split by source: ShareGPT ids against the self-written `self*` ones.
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
from eyas.spec.simulate import simulate_chain, teacher_forced_steps  # noqa: E402
from eyas.target import load_model, load_tokenizer  # noqa: E402
from eyas.train.build import split_groups_of  # noqa: E402
from eyas.train.data import split_indices  # noqa: E402

BUCKETS = [(0, 32), (32, 128), (128, 256), (256, 512), (512, 1 << 30)]
SURE = [0.0, 0.3, 0.5, 0.7, 0.9, 0.99]  # p_top1 bucket edges


class Tally:
    def __init__(self, steps: int):
        self.steps = steps
        self.cells: dict[str, torch.Tensor] = {}  # name -> [2, T]: correct, valid
        self.chain = [0, 0, 0, 0]  # simulated passes, their tokens; answer rows, their leading-correct runs

    def add(self, name: str, correct_T: torch.Tensor, valid_T: torch.Tensor) -> None:
        cell = self.cells.setdefault(name, torch.zeros(2, self.steps))
        cell[0] += correct_T
        cell[1] += valid_T

    def line(self, name: str) -> str:
        c, v = self.cells.get(name, torch.zeros(2, self.steps))
        acc = (c / v.clamp(min=1)).tolist()
        tau, run = 1.0, 1.0
        for x in acc:
            run *= x
            tau += run
        return f"{name:>16}: {int(v[0]):>7} labels  acc0 {acc[0]:.3f}  acc{self.steps - 1} {acc[-1]:.3f}  tau_hat {tau:.2f}"


    def chain_line(self) -> str:
        passes, tokens, rows, runs = self.chain
        return (f"{'chain':>16}: {passes:>7} passes  tau_chain per pass {tokens / max(passes, 1):.2f}  "
                f"per row {1 + runs / max(rows, 1):.2f} over {rows} rows")


def sure_name(lo: float, hi: float) -> str:
    return f"p_top1 {lo:.2f}-{min(hi, 1.0):.2f}"


def score(tallies: list[Tally], draft, target, ids_S: torch.Tensor, start: int, end: int, steps: int) -> None:
    """Labels ids[start:end] (one answer): step i at row r predicts ids[r + 2 + i]."""
    assert start >= 2, "an answer starts after its prompt (row start-2 predicts its first token)"
    layer_ids = list(draft.config.aux_layer_ids)
    with torch.no_grad():
        aux_1SKD, final_1SD = capture(target, ids_S[None], layer_ids=layer_ids)
        top1_S = torch.softmax(target.get_output_embeddings()(final_1SD[0]).float(), -1).max(-1).values
        correct_TS = teacher_forced_steps(draft, aux_1SKD[0], ids_S, steps, first_label=start)
    sim = simulate_chain(correct_TS, start, end, steps)
    run_R = correct_TS[:, start - 2 : end - 2].int().cumprod(0).sum(0)  # leading correct steps of each row
    counts = [len(sim.accepted), sum(n + 1 for n in sim.accepted), int(run_R.numel()), int(run_R.sum())]
    for tally in tallies:
        tally.chain = [a + b for a, b in zip(tally.chain, counts)]
    seen: set[tuple[int, ...]] = set()
    answer = ids_S.tolist()
    repeat = torch.zeros(len(answer), dtype=torch.bool)
    for j in range(start, end):
        key = tuple(answer[j - 8 : j]) if j - 8 >= start else None
        if key is not None:
            repeat[j] = key in seen
            seen.add(key)
    j_J = torch.arange(start, end)
    bucket_J = [next(f"pos {a}-{b if b < 1 << 30 else ''}" for a, b in BUCKETS if a <= j - start < b) for j in j_J.tolist()]
    names = {"all": torch.ones(len(j_J), dtype=torch.bool), "repeat": repeat[start:end], "no repeat": ~repeat[start:end]}
    for name in set(bucket_J):
        names[name] = torch.tensor([b == name for b in bucket_J])
    sure_J = top1_S[j_J - 1]  # the target's largest probability at row j-1, the row predicting label j
    for lo, hi in zip(SURE, SURE[1:] + [1.01]):
        names[sure_name(lo, hi)] = (sure_J >= lo) & (sure_J < hi)
    for name, sel_J in names.items():
        correct_T, valid_T = torch.zeros(steps), torch.zeros(steps)
        for t in range(steps):
            r_J = j_J - 2 - t
            ok_J = sel_J & (r_J >= 0)
            correct_T[t] = correct_TS[t, r_J[ok_J]].sum()
            valid_T[t] = ok_J.sum()
        for tally in tallies:
            tally.add(name, correct_T, valid_T)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("conversations", nargs="+")
    p.add_argument("--draft", required=True)
    p.add_argument("--bench", required=True)
    p.add_argument("--held-out", type=int, default=40)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--questions", type=int, default=24)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--steps", type=int, default=7)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eyas-accpos-"))
    data = tmp / "all.jsonl"
    with open(data, "w", encoding="utf-8") as out:
        for path in a.conversations:
            with (lzma.open if path.endswith(".xz") else open)(path, "rt", encoding="utf-8") as f:
                out.writelines(line for line in f if line.strip())
    cfg = load_config(None, [f"--run_dir={tmp}", "--target.model=embedded:smollm2", "--target.dtype=float32",
                             f"--prepare.data={data}", "--prepare.format=openai", "--prepare.max_length=2048",
                             "--prepare.draft_vocab_size=32000"])
    from eyas.prepare import main as prepare

    prepare(cfg)
    prep = Prepared(cfg.stage_dir("prepare"))
    _, held = split_indices(len(prep.ids), 0.02, 0, split_groups_of(prep), say=False)
    print(f"{len(prep.ids)} samples, {len(held)} held out; scoring {min(a.held_out, len(held[:: a.stride]))} of them "
          f"(every {a.stride}) and {a.questions} MT-bench questions", flush=True)
    target = load_model(cfg.target, device=torch.device("cpu"))
    tok = load_tokenizer(cfg.target)
    draft = load_exported(a.draft, target.get_input_embeddings().weight.detach()).eval()

    held_tally = Tally(a.steps)
    by_source = {"ShareGPT": Tally(a.steps), "self-written": Tally(a.steps)}
    for i in held[:: a.stride][: a.held_out]:
        s = prep[i]
        source = "self-written" if str(s["id"]).startswith("self") else "ShareGPT"
        mask = s["loss_mask"].bool()
        on = mask.nonzero().flatten()
        if not len(on):
            continue
        start = int(on[0])
        end = start
        while end < len(mask) and mask[end]:
            end += 1
        score([held_tally, by_source[source]], draft, target, s["input_ids"][:end], start, end, a.steps)

    bench_tally = Tally(a.steps)
    questions = [json.loads(line) for line in open(a.bench, encoding="utf-8") if line.strip()][: a.questions]
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = target.generate(prompt, max_new_tokens=a.new, do_sample=False, pad_token_id=tok.eos_token_id)
        ids_S = out[0]
        score([bench_tally], draft, target, ids_S, prompt.shape[1], ids_S.shape[0], a.steps)

    bench_title = f"{Path(a.bench).name} (--bench), first turns"  # MT-bench's question.jsonl, or bench/self_prompts.py's
    sets = [("held-out conversations, first answers", held_tally),
            *((f"held-out {name} conversations, first answers", t) for name, t in by_source.items()),
            (bench_title, bench_tally)]
    for title, tally in sets:
        print(title)
        print(tally.chain_line())
        for name in ["all", *(f"pos {x}-{y if y < 1 << 30 else ''}" for x, y in BUCKETS), "repeat", "no repeat",
                     *(sure_name(lo, hi) for lo, hi in zip(SURE, SURE[1:] + [1.01]))]:
            print(tally.line(name))


if __name__ == "__main__":
    main()
