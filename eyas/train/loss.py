"""Teacher distributions, the TTT loss and its metrics.

Legend: N rows needing a teacher, M selected rows of one TTT step, D target hidden, V target
vocab, W draft vocab, T TTT steps.

Teacher: the target's lm_head applied to its stored final hidden state (after the final norm), in
chunks of rows so the V-wide logits never exist for the whole batch; its top-1 over all V tokens
decides whether the position counts (top-1 inside the draft vocab); the logits of the W draft
tokens, softmaxed, are the target distribution over the draft vocab.

Loss of TTT step i: a soft loss of the draft's W-way distribution q against the teacher's p
(train.loss: kl = the soft cross-entropy -sum p log q, forward KL up to the teacher's entropy;
tv = 1 - alpha, the total variation 0.5 sum |p - q|; lk = -log alpha; alpha = sum min(p, q), the
chance that speculative sampling accepts the drafted token), mixed with the cross-entropy against
the teacher's top-1 by train.top1_weight w ((1 - w) x soft + w x top-1; w = 0: soft only), summed
over valid positions (loss mask 1 and teacher top-1 in the draft vocab), divided by the global
number of valid positions of step i (all micro-batches of the optimizer step, all ranks), weighted
by step_weight**i and summed over i.

Accuracy of step i: positions where the draft's top-1 is the teacher's top-1, over all positions
with loss mask 1 (a teacher top-1 outside the draft vocab is a miss the draft cannot avoid).
Simulated acceptance length: tau = 1 + sum_k prod_{i<=k} acc_i (chain acceptance under greedy
verification, the bonus token counted).

Chain counts: a row t is *alive* after step i when the draft's top-1 equalled the teacher's top-1
at every step 0..i of row t (each of them a trained position): the greedy chain drafted from t
would still be accepted there. chain_T[i] counts those rows, reached_T[i] the rows of step i alive
before it (a chain whose answer ends before step i is in neither); tau_chain_rows = 1 + sum_i
chain_T[i] / (rows at step 0) is the chain's acceptance length teacher-forced, averaged over every
start row (a chain that reaches the end of its answer stops there, as serving's does). A decoder's
tau (tokens / verify passes) is lower: its passes start only after a miss or a bonus token, so an
easy stretch counts once per pass, not once per row.
Both the chain and the mask compare with the teacher's top-1 while the next step reads the data's
token: they are the serving chain's where the data is the target's own greedy output (regenerated
answers), an approximation elsewhere.

With train.align_top_k = k > 0 the loss of step i keeps only rows alive under top-k (the
teacher's top-1 among the draft's k best at every earlier step; k = 1: the greedy chain), after
GRIFFIN's token-alignable training: a serving engine never drafts step i after a rejected step,
so those rows only spend the draft's capacity. The normaliser stays the count of valid rows of
step i, so a step's weight falls with its alive share, unless train.align_norm = kept: then each
micro-batch's step-i loss is rescaled by its valid / kept rows (GRIFFIN's trainer divides by the
kept rows), which keeps every step's weight at step_weight**i (exactly with one micro-batch on one
rank; with several, as a valid-weighted mean of their kept means).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def teacher_targets(
    final_ND: torch.Tensor,
    lm_head_VD: torch.Tensor,
    draft_ids_W: torch.Tensor,
    target_to_draft_V: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (p_NW float32 teacher distribution over the draft vocab, top1_N: the draft id of the
    target's top-1 token, -1 where that token is outside the draft vocab)."""
    n = final_ND.shape[0]
    p_NW = torch.empty(n, draft_ids_W.numel(), dtype=torch.float32, device=final_ND.device)
    top1_N = torch.empty(n, dtype=torch.long, device=final_ND.device)
    with torch.autocast(final_ND.device.type, enabled=False):
        for a in range(0, n, chunk):
            logits_cV = final_ND[a : a + chunk].to(lm_head_VD.dtype) @ lm_head_VD.T
            top1_N[a : a + chunk] = target_to_draft_V[logits_cV.argmax(-1)]
            p_NW[a : a + chunk] = torch.softmax(logits_cV.index_select(1, draft_ids_W).float(), dim=-1)
    return p_NW, top1_N


class Overlap(torch.autograd.Function):
    """Per row: tv = 1 - alpha or lk = -log alpha, alpha = sum_w min(p_w, q_w), q = softmax(z), with
    a hand-written backward that keeps only z, the teacher and per-row numbers and recomputes q:
    autograd through the W-wide ops kept several float32 rows x W tensors per TTT step. On the
    SmolLM2 benchmark step (H100) autograd took 64 GiB and 1.31x (tv) / 1.57x (lk) kl's step time;
    this backward 37 GiB (kl 49) and 1.27x for both, 1.06x under train.loss_kernel=compiled.

    S = the tokens where q < p (min takes q there): d alpha / d z_j = q_j 1[j in S] - q_j Q,
    Q = sum_S q, each term at most alpha (q_j <= Q <= alpha), so lk's gradient, divided by alpha,
    is bounded. lk floors alpha at the smallest normal float32 (~1.2e-38): the loss stays finite
    (<= 87.3) and only a position whose alpha underflows float32 loses its gradient."""

    @staticmethod
    def forward(ctx, z_MW, p_NW, tix_M, lk: bool):
        alpha_M = torch.minimum(torch.softmax(z_MW, dim=-1), p_NW[tix_M]).sum(-1)
        if lk:
            alpha_M = alpha_M.clamp(min=torch.finfo(alpha_M.dtype).tiny)
        ctx.save_for_backward(z_MW, p_NW, tix_M, alpha_M)
        ctx.lk = lk
        return -alpha_M.log() if lk else 1.0 - alpha_M

    @staticmethod
    def backward(ctx, g_M):
        z_MW, p_NW, tix_M, alpha_M = ctx.saved_tensors
        q_MW = torch.softmax(z_MW, dim=-1)
        on_s_MW = torch.where(q_MW < p_NW[tix_M], q_MW, 0.0)
        # -d alpha / d z = q Q - q 1[S]; tv's d loss = that, lk's = that / alpha
        coef_M1 = (g_M / alpha_M if ctx.lk else g_M)[:, None]
        return torch.addcmul(on_s_MW, q_MW, on_s_MW.sum(-1, keepdim=True), value=-1.0).mul_(-coef_M1), None, None, None


def soft_loss(z_MW: torch.Tensor, p_NW: torch.Tensor, tix_M: torch.Tensor, loss: str) -> torch.Tensor:
    """Per row: the train.loss between the teacher's p (row tix_M of p_NW) and the draft's
    q = softmax(z): kl the soft cross-entropy, tv and lk through `Overlap`."""
    if loss == "kl":
        return F.cross_entropy(z_MW, p_NW[tix_M], reduction="none")
    if loss in ("tv", "lk"):
        return Overlap.apply(z_MW, p_NW, tix_M, loss == "lk")
    raise ValueError(f"unknown train.loss {loss!r}")


def row_terms(
    logits_MW: torch.Tensor,
    p_NW: torch.Tensor,
    tix_M: torch.Tensor,
    top1_M: torch.Tensor,
    train_M: torch.Tensor,
    top1_weight: float,
    loss: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One TTT step's rows -> (the loss summed over the rows of train_M (with grad), hit_M: the
    draft's top-1 is the teacher's). The logits are read in float32 whatever their dtype; the
    teacher rows are gathered here, so a compiled form (`compiled_row_terms`) reads the logits and
    the teacher in one pass instead of materialising float32 copies of both. `loss` (train.loss) is
    a constant to torch.compile: one graph per loss kind, compiled once each."""
    z_MW = logits_MW.float()
    ce_M = soft_loss(z_MW, p_NW, tix_M, loss) if top1_weight < 1.0 else 0.0
    if top1_weight > 0.0:  # an invalid row's top-1 (-1) reads class 0, masked below
        hard_M = F.cross_entropy(z_MW, top1_M.clamp(min=0), reduction="none")
        ce_M = (1.0 - top1_weight) * ce_M + top1_weight * hard_M
    return torch.where(train_M, ce_M, 0.0).sum(), z_MW.detach().argmax(-1) == top1_M  # top1 -1 never matches


_compiled_row_terms = None


def compiled_row_terms():
    """`row_terms` under torch.compile (dynamic row counts; compiled once per process): on a GPU the
    W-wide float32 passes of the eager loss (cast, gather, log-softmax, its backward) are memory
    bound, and fused they read each step's logits a few times instead of a dozen (train.loss_kernel)."""
    global _compiled_row_terms
    if _compiled_row_terms is None:
        _compiled_row_terms = torch.compile(row_terms, dynamic=True)
    return _compiled_row_terms


def step_terms(
    logits_T: list[torch.Tensor],
    p_NW: torch.Tensor,
    top1_N: torch.Tensor,
    tix_T: list[torch.Tensor],
    rows_T: list[torch.Tensor],
    num_rows: int,
    top1_weight: float = 0.0,
    align_top_k: int = 0,
    compiled: bool = False,
    loss: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per TTT step over this micro-batch -> (loss_sum_T with grad, num_correct_T, num_valid_T,
    num_reached_T: rows of step i alive after the steps before it, num_chain_T: of them, alive
    after step i too, num_kept_T: the rows the loss sums over, num_valid_T without align_top_k).

    logits_T[i]: draft logits [M, W] of step i's selected rows; tix_T[i]: their teacher rows;
    rows_T[i]: the flat rows themselves (< num_rows), which tie a row's steps together;
    top1_weight: the top-1 cross-entropy's share of each position's loss (train.top1_weight);
    align_top_k: train.align_top_k (0 = every valid row trains); compiled: the row terms under
    torch.compile (`compiled_row_terms`); loss: train.loss (kl, tv or lk, `soft_loss`).
    """
    loss_sums, correct, valid, reached, chain, kept = [], [], [], [], [], []
    device = top1_N.device
    terms = compiled_row_terms() if compiled else row_terms
    alive_R = torch.ones(num_rows, dtype=torch.bool, device=device)  # greedy chain still accepted
    keep_R = torch.ones(num_rows, dtype=torch.bool, device=device)  # align_top_k's mask
    for logits_MW, tix_M, rows_M in zip(logits_T, tix_T, rows_T):
        top1_M = top1_N[tix_M]
        ok_M = top1_M >= 0
        train_M = ok_M & keep_R[rows_M] if align_top_k else ok_M
        loss_sum, hit_M = terms(logits_MW, p_NW, tix_M, top1_M, train_M, float(top1_weight), loss)
        loss_sums.append(loss_sum)
        correct.append(hit_M.sum())
        valid.append(ok_M.sum())
        kept.append(train_M.sum())
        before_M = alive_R[rows_M]
        reached.append(before_M.sum())
        alive_M = before_M & hit_M
        chain.append(alive_M.sum())
        alive_R = torch.zeros_like(alive_R).index_put_((rows_M,), alive_M)  # rows not trained here die
        if align_top_k:
            k = min(align_top_k, logits_MW.shape[-1])
            in_top_M = hit_M if k == 1 else (logits_MW.detach().topk(k, -1).indices == top1_M[:, None]).any(-1)
            keep_R = torch.zeros_like(keep_R).index_put_((rows_M,), keep_R[rows_M] & in_top_M)
    return (torch.stack(loss_sums), torch.stack(correct), torch.stack(valid), torch.stack(reached),
            torch.stack(chain), torch.stack(kept))


def step_weights(num_steps: int, gamma: float, device=None) -> torch.Tensor:
    return gamma ** torch.arange(num_steps, dtype=torch.float32, device=device)


def weighted_loss(loss_sum_T: torch.Tensor, num_valid_T: torch.Tensor, weights_T: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * loss_sum_i / max(num_valid_i, 1)."""
    return (weights_T * loss_sum_T / num_valid_T.clamp(min=1)).sum()


def chain_length(chain_T: list[float], num_rows: float) -> float:
    """tau_chain_rows = 1 + sum_i chain_T[i] / num_rows (num_rows: the rows of step 0)."""
    return 1.0 + sum(chain_T) / max(num_rows, 1)


def acceptance_length(acc_T: list[float]) -> float:
    """tau = 1 + sum_k prod_{i<=k} acc_i."""
    tau, run = 1.0, 1.0
    for a in acc_T:
        run *= a
        tau += run
    return tau
