"""Constructions for tests/spec/test_consistency.py (training-time test vs speculative decoding), on
its tiny target and random draft (tests/models.py's tiny_model and random_draft, with weights large
enough that every decoder layer changes the residual stream and that a wrong position, hidden state
or token moves the draft's logits by far more than the tolerances).

* `RecordingDraft`: the real draft behind eyas.spec's draft interface (`config`, `d2t`, `fuse`,
  `forward_step`, `logits`). Every call goes to the real draft unchanged; it records the aux states
  the decoding loop feeds (`fed_aux`) and the real draft logits of every draft step of every round
  (`records[(t, i)]`, t = the position whose step-0 output starts the round = L - 2, i = the draft
  step). With `force` (the ground-truth token sequence) it returns, instead of the real logits,
  logits whose argmax is the ground-truth token at the predicted position t + 2 + i (teacher forcing:
  the case where every proposal is right), except where `wrong(t, i)` says to propose another token
  (to exercise partial acceptance): the ground truth then ranks second (`wrong` -> 1 or True: a
  top-2 tree still holds it) or far down (-> 2: the tree path is cut there too).
* `ttt_logits`: the training forward (eyas.train.data.pack -> TTTDraft, as Trainer.forward runs it)
  on a packed row, -> {(t, i): draft logits of TTT step i at row t of the given sample}.
"""

from __future__ import annotations

import torch

from eyas.draft import Eagle3Draft
from eyas.train.data import pack
from eyas.ttt import TTTDraft, sdpa_masks
from eyas.vocab import target_to_draft


def draft_ids_of(draft, target_ids: torch.Tensor) -> torch.Tensor:
    return target_to_draft(target_ids, draft.t2d)


class RecordingDraft:
    """See the module docstring. `wrong(t, i) -> 0/1/2`; rounds are recognised by the one `fuse`
    call eyas.spec.propose.extend makes per round (the step-0 inputs of the new positions)."""

    def __init__(self, draft: Eagle3Draft, force: list[int] | None = None, wrong=None):
        self.draft, self.config, self.d2t = draft, draft.config, draft.d2t
        self.force, self.wrong = force, wrong
        self.fed_aux: list[torch.Tensor] = []
        self.records: dict[tuple[int, int], torch.Tensor] = {}
        self.clean: set[tuple[int, int]] = set()
        """(t, i) whose inputs were all ground truth: proposals 0..i-1 of the round were forced right."""
        self._new_round = False
        self._t = self._step = -1
        self._round_clean = True

    def fuse(self, aux_BSKD: torch.Tensor) -> torch.Tensor:
        assert aux_BSKD.shape[0] == 1
        self.fed_aux.append(aux_BSKD[0].clone())
        self._new_round = True
        return self.draft.fuse(aux_BSKD)

    def forward_step(self, input_ids_BS, h_BSD, position_ids_BS, past_k=None, past_v=None, mask_BSP=None, **kw):
        if self._new_round:  # extend: step 0 over the new positions c .. L-2
            self._t, self._step, self._new_round, self._round_clean = int(position_ids_BS[0, -1]), 0, False, True
        else:  # draft step i >= 1 of this round: every node sits at position t + i
            self._step += 1
            assert bool((position_ids_BS == self._t + self._step).all()), (position_ids_BS, self._t, self._step)
        return self.draft.forward_step(input_ids_BS, h_BSD, position_ids_BS, past_k, past_v, mask_BSP, **kw)

    def logits(self, prenorm_BSD: torch.Tensor) -> torch.Tensor:
        real_BSW = self.draft.logits(prenorm_BSD)
        key = (self._t, self._step)
        assert key not in self.records, f"draft step {key} ran twice in one round"
        self.records[key] = real_BSW[0, 0].clone()  # row 0: the chain, or the tree's best frontier node
        if self._round_clean:
            self.clean.add(key)
        if self.force is None:
            return real_BSW
        p = self._t + self._step + 2  # the position this step predicts
        w = real_BSW.shape[-1]
        forced_W = torch.full((w,), -30.0)
        if p < len(self.force):
            gt = int(draft_ids_of(self.draft, torch.tensor([self.force[p]]))[0])
            assert gt >= 0, f"ground-truth token {self.force[p]} is outside the draft vocab"
            rank = int(self.wrong(*key)) if self.wrong is not None else 0
            if rank == 0:
                forced_W[gt] = 0.0
            else:  # another token first; the ground truth second (rank 1) or among the last (rank 2)
                forced_W[(gt + 1) % w] = 0.0
                forced_W[gt if rank == 1 else (gt + 2) % w] = -1.0
                self._round_clean = False
        else:  # past the known sequence: anything (the loop stops before it matters)
            forced_W[0] = 0.0
            self._round_clean = False
        return forced_W.to(real_BSW).expand_as(real_BSW)


def ttt_logits(draft: Eagle3Draft, aux_SKD, ids_S, num_steps: int, before=None) -> dict[tuple[int, int], torch.Tensor]:
    """TTT draft logits of one sample, {(t, i): logits_W}, for every row trained at step i (loss
    mask all ones: every t with t + 2 + i inside the sample). `before` = (aux, ids) of another sample
    packed in front of it, so positions restart and the per-sample mask is exercised."""
    s = ids_S.numel()
    smp = dict(input_ids=ids_S, loss_mask=torch.ones(s, dtype=torch.long), aux=aux_SKD,
               final=aux_SKD[:, 0], id="main", index=1)
    samples, offset = [smp], 0
    if before is not None:
        b_aux, b_ids = before
        offset = b_ids.numel()
        samples.insert(0, dict(input_ids=b_ids, loss_mask=torch.ones(offset, dtype=torch.long), aux=b_aux,
                               final=b_aux[:, 0], id="before", index=0))
    batch = pack(samples, num_steps, max_tokens=10_000, pad_multiple=8)
    masks = sdpa_masks(batch.doc_BS, num_steps, batch.pos_BS, draft.config.sliding_window)
    with torch.no_grad():
        logits_T = TTTDraft(draft)(batch.aux_BSKD, batch.input_ids_BS, batch.pos_BS, masks, batch.rows_T)
    out = {}
    for i, (rows_M, logits_MW) in enumerate(zip(batch.rows_T, logits_T)):
        for r, lg in zip(rows_M.tolist(), logits_MW):
            if r >= offset:
                out[(r - offset, i)] = lg
    return out
