"""The reference soft cross-entropy against the formula in float64, masking, and the TTT alignment."""

from types import SimpleNamespace

import pytest
import torch

from eagleforge.kernels.soft_ce import teacher_logsumexp
from eagleforge.train.loss import get_loss_fn, soft_cross_entropy, soft_cross_entropy_ttt


def _formula(draft_hidden, draft_head, teacher_hidden, teacher_head, weight):
    """sum_n w_n * -sum_v softmax(teacher)_v * log_softmax(draft)_v, all in float64, explicit."""
    z = draft_hidden.double() @ draft_head.double().T
    u = teacher_hidden.double() @ teacher_head.double().T
    p = torch.exp(u) / torch.exp(u).sum(-1, keepdim=True)
    log_q = z - torch.log(torch.exp(z).sum(-1, keepdim=True))
    return (weight.double() * -(p * log_q).sum(-1)).sum(), z.argmax(-1)


def _inputs(n, h, vd, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    draft_hidden = (torch.randn(n, h, generator=g) * scale).requires_grad_()
    draft_head = (torch.randn(vd, h, generator=g) / h**0.5).requires_grad_()
    teacher_hidden = torch.randn(n, h, generator=g) * 2
    teacher_head = torch.randn(vd, h, generator=g) / h**0.5
    weight = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.3)
    return draft_hidden, draft_head, teacher_hidden, teacher_head, weight


@pytest.mark.parametrize("n,h,vd,chunk", [(37, 24, 211, 1024), (53, 16, 97, 8), (1, 8, 3, 1024)])
def test_loss_and_grads_match_formula(n, h, vd, chunk):
    dh, dw, th, tw, w = _inputs(n, h, vd, seed=n * 7 + vd)
    lse = teacher_logsumexp(th, tw, chunk_tokens=chunk)  # several chunks and a ragged last one
    assert lse.dtype == torch.float32 and lse.shape == (n,)
    torch.testing.assert_close(lse.double(), torch.logsumexp(th.double() @ tw.double().T, -1), rtol=1e-5, atol=1e-5)

    loss, argmax = soft_cross_entropy(dh, dw, th, tw, lse, w)
    upstream = torch.rand(()) + 0.5  # a non-unit upstream gradient
    (loss * upstream).backward()
    grads = dh.grad.clone(), dw.grad.clone()

    dh64 = dh.detach().double().requires_grad_()
    dw64 = dw.detach().double().requires_grad_()
    ref, ref_argmax = _formula(dh64, dw64, th, tw, w)
    (ref * upstream.double()).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(grads[0].double(), dh64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1].double(), dw64.grad, rtol=1e-4, atol=1e-5)
    assert torch.equal(argmax, ref_argmax)


def test_masked_positions_contribute_nothing():
    dh, dw, th, tw, _ = _inputs(29, 16, 61, seed=3)
    w = torch.rand(29) + 0.1
    masked = torch.tensor([0, 5, 6, 17, 28])
    w[masked] = 0
    lse = teacher_logsumexp(th, tw)

    def change(dh2, th2, lse2):  # everything at the masked rows: draft input, teacher input, teacher lse
        dh2[masked] = torch.randn(len(masked), 16) * 10
        th2[masked] = torch.randn(len(masked), 16) * 10
        lse2[masked] = torch.randn(len(masked)) * 100

    check_masked_rows_change_nothing(soft_cross_entropy, (dh, dw, th, tw, lse, w), masked, change)


def check_masked_rows_change_nothing(loss_fn, inputs, masked, change) -> None:
    """loss_fn on inputs (draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse,
    weight), then on copies whose draft input, teacher input and teacher lse `change(dh2, th2,
    lse2)` alters in place at the masked rows (weight 0 there): the same loss, zero gradient at
    those rows, the same gradients elsewhere."""
    dh, dw, th, tw, lse, w = inputs
    loss_a, _ = loss_fn(dh, dw, th, tw, lse, w)
    loss_a.backward()
    ga = dh.grad.clone(), dw.grad.clone()
    dh2, th2, lse2 = dh.detach().clone(), th.clone(), lse.clone()
    change(dh2, th2, lse2)
    dh2.requires_grad_()
    dw2 = dw.detach().clone().requires_grad_()
    loss_b, _ = loss_fn(dh2, dw2, th2, tw, lse2, w)
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    assert torch.all(dh2.grad[masked] == 0)
    keep = torch.ones(w.shape[0], dtype=torch.bool)
    keep[masked] = False
    torch.testing.assert_close(ga[0][keep], dh2.grad[keep], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ga[1], dw2.grad, rtol=1e-5, atol=1e-7)


def test_all_masked_and_no_grad_paths():
    dh, dw, th, tw, _ = _inputs(11, 8, 13, seed=5)
    lse = teacher_logsumexp(th, tw)
    loss, _ = soft_cross_entropy(dh, dw, th, tw, lse, torch.zeros(11))
    loss.backward()
    assert loss.item() == 0 and torch.all(dh.grad == 0) and torch.all(dw.grad == 0)
    w = torch.rand(11)
    with torch.no_grad():
        loss_ng, arg_ng = soft_cross_entropy(dh, dw, th, tw, lse, w)
    ref, ref_arg = _formula(dh.detach(), dw.detach(), th, tw, w)
    torch.testing.assert_close(loss_ng.double(), ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(arg_ng, ref_arg)


def test_bf16_inputs_give_grads_in_their_dtype():
    dh, dw, th, tw, w = _inputs(19, 16, 31, seed=9)
    dh_bf = dh.detach().bfloat16().requires_grad_()
    lse = teacher_logsumexp(th.bfloat16().float(), tw)
    loss, _ = soft_cross_entropy(dh_bf, dw, th.bfloat16(), tw, lse, w)
    loss.backward()
    assert dh_bf.grad.dtype == torch.bfloat16 and dw.grad.dtype == torch.float32
    ref, _ = _formula(dh_bf.detach().float(), dw.detach(), th.bfloat16().float(), tw, w)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n,k,shift", [(23, 3, 1), (9, 5, 2)])
def test_ttt_form_is_each_step_against_the_shifted_teacher(n, k, shift):
    """soft_cross_entropy_ttt (the TTT reference of the kernels' tests and benchmarks): step j's
    row t against the teacher of row t + shift + j, rows past the end weighted 0."""
    _, dw, th, tw, _ = _inputs(n, 12, 37, seed=n + k)
    g = torch.Generator().manual_seed(k)
    hiddens = [torch.randn(n, 12, generator=g).requires_grad_() for _ in range(k)]
    weight = torch.rand(k, n, generator=g)
    for j in range(k):
        weight[j, max(0, n - shift - j):] = 0  # no teacher there
    loss, step_losses, argmax = soft_cross_entropy_ttt(hiddens, dw, th, tw, weight, teacher_shift=shift)
    for j in range(k):
        idx = (torch.arange(n) + shift + j).clamp(max=n - 1)
        ref, ref_arg = _formula(hiddens[j].detach(), dw.detach(), th[idx], tw, weight[j])
        torch.testing.assert_close(step_losses[j].double(), ref, rtol=2e-5, atol=2e-5)
        assert torch.equal(argmax[j], ref_arg)
    torch.testing.assert_close(loss, step_losses.sum())


def test_get_loss_fn_selection():
    assert get_loss_fn("reference", "cpu") is soft_cross_entropy
    assert get_loss_fn("auto", "cpu") is soft_cross_entropy  # the fused kernel is CUDA-only
    with pytest.raises(ValueError, match="train.loss"):
        get_loss_fn("nope", "cpu")


# ----------------------------------------------------------------------------- TTT alignment


def test_ttt_alignment_hand_made():
    """Step j, row t must be compared with the teacher at t+1+j and masked by loss_mask[t+2+j].

    The draft's hidden at (j, t) is built to be the one-hot of a code c(t + 1 + j); the teacher
    state at position s is a (very peaked) one-hot of c(s). With draft and teacher heads both the
    identity, only the correctly aligned comparison gives ~zero loss and full accuracy; any
    off-by-one gives a loss of ~log(Vd) per row.
    """
    from eagleforge.train.ttt_loss import ttt_loss, ttt_step_rows

    torch.manual_seed(0)
    b, t_len, vd, steps = 2, 9, 16, 3
    code = torch.randperm(vd)[: t_len + 1]  # distinct codes per position
    sharp = 60.0
    eye = torch.eye(vd)
    last_hidden = torch.stack([eye[code[:t_len]] * sharp] * b)  # [B, T, Vd]: teacher at s = code[s]
    loss_mask = torch.zeros(b, t_len, dtype=torch.bool)
    loss_mask[0, 3:] = True
    loss_mask[1, 5:8] = True
    # target_argmax[s] = the target id of the token the teacher at s predicts; with d2t = 0 it is code[s]
    target_argmax = code[:t_len].repeat(b, 1)
    t2d = torch.ones(vd, dtype=torch.bool)
    d2t = torch.zeros(vd, dtype=torch.int64)

    hiddens = []
    for j in range(steps):
        pos = (torch.arange(t_len) + 1 + j).clamp(max=t_len)  # teacher position of row t
        hiddens.append(torch.stack([eye[code[pos]] * sharp] * b).requires_grad_())
    teacher_lse = teacher_logsumexp(last_hidden.reshape(-1, vd), eye)
    loss, stats = ttt_loss(hiddens, eye, last_hidden, eye, teacher_lse, loss_mask, target_argmax, t2d, d2t, 0.8, soft_cross_entropy)
    assert loss.item() < 1e-6
    for j in range(steps):
        rows = ttt_step_rows(loss_mask, j)
        # rows are exactly the (b, t) with loss_mask[b, t+2+j] set
        expected = [bb * t_len + t for bb in range(b) for t in range(t_len - 2 - j) if loss_mask[bb, t + 2 + j]]
        assert rows.tolist() == expected
        assert stats.n_valid[j] == len(expected) and stats.n_correct[j] == len(expected)

    # Shift the draft by one position (an off-by-one): every loss-bearing row is wrong.
    shifted = [torch.roll(h.detach(), 1, dims=1) for h in hiddens]
    loss_bad, stats_bad = ttt_loss(shifted, eye, last_hidden, eye, teacher_lse, loss_mask, target_argmax, t2d, d2t, 0.8, soft_cross_entropy)
    assert loss_bad.item() > 10
    assert sum(stats_bad.n_correct) == 0

    # A mask one position off from t+2+j changes which rows count.
    rows_if_t1j = [bb * t_len + t for bb in range(b) for t in range(t_len - 1) if loss_mask[bb, t + 1]]
    assert ttt_step_rows(loss_mask, 0).tolist() != rows_if_t1j


def random_ttt_batch(gen: torch.Generator) -> SimpleNamespace:
    """One batch's TTT loss inputs, random from `gen` (B 2, T 13, H 24, V 97, Vd 41, K 4): a
    ragged loss mask, some target tokens outside the draft vocabulary, and `base`, the K steps'
    normed hidden states [B, T, H]."""
    b = SimpleNamespace(batch=2, length=13, hidden=24, vocab=97, draft_vocab=41, steps=4)
    used = torch.randperm(b.vocab, generator=gen)[:b.draft_vocab].sort().values
    b.t2d = torch.zeros(b.vocab, dtype=torch.bool)
    b.t2d[used] = True
    b.d2t = used - torch.arange(b.draft_vocab)
    b.loss_mask = (torch.rand(b.batch, b.length, generator=gen) > 0.3).long()
    b.target_argmax = torch.randint(0, b.vocab, (b.batch, b.length), generator=gen)
    b.last_hidden = torch.randn(b.batch, b.length, b.hidden, generator=gen)
    b.teacher_head = torch.randn(b.draft_vocab, b.hidden, generator=gen) * 0.3
    b.base = [torch.randn(b.batch, b.length, b.hidden, generator=gen) for _ in range(b.steps)]
    return b


def run_ttt_loss(b: SimpleNamespace, head: torch.Tensor, shared: bool, loss_fn=soft_cross_entropy, **shared_options):
    """The TTT loss of `random_ttt_batch`'s batch with draft head `head` (a copy of it), step decay 0.8,
    fp32, backward included: the trainer's shared-teacher form (ttt_loss_shared, chunks of 7 rows,
    `shared_options`) or the per-step loop with `loss_fn` (ttt_loss) -> (loss, the steps' hidden
    gradients, the head's gradient, TTTStats)."""
    from eagleforge.train.ttt_loss import batch_teacher_lse, ttt_loss, ttt_loss_shared

    hiddens = [h.clone().requires_grad_(True) for h in b.base]
    head = head.clone().requires_grad_(True)
    if shared:
        loss, stats = ttt_loss_shared(hiddens, head, b.last_hidden, b.teacher_head, b.loss_mask, b.target_argmax,
                                      b.t2d, b.d2t, 0.8, torch.float32, chunk_tokens=7, **shared_options)
    else:
        lse = batch_teacher_lse(b.last_hidden, b.loss_mask, b.teacher_head)
        loss, stats = ttt_loss(hiddens, head, b.last_hidden, b.teacher_head, lse, b.loss_mask, b.target_argmax,
                               b.t2d, b.d2t, 0.8, loss_fn)
    loss.backward()
    return loss.detach(), [h.grad for h in hiddens], head.grad, stats


def test_shared_teacher_ttt_loss_equals_per_step_reference():
    """The trainer's TTT form (teacher logits once for all steps, eagleforge.kernels) gives the
    same loss, gradients and per-step stats as the per-step reference loop, in fp32, on random
    inputs with a ragged loss mask and some target tokens outside the draft vocabulary."""
    b = random_ttt_batch(torch.Generator().manual_seed(5))
    head = torch.randn(b.draft_vocab, b.hidden, generator=torch.Generator().manual_seed(9)) * 0.3

    loss_a, grads_a, head_a, stats_a = run_ttt_loss(b, head, shared=True)
    loss_b, grads_b, head_b, stats_b = run_ttt_loss(b, head, shared=False)
    assert stats_a._device_sums is not None  # kept on the device (no host sync) until read
    assert torch.allclose(loss_a, loss_b, rtol=1e-5), (loss_a, loss_b)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.allclose(ga, gb, atol=1e-6, rtol=1e-4)
    assert torch.allclose(head_a, head_b, atol=1e-6, rtol=1e-4)
    assert stats_a.n_valid == stats_b.n_valid and stats_a.n_correct == stats_b.n_correct
    assert stats_a.n_loss == stats_b.n_loss
    assert all(abs(a - b) < 1e-4 * max(1.0, abs(b)) for a, b in zip(stats_a.ce_sum, stats_b.ce_sum))


def test_ttt_stats_device_sums_merge_and_read_back_once():
    from eagleforge.train.metrics import TTTStats

    a = TTTStats(2, [1.0, 2.0], [3, 4], [1, 1], [5, 6], tokens=10)
    b = TTTStats(2, tokens=7)
    b.add_device_sums(torch.tensor([[0.5, 0.25], [2, 0], [1, 0], [3, 1]], dtype=torch.float64))
    a.merge(b)
    a.add_device_sums(torch.tensor([[1.0, 1.0], [1, 1], [0, 1], [1, 1]], dtype=torch.float64))
    assert a._device_sums is not None and a.tokens == 17
    assert a.n_loss == [6, 5] and a._device_sums is None  # the first read brings both sums back
    assert a.ce_sum == [2.5, 3.25] and a.n_correct == [2, 2] and a.n_valid == [9, 8]
    assert all(isinstance(x, int) for x in a.n_loss + a.n_correct + a.n_valid)

