"""Drafts for the export and vLLM tests, on the real SmolLM2 target (no mocks).

* `random_draft`: an untrained draft with a W < V vocabulary (every tensor non-trivial).
* `constant_draft`: lm_head = 0, so every logit is exactly 0 in any dtype and greedy drafting picks
  draft id 0 (ties go to the first index in eyas, and in vLLM, whose target-vocab logits are -inf
  outside the draft vocab and the draft ids ascend in target order): it always proposes the target
  token `d2t[0]`. Its acceptance on a known greedy continuation is exact arithmetic
  (`constant_acceptance`); with a shifted d2t it proposes another token.
* `fitted_draft`: a draft fitted in seconds (3-step TTT, eyas.ttt) to SmolLM2's own greedy
  continuations of the test prompts, so its acceptance is well above 1 on exactly those prompts and
  depends on every part of the draft (fc over the right aux layers, attention, norms, lm_head, d2t).
  Its decoys make it the base of the mis-served controls; the vLLM test also serves a draft made
  by eyas's own stages (tests/vllm_train_helpers.py).
* `vllm_python` / `run_vllm`: the separate vLLM venv (scripts/vllm-venv.sh) and its driver script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.vocab import d2t_t2d, target_to_draft

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time, there was")


def load_target(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval().requires_grad_(False)


def random_draft(tcfg, draft_vocab: int = 512, aux_layer_ids=(2, 15, 27), seed: int = 0, **overrides) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=draft_vocab, aux_layer_ids=list(aux_layer_ids), **overrides)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():  # norms away from 1 so a swapped norm tensor shows in the outputs
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    rng = np.random.default_rng(seed)
    sel = np.sort(rng.choice(tcfg.vocab_size, size=draft_vocab, replace=False))
    draft.set_vocab(*d2t_t2d(sel, tcfg.vocab_size))
    return draft


def constant_draft(tcfg, token: int, draft_vocab: int = 256, shift: int = 0, **kw) -> Eagle3Draft:
    """Always proposes target token `token + shift` (draft id 0; the other draft ids lie above it)."""
    draft = random_draft(tcfg, draft_vocab, **kw)
    sel = np.arange(token, token + draft_vocab) + shift
    assert sel[-1] < tcfg.vocab_size
    draft.set_vocab(*d2t_t2d(sel, tcfg.vocab_size))
    with torch.no_grad():
        draft.lm_head.weight.zero_()
    return draft


def constant_acceptance(continuation: list[int], token: int, k: int, max_tokens: int) -> dict:
    """vLLM's counters for a draft that always proposes `token`, from the target's greedy output.

    The prefill emits continuation[0] and the first proposal; each verify step then accepts the
    leading run of `token` among the next k target tokens and emits one more (correction or
    bonus), until max_tokens are out. `continuation` must reach max_tokens + k tokens.
    """
    assert len(continuation) >= max_tokens + k
    pos, drafts, per_pos = 1, 0, [0] * k
    while pos < max_tokens:
        run = 0
        while run < k and continuation[pos + run] == token:
            run += 1
        drafts += 1
        for i in range(run):
            per_pos[i] += 1
        pos += run + 1
    return {"num_drafts": drafts, "num_draft_tokens": drafts * k, "num_accepted_tokens": sum(per_pos), "accepted_per_pos": per_pos}


def merge_counts(counts: list[dict]) -> dict:
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": None}
    for c in counts:
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[key] += c[key]
        out["accepted_per_pos"] = list(c["accepted_per_pos"]) if out["accepted_per_pos"] is None else [
            a + b for a, b in zip(out["accepted_per_pos"], c["accepted_per_pos"])
        ]
    return out


@torch.no_grad()
def greedy_sequences(target, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from eyas.spec.generate import target_generate

    return [p + target_generate(target, torch.tensor(p), max_new_tokens=max_new_tokens).tokens for p in prompts_ids]


def fitted_draft(
    target, sequences: list[list[int]], aux_layer_ids=(2, 15, 27), draft_vocab: int = 512,
    steps: int = 50, ttt_steps: int = 3, lr: float = 3e-3, seed: int = 0, intermediate_size: int = 512,
    decoy_shifts: tuple[int, ...] = (-1, 1), num_layers: int = 1,
) -> Eagle3Draft:  # fmt: skip
    """Fit a draft to the target's greedy predictions on `sequences` (packed, 3-step TTT).

    With decoy_shifts, step 0 is also taught to propose a decoy token (never a right answer) when
    its aux states come from the layers `aux_layer_ids + shift`: served with an off-by-one layer
    convention it then accepts almost nothing, so such a mistake shows as a collapse of tau instead
    of the few-percent drop of an ordinary draft (adjacent residual streams are much alike).
    """
    from eyas.capture import capture
    from eyas.ttt import sdpa_masks, ttt_forward

    tcfg = target.config
    ids = torch.tensor([t for s in sequences for t in s])[None]
    doc = torch.tensor([i for i, s in enumerate(sequences) for _ in s])[None]
    pos = torch.tensor([j for s in sequences for j in range(len(s))])[None]
    sets = [list(aux_layer_ids)] + [[k + d for k in aux_layer_ids] for d in decoy_shifts]
    union = sorted({k for ks in sets for k in ks})
    aux, labels = [], []
    for s in sequences:  # one plain forward per sequence: aux states and the teacher's argmax
        x = torch.tensor(s)[None]
        a, _ = capture(target, x, layer_ids=union)
        aux.append(a[0])
        labels.append(target(x).logits[0].argmax(-1))
    aux_all = torch.cat(aux)[None].float()
    aux_sets = [aux_all[:, :, [union.index(k) for k in ks]] for ks in sets]
    aux_BSKD = aux_sets[0]
    teacher_S = torch.cat(labels)
    rng = np.random.default_rng(seed)
    used = np.unique(teacher_S.numpy())
    assert used.size <= draft_vocab, (used.size, draft_vocab)
    rest = np.setdiff1d(np.arange(tcfg.vocab_size), used)
    sel = np.sort(np.concatenate([used, rng.choice(rest, size=draft_vocab - used.size, replace=False)]))
    d2t, t2d = d2t_t2d(sel, tcfg.vocab_size)
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=draft_vocab, aux_layer_ids=list(aux_layer_ids),
                                  intermediate_size=intermediate_size, num_layers=num_layers)
    draft = Eagle3Draft(cfg, target.get_input_embeddings().weight.float())
    draft.set_vocab(d2t, t2d)
    # step i at row t reads token t+1+i and predicts the target's argmax after it
    n = ids.shape[1]
    rows = torch.arange(n)
    targets_T = []
    for i in range(ttt_steps):
        src = rows + 1 + i
        ok = (src < n) & (doc[0, src.clamp(max=n - 1)] == doc[0])
        lab = target_to_draft(teacher_S[src.clamp(max=n - 1)], t2d)
        targets_T.append(torch.where(ok, lab, torch.full_like(lab, -100)))
    decoy = torch.full_like(targets_T[0], int(np.flatnonzero(~np.isin(sel, used))[0]))
    masks = sdpa_masks(doc, ttt_steps)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        outs = ttt_forward(draft, aux_BSKD, ids, pos, masks)
        loss = sum(F.cross_entropy(draft.logits(o[0]).float(), t, ignore_index=-100) for o, t in zip(outs, targets_T))
        for wrong in aux_sets[1:]:
            (h,) = ttt_forward(draft, wrong, ids, pos, masks[:1])
            loss = loss + F.cross_entropy(draft.logits(h[0]).float(), decoy)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval().requires_grad_(False)


# --- the vLLM venv -------------------------------------------------------------------------------


def vllm_python() -> Path | None:
    venv = Path(os.environ.get("EYAS_VLLM_VENV") or REPO / ".venv-vllm")
    py = venv / "bin" / "python"
    return py if py.is_file() and (venv / ".eyas-vllm-recipe").is_file() else None


def run_vllm(job: dict, work: Path, timeout_s: int = 1500) -> dict:
    """Run scripts/vllm_check.py in the vLLM venv on `job`; -> its result (raises with the log tail)."""
    py = vllm_python()
    assert py is not None, "no vLLM venv: run scripts/vllm-venv.sh"
    work.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = work / "job.json", work / "result.json", work / "vllm.log"
    job_path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [str(py), str(REPO / "scripts" / "vllm_check.py"), str(job_path), str(result_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=str(work),
        )  # fmt: skip
    if proc.returncode != 0:
        tail = log_path.read_text()[-6000:]
        raise AssertionError(f"vllm_check.py exited {proc.returncode} after {time.perf_counter() - t0:.0f}s; log tail:\n{tail}")
    result = json.loads(result_path.read_text())
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[vllm] {len(job['runs'])} runs in {result['wall_s']}s: " + ", ".join(
        f"{n} load {r['load_s']}s gen {r['generate_s']}s" for n, r in result["runs"].items()), file=sys.stderr)  # fmt: skip
    return result
