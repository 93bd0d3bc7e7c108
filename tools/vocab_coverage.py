"""What the draft vocabulary costs on stored target outputs: the greedy chain, simulated pass by pass
(eyas.spec.simulate, as `eyas evaluate --evaluate.mode=simulate`), per draft, three ways over the
positions whose token lies outside a reference draft vocabulary (REF's t2d; default each draft's own):

* as is: the draft's own proposals;
* rejected: those positions never accepted (what a draft with REF's vocabulary is held to);
* accepted: those positions always accepted (an upper bound on what covering them could give).

    python tools/vocab_coverage.py TARGET_OUTPUTS --draft DIR [--draft DIR ...] [--ref DIR] [--steps 7]

Inputs: TARGET_OUTPUTS, a `target_outputs.json` written by `eyas evaluate` (or its folder), e.g.
results/decoding/smollm2_mtbench_target_outputs_fp32_cpu.json.xz decompressed; each --draft any
draft directory eyas reads (a checkpoint such as RUN/train/final, an export root such as RUN/export,
or one layout inside it). The target is the one the outputs' key names, run in float32 on the CPU;
every prompt's target forward is shared by the drafts.
Output (stdout): how many output tokens lie outside REF's vocabulary and the most frequent of them;
per draft the chain's tau (new tokens per verify pass) each of the three ways, and its top-1
accuracy per TTT step at those positions. For example, a draft with a 32k-token vocabulary against
the same draft moved to the whole vocabulary (tools/draft_variants.py whole-vocab):

    xz -dc results/decoding/smollm2_mtbench_target_outputs_fp32_cpu.json.xz > target_outputs.json
    python tools/vocab_coverage.py target_outputs.json \\
        --draft runs/smollm2/export --draft variants/whole/speculators --ref runs/smollm2/export
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch


def draft_t2d(draft_dir: str) -> torch.Tensor:
    """The target tokens in a draft's vocabulary (t2d, V bools) of any draft form; all of them when
    its draft vocabulary is the whole vocabulary."""
    from eyas.draft_files import locate, read_vocab

    return read_vocab(locate(draft_dir, "--draft"))[1].bool()


def main(outputs: str, drafts: list[str], ref: str | None, k: int) -> None:
    from eyas.capture import capture
    from eyas.config import load_config
    from eyas.evaluate.decoding import load_eval_draft
    from eyas.spec.simulate import label_mask, simulate_chain, teacher_forced_steps
    from eyas.target import load_model, load_tokenizer

    path = Path(outputs)
    data = json.loads((path / "target_outputs.json" if path.is_dir() else path).read_text())
    key = data["key"]["target"]
    revision = [f"--target.revision={key['revision']}"] if key.get("revision") else []
    cfg = load_config(None, [f"--target.model={key['model']}", *revision, "--target.dtype=float32"])
    tok = load_tokenizer(cfg.target)
    target = load_model(cfg.target, device=torch.device("cpu"), attn_implementation="sdpa")
    embed = target.get_input_embeddings().weight
    models = {d: load_eval_draft(Path(d), embed, torch.device("cpu"), torch.float32) for d in drafts}
    refs = {d: draft_t2d(ref or d) for d in drafts}
    layer_ids = list(next(iter(models.values())).config.aux_layer_ids)
    assert all(list(m.config.aux_layer_ids) == layer_ids for m in models.values()), "drafts with other aux layers"
    outside = Counter()
    first = refs[drafts[0]]
    stats = {d: {"hit": torch.zeros(k), "n": torch.zeros(k), "as is": [0, 0], "rejected": [0, 0], "accepted": [0, 0]}
             for d in drafts}
    for r in data["runs"]:
        start = len(r["prompt_ids"])
        ids = torch.tensor(r["prompt_ids"] + r["tokens"])
        s = ids.shape[0]
        outside.update(t for t in r["tokens"] if not first[t])
        with torch.no_grad():
            aux, _ = capture(target, ids[None], layer_ids=layer_ids)
        j_TS = torch.arange(s)[None] + 2 + torch.arange(k)[:, None]  # the token step i at row t predicts
        valid_TS = label_mask(k, s, start)
        for d, draft in models.items():
            with torch.no_grad():
                correct_TS = teacher_forced_steps(draft, aux[0], ids, k, first_label=start)
            out_TS = torch.zeros_like(correct_TS)
            inside = j_TS < s
            out_TS[inside] = ~refs[d][ids[j_TS[inside]]]
            out_TS &= valid_TS
            st = stats[d]
            st["hit"] += (correct_TS & out_TS).sum(1)
            st["n"] += out_TS.sum(1)
            for name, c in (("as is", correct_TS), ("rejected", correct_TS & ~out_TS), ("accepted", correct_TS | out_TS)):
                sim = simulate_chain(c, start, s, k).stats()
                st[name][0] += sim.new_tokens
                st[name][1] += sim.verify_passes
    n_tokens = sum(len(r["tokens"]) for r in data["runs"])
    top = ", ".join(f"{tok.decode([t])!r} {n}" for t, n in outside.most_common(10))
    print(f"{sum(outside.values()):,} of {n_tokens:,} output tokens ({sum(outside.values()) / n_tokens:.2%}) "
          f"lie outside {ref or drafts[0]}'s draft vocabulary ({len(outside)} distinct): {top}")
    for d in drafts:
        st = stats[d]
        line = "  ".join(f"{name} {new / passes:.4f} ({passes:,} passes)" for name in ("as is", "rejected", "accepted")
                         for new, passes in [st[name]])
        acc = " ".join(f"{h / max(n, 1):.3f}" for h, n in zip(st["hit"].tolist(), st["n"].tolist()))
        print(f"{d}: chain {line}; top-1 at those positions per step: {acc} (of {int(st['n'][0]):,})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outputs", help="target_outputs.json (or its folder) of an `eyas evaluate` run")
    ap.add_argument("--draft", action="append", required=True,
                    help="a draft directory: checkpoint, export root or layout (repeat for several)")
    ap.add_argument("--ref", default=None, help="the draft whose vocabulary counts as covered (default: each draft's own)")
    ap.add_argument("--steps", type=int, default=7, help="draft tokens per pass (the chain's k)")
    a = ap.parse_args()
    main(a.outputs, a.draft, a.ref, a.steps)
