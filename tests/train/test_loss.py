"""eyas.train.loss: the teacher, the soft / top-1 cross-entropy and the alignment mask on a
hand-built example and against per-row loops; the compiled kernel against eager."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.train.loss import acceptance_length, step_terms, teacher_targets, weighted_loss


def test_loss_on_a_hand_built_example():
    # V = 6 target tokens, draft vocab = target ids [1, 3, 4]; final rows are one-hot, so the
    # target's logits of row j are column j of the LM head.
    logits_VN = torch.tensor([[0, 3, 0], [2, 0, 0], [1, 0, 0], [1, 1, 1], [0.5, 2, 4], [-1, 0, 0]], dtype=torch.float64)
    t2d = torch.tensor([False, True, False, True, True, False])
    from eyas.vocab import target_to_draft

    p, top1 = teacher_targets(torch.eye(3, dtype=torch.float64), logits_VN, torch.tensor([1, 3, 4]),
                              target_to_draft(torch.arange(6), t2d), chunk=2)
    assert top1.tolist() == [0, -1, 2]  # row 1's top-1 is target token 0: outside the draft vocab

    def softmax(z):
        e = [math.exp(x) for x in z]
        return [x / sum(e) for x in e]

    teacher = [softmax([2, 1, 0.5]), softmax([0, 1, 2]), softmax([0, 1, 4])]
    torch.testing.assert_close(p, torch.tensor(teacher, dtype=torch.float32))

    def ce(z, q):  # -sum_w q_w log softmax(z)_w
        lse = math.log(sum(math.exp(x) for x in z))
        return -sum(qi * (zi - lse) for zi, qi in zip(z, q))

    z0 = [[1.0, 0, 0], [0, 0, 1.0], [0, 0, 3.0]]  # step 0 drafts rows 0, 1, 2
    z1 = [[0, 2.0, 0]]  # step 1 drafts row 2 only
    rows = [torch.tensor([0, 1, 2]), torch.tensor([2])]  # the flat rows, here equal to their teacher rows
    loss_sum, correct, valid, reached, chain, _ = step_terms([torch.tensor(z0), torch.tensor(z1)], p, top1, rows, rows, 3)
    want0 = ce(z0[0], teacher[0]) + ce(z0[2], teacher[2])  # row 1 is not valid
    want1 = ce(z1[0], teacher[2])
    torch.testing.assert_close(loss_sum, torch.tensor([want0, want1]))
    assert correct.tolist() == [2, 0] and valid.tolist() == [2, 1]
    assert chain.tolist() == [2, 0]  # rows 0 and 2 accepted at step 0; row 2's step 1 drafts 1, not 2
    assert reached.tolist() == [3, 1]  # every row reaches step 0; of rows 0 and 2, only row 2 has a step 1
    loss = weighted_loss(loss_sum, torch.tensor([4, 1]), torch.tensor([1.0, 0.8]))
    assert loss.item() == pytest.approx(want0 / 4 + 0.8 * want1, rel=1e-6)

    # train.top1_weight w: (1 - w) x the soft cross-entropy + w x -log softmax(z)[teacher top-1]
    def nll(z, k):
        return math.log(sum(math.exp(x) for x in z)) - z[k]

    for w in (0.25, 1.0):
        l0, l1 = torch.tensor(z0, requires_grad=True), torch.tensor(z1, requires_grad=True)
        mixed, correct, valid, _, _, _ = step_terms([l0, l1], p, top1, rows, rows, 3, top1_weight=w)
        hard0 = nll(z0[0], 0) + nll(z0[2], 2)  # top-1 draft ids of rows 0 and 2; row 1 still not valid
        hard1 = nll(z1[0], 2)
        torch.testing.assert_close(mixed.detach(), torch.tensor([(1 - w) * want0 + w * hard0, (1 - w) * want1 + w * hard1]))
        assert correct.tolist() == [2, 0] and valid.tolist() == [2, 1]
        # d/dz of each valid row: (1 - w)(softmax(z) - teacher) + w(softmax(z) - onehot(top-1)); row 1: 0
        mixed.sum().backward()
        def grad(z, row, k):
            q = torch.tensor(softmax(z))
            return (1 - w) * (q - torch.tensor(teacher[row])) + w * (q - torch.eye(3)[k])

        torch.testing.assert_close(l0.grad, torch.stack([grad(z0[0], 0, 0), torch.zeros(3), grad(z0[2], 2, 2)]))
        torch.testing.assert_close(l1.grad, grad(z1[0], 2, 2)[None])


@pytest.mark.parametrize("k", [0, 1, 3])
def test_chain_counts_and_align_mask_match_a_per_row_loop(k):
    # Random steps over 40 flat rows, each step training its own subset (rows drop in and out as
    # loss masks do), draft logits near the teacher so that about half the top-1s agree.
    g = torch.Generator().manual_seed(k)
    num_rows, num_teacher, w, steps = 40, 30, 6, 4
    p = torch.softmax(torch.randn(num_teacher, w, generator=g) * 2, -1)
    top1 = p.argmax(-1)
    top1[torch.randperm(num_teacher, generator=g)[:4]] = -1  # outside the draft vocab
    rows_T = [torch.randperm(num_rows, generator=g)[:30].sort().values for _ in range(steps)]
    tix_T = [torch.randint(num_teacher, (30,), generator=g) for _ in range(steps)]
    logits_T = [p[t].log() + torch.randn(30, w, generator=g) for t in tix_T]
    loss, correct, valid, reached, chain, kept = step_terms(logits_T, p, top1, tix_T, rows_T, num_rows, align_top_k=k)

    def at(i, r):  # -> (logits, teacher row) of flat row r at step i, or None if step i skips it
        hits = (rows_T[i] == r).nonzero()
        return (logits_T[i][hits[0, 0]], int(tix_T[i][hits[0, 0]])) if len(hits) else None

    def agrees(i, r, top_k):
        got = at(i, r)
        return got is not None and int(top1[got[1]]) >= 0 and int(top1[got[1]]) in got[0].topk(top_k).indices.tolist()

    for i in range(steps):
        want_loss, want_chain, want_reached, want_kept = 0.0, 0, 0, 0
        for r in rows_T[i].tolist():
            z, t = at(i, r)
            trained = int(top1[t]) >= 0 and (k == 0 or all(agrees(j, r, k) for j in range(i)))
            if trained:
                want_loss += float(-(p[t] * torch.log_softmax(z, -1)).sum())
                want_kept += 1
            want_reached += all(agrees(j, r, 1) for j in range(i))
            want_chain += all(agrees(j, r, 1) for j in range(i + 1))
        assert loss[i].item() == pytest.approx(want_loss, rel=1e-5)
        assert int(chain[i]) == want_chain and int(reached[i]) == want_reached and int(kept[i]) == want_kept
    assert 0 < int(chain[-1]) < int(chain[0]) == int(correct[0]) < len(rows_T[0])  # both branches run
    assert any(int(reached[i]) < int(chain[i - 1]) for i in range(1, steps))  # alive rows with no next step
    assert valid.tolist() == [int((top1[t] >= 0).sum()) for t in tix_T]
    assert (kept == valid).all() if k == 0 else (kept[1:] < valid[1:]).all()


@pytest.mark.parametrize("top1_weight,k,dtype,loss", [(0.0, 0, torch.float32, "kl"), (0.5, 3, torch.bfloat16, "kl"),
                                                      (1.0, 1, torch.float32, "kl"), (0.0, 0, torch.float32, "tv"),
                                                      (0.5, 3, torch.bfloat16, "lk")])
def test_compiled_loss_kernel_equals_eager(top1_weight, k, dtype, loss):
    """train.loss_kernel=compiled (row_terms under torch.compile, dynamic row counts) gives the eager
    loss sums, counts and logits gradients, on steps of different row counts and with bf16 logits
    (read in float32 either way), for the soft (each train.loss), mixed and top-1 losses and the
    align mask."""
    g = torch.Generator().manual_seed(7)
    num_rows, num_teacher, w = 50, 40, 300
    p = torch.softmax(torch.randn(num_teacher, w, generator=g) * 3, -1)
    p[::4, :20] = 0.0  # underflowed teacher probabilities
    p /= p.sum(-1, keepdim=True)
    top1 = p.argmax(-1)
    top1[torch.randperm(num_teacher, generator=g)[:5]] = -1
    sizes = [37, 29, 41, 33]  # a new row count per step: compiled once with dynamic shapes
    rows_T = [torch.randperm(num_rows, generator=g)[:m].sort().values for m in sizes]
    tix_T = [torch.randint(num_teacher, (m,), generator=g) for m in sizes]
    base_T = [((p[t] + 1e-6).log() + torch.randn(len(t), w, generator=g)).to(dtype) for t in tix_T]
    out, grads = {}, {}
    for compiled in (False, True):
        logits_T = [z.clone().requires_grad_() for z in base_T]
        terms = step_terms(logits_T, p, top1, tix_T, rows_T, num_rows, top1_weight, k, compiled, loss)
        (terms[0] * torch.tensor([1.0, 0.8, 0.64, 0.512])).sum().backward()
        out[compiled], grads[compiled] = terms, [z.grad for z in logits_T]
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-4)
    assert out[False][0].min() > 1  # every step trains rows
    for a, b in zip(out[True][1:], out[False][1:]):
        assert torch.equal(a, b)
    assert 0 < int(out[True][4][-1]) < int(out[True][1][0])  # chains both survive and die
    for a, b in zip(grads[True], grads[False]):
        assert a.dtype == dtype and a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6) if dtype == torch.float32 else \
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-4)


def naive_soft(z, p, loss):
    """-> (value, d value / d z) of one position's train.loss from the definitions, in Python floats:
    q = softmax(z); kl = -sum p log q; tv = 0.5 sum |p - q|; lk = -log alpha, alpha = sum min(p, q).
    The gradients are derived by hand: d q_w / d z_j = q_w (1[w = j] - q_j), and alpha's derivative
    runs through the tokens where q < p (S): d alpha / d z_j = q_j 1[j in S] - q_j sum_S q."""
    top = max(z)
    e = [math.exp(x - top) for x in z]
    q = [x / sum(e) for x in e]
    if loss == "kl":
        return -sum(pw * math.log(qw) for pw, qw in zip(p, q)), [qw - pw for pw, qw in zip(p, q)]
    alpha = sum(min(pw, qw) for pw, qw in zip(p, q))
    in_s = [qw < pw for pw, qw in zip(p, q)]
    q_s = sum(qw for qw, s in zip(q, in_s) if s)
    dalpha = [qj * (1.0 if s else 0.0) - qj * q_s for qj, s in zip(q, in_s)]
    if loss == "tv":
        return 0.5 * sum(abs(pw - qw) for pw, qw in zip(p, q)), [-d for d in dalpha]
    return -math.log(alpha), [-d / alpha for d in dalpha]


@pytest.mark.parametrize("loss,top1_weight", [("kl", 0.0), ("tv", 0.0), ("lk", 0.0), ("tv", 0.5), ("lk", 0.25)])
def test_each_loss_and_its_gradient_match_a_per_position_loop(loss, top1_weight):
    """train.loss's value summed over the valid positions and its logits gradient, against the
    definitions evaluated position by position in float64 (`naive_soft`), mixed with the top-1
    cross-entropy by train.top1_weight; rows include a teacher with exact zeros (underflowed p) and
    a draft far from its teacher (alpha ~ 1e-9, where a clamp at 1e-5 would stop lk's gradient)."""
    g = torch.Generator().manual_seed(3)
    n, w = 12, 9
    p = torch.softmax(torch.randn(n, w, generator=g) * 3, -1)
    p[0] = torch.softmax(torch.tensor([0.0, 1.0, -200.0, 2.0, -300.0, 0.5, 0.0, -1.0, 1.0]), -1)  # two exact zeros
    top1 = p.argmax(-1)
    top1[5] = -1  # outside the draft vocab: not trained
    z = torch.randn(n, w, generator=g) * 2
    z[1] = 0.0
    z[1, (int(top1[1]) + 1) % w] = 25.0  # q puts ~1e-11 on every other token
    p[1] = torch.full((w,), 1e-9 / (w - 1))
    p[1, int(top1[1])] = 1 - 1e-9
    p[1, (int(top1[1]) + 1) % w] = 0.0
    p[1] /= p[1].sum()
    assert (p[0] == 0).sum() == 2
    logits = z.clone().requires_grad_()
    rows = torch.arange(n)
    loss_sum, *_ = step_terms([logits], p, top1, [rows], [rows], n, top1_weight=top1_weight, loss=loss)
    loss_sum.sum().backward()

    want, want_grad = 0.0, []
    for r in range(n):
        zr, pr, k = z[r].double().tolist(), p[r].double().tolist(), int(top1[r])
        if k < 0:
            want_grad.append([0.0] * w)
            continue
        value, grad = naive_soft(zr, pr, loss)
        lse = math.log(sum(math.exp(x) for x in zr))
        q = [math.exp(x - lse) for x in zr]
        want += (1 - top1_weight) * value + top1_weight * (lse - zr[k])
        want_grad.append([(1 - top1_weight) * gj + top1_weight * (qj - (j == k)) for j, (gj, qj) in enumerate(zip(grad, q))])
    assert loss_sum.item() == pytest.approx(want, rel=1e-5)
    torch.testing.assert_close(logits.grad.double(), torch.tensor(want_grad, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    if loss == "lk":  # the far draft's alpha ~ 1e-9: its loss ~ 20.7 and its gradient alive
        far, grad_far = naive_soft(z[1].double().tolist(), p[1].double().tolist(), "lk")
        assert far > 15 and logits.grad[1].abs().sum() > 0.5 * (1 - top1_weight)


@pytest.mark.parametrize("loss", ["kl", "tv", "lk"])
def test_losses_agree_where_they_must(loss):
    """A draft equal to its teacher has tv = lk = 0 and kl = the teacher's entropy (tv and lk have a
    kink there, so no gradient is asserted); lk equals the top-1 cross-entropy against a one-hot
    teacher."""
    p = torch.softmax(torch.tensor([[1.0, 2.0, 0.5, -1.0]]), -1)
    z = p.log()
    rows = torch.arange(1)
    got, *_ = step_terms([z], p, p.argmax(-1), [rows], [rows], 1, loss=loss)
    if loss == "kl":
        assert got.item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-6)
    else:
        assert abs(got.item()) < 1e-6
    one_hot = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    z2 = torch.tensor([[0.3, -0.2, 1.1, 0.0]])
    lk, *_ = step_terms([z2], one_hot, torch.tensor([1]), [rows], [rows], 1, loss="lk")
    assert lk.item() == pytest.approx(-torch.log_softmax(z2, -1)[0, 1].item(), rel=1e-6)


def test_lk_of_an_alpha_that_underflows_float32_is_finite():
    """A draft whose every token the teacher gives 0 where the draft gives mass, and the other way
    round (alpha underflows float32): lk is -log of the smallest normal float32, its gradient 0, not inf
    or nan."""
    p = torch.tensor([[1.0, 0.0, 0.0]])
    z = torch.tensor([[-200.0, 0.0, 0.0]], requires_grad=True)
    rows = torch.arange(1)
    got, *_ = step_terms([z], p, torch.tensor([0]), [rows], [rows], 1, loss="lk")
    got.sum().backward()
    assert got.item() == pytest.approx(-math.log(torch.finfo(torch.float32).tiny), rel=1e-6)
    assert torch.isfinite(z.grad).all()


def test_an_unknown_loss_is_refused_naming_the_choices():
    from eyas.config import load_config
    from eyas.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.loss='js'.*kl, tv, lk"):
        load_config(None, ["--train.loss=js"])


def test_acceptance_length():
    assert acceptance_length([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert acceptance_length([0.0, 1.0]) == 1.0
    assert acceptance_length([1.0] * 7) == 8.0
