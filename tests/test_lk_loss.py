"""The LK loss's plain-torch reference (eagleforge.train.loss.lk_loss) against the formula written
out here in float64 and by gradcheck, its limits, the TTT dispatch (train.loss=lk through the
shared-teacher kernel == lk_reference through the per-step loop), the trainer's options, the alpha
variant training through the TTT op, and a tiny real training run with train.loss=lk. The kernels
against this reference: tests/test_lk_kernels.py."""

from __future__ import annotations

import functools

import pytest
import torch
from test_loss import check_masked_rows_change_nothing, random_ttt_batch, run_ttt_loss
from test_vocab import build_tiny_run
from tiny_runs import train_variants

from eagleforge.config import load_config
from eagleforge.errors import ConfigError
from eagleforge.kernels.lk import ALPHA_FLOOR
from eagleforge.kernels.soft_ce import teacher_logsumexp
from eagleforge.train.loss import get_loss_fn, lk_loss, soft_cross_entropy

LAMBDA = dict(variant="lambda", kl_scale=0.8, kl_decay=2.5)
ALPHA = dict(variant="alpha")


def _inputs(n, h, vd, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    draft_hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    draft_head = (torch.randn(vd, h, generator=g, dtype=dtype) * 2 / h**0.5).requires_grad_()
    teacher_hidden = torch.randn(n, h, generator=g, dtype=dtype)
    teacher_head = torch.randn(vd, h, generator=g, dtype=dtype) * 2 / h**0.5
    weight = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.3)
    return draft_hidden, draft_head, teacher_hidden, teacher_head, weight


def _formula(draft_hidden, draft_head, teacher_hidden, teacher_head, weight, variant, kl_scale=1.0, kl_decay=3.0):
    """The LK loss written out in float64: explicit probabilities, torch.minimum, the step's
    weighted mean acceptance, and lam taken as a number (no gradient)."""
    z = draft_hidden.double() @ draft_head.double().T
    u = teacher_hidden.double() @ teacher_head.double().T
    p = torch.exp(u) / torch.exp(u).sum(-1, keepdim=True)
    q = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)
    alpha = torch.minimum(p, q).sum(-1)  # [N]
    w = weight.double()
    if variant == "alpha":
        return (w * -torch.log(alpha)).sum()
    mean_alpha = float((w * alpha).sum() / w.sum())
    lam = kl_scale * torch.exp(torch.tensor(-kl_decay * mean_alpha, dtype=torch.float64))
    ce = -(p * torch.log(q)).sum(-1)
    return lam * (w * ce).sum() + (1 - lam) * (w * (1 - alpha)).sum()


@pytest.mark.parametrize("options", [LAMBDA, ALPHA, dict(variant="lambda")], ids=["lambda", "alpha", "lambda_defaults"])
@pytest.mark.parametrize("n,h,vd", [(37, 24, 211), (1, 8, 3), (13, 5, 64)])
def test_reference_matches_the_formula(options, n, h, vd):
    """Loss and both gradients against `_formula` in float64 (fresh random inputs, masked rows,
    a non-unit upstream); the reference in fp32 and in fp64."""
    dh, dw, th, tw, w = _inputs(n, h, vd, seed=n * 31 + vd + len(options))
    w[0] = 0.7  # at least one weighted row
    upstream = torch.rand(()).item() + 0.5
    dh64, dw64 = (x.detach().double().requires_grad_() for x in (dh, dw))
    ref = _formula(dh64, dw64, th, tw, w, **options)
    (ref * upstream).backward()
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-10)):
        x_h, x_w = (x.detach().to(dtype).requires_grad_() for x in (dh, dw))
        t_h, t_w = th.to(dtype), tw.to(dtype)
        lse = torch.logsumexp(t_h @ t_w.T, -1)
        loss, argmax = lk_loss(x_h, x_w, t_h, t_w, lse, w, **options)
        (loss * upstream).backward()
        assert loss.dtype == dtype and loss.dim() == 0
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(x_h.grad.double(), dh64.grad, rtol=10 * tol, atol=tol)
        torch.testing.assert_close(x_w.grad.double(), dw64.grad, rtol=10 * tol, atol=tol)
        assert torch.equal(argmax, (dh.detach().double() @ dw.detach().double().T).argmax(-1))


@pytest.mark.parametrize("options", [ALPHA, dict(variant="lambda", kl_scale=0.6, kl_decay=0.0)], ids=["alpha", "lambda_fixed"])
def test_gradcheck_float64(options):
    """torch.autograd.gradcheck on tiny shapes: the reference's gradient is the derivative of its
    value (for lambda with kl_decay 0, where lam is a constant and the loss a plain function)."""
    dh, dw, th, tw, w = _inputs(5, 4, 7, seed=3, dtype=torch.float64)
    lse = torch.logsumexp(th @ tw.T, -1)
    assert torch.autograd.gradcheck(lambda a, b: lk_loss(a, b, th, tw, lse, w, **options)[0], (dh, dw))


def test_lambda_has_no_gradient_through_lam():
    """The lambda variant's lam is a constant of the gradient (SpecForge detaches it): the
    gradient equals that of the loss with lam fixed at its value, and differs from the
    derivative of the value itself (where lam moves with the acceptance)."""
    dh, dw, th, tw, w = _inputs(9, 6, 17, seed=11, dtype=torch.float64)
    lse = torch.logsumexp(th @ tw.T, -1)
    loss, _ = lk_loss(dh, dw, th, tw, lse, w, **LAMBDA)
    (ours,) = torch.autograd.grad(loss, dh)
    fixed = _formula(dh, dw, th, tw, w, **LAMBDA)  # lam a number there
    (want,) = torch.autograd.grad(fixed, dh)
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-12)
    eps = 1e-6
    d = torch.randn_like(dh)
    numeric = (lk_loss(dh + eps * d, dw, th, tw, lse, w, **LAMBDA)[0] - lk_loss(dh - eps * d, dw, th, tw, lse, w,
                                                                                 **LAMBDA)[0]) / (2 * eps)
    assert abs(numeric.item() - (ours * d).sum().item()) > 1e-4 * abs(numeric.item())


def test_limits():
    """A draft equal to its teacher accepts everything (alpha = 1): the alpha variant gives 0 and
    the lambda variant lam * CE with lam = kl_scale * e^-kl_decay; with a point-mass teacher the
    alpha variant is the cross-entropy (alpha = q of the target's token)."""
    _, _, th, tw, w = _inputs(11, 8, 23, seed=5)
    lse = teacher_logsumexp(th, tw)
    same_h, same_w = th.clone().requires_grad_(), tw.clone().requires_grad_()
    loss, _ = lk_loss(same_h, same_w, th, tw, lse, w, **ALPHA)
    assert abs(loss.item()) < 1e-5
    ce, _ = soft_cross_entropy(same_h, same_w, th, tw, lse, w)
    loss, _ = lk_loss(same_h, same_w, th, tw, lse, w, **LAMBDA)
    lam = LAMBDA["kl_scale"] * torch.exp(torch.tensor(-LAMBDA["kl_decay"]))
    torch.testing.assert_close(loss, lam * ce, rtol=1e-5, atol=1e-5)

    dh, dw, _, _, w = _inputs(11, 8, 23, seed=6)
    peaked = tw * 200  # softmax(teacher) one-hot to within e^-100
    lse = teacher_logsumexp(th, peaked)
    loss, _ = lk_loss(dh, dw, th, peaked, lse, w, **ALPHA)
    ce, _ = soft_cross_entropy(dh, dw, th, peaked, lse, w)
    torch.testing.assert_close(loss, ce, rtol=1e-5, atol=1e-5)


def test_alpha_floor_rows_are_constant_and_finite():
    """A row whose acceptance underflows to 0 (the draft certain of a token the target gives no
    mass, both beyond e^-103) costs -log ALPHA_FLOOR and no gradient, with no NaN anywhere."""
    vd = 5
    dh = torch.tensor([[200.0, 0, 0, 0, 0], [1.0, 2, 0, 0, 0]]).requires_grad_()
    th = torch.tensor([[0.0, 0, 0, 0, 200], [0.0, 0, 1, 0, 0]])
    eye = torch.eye(vd)
    head = eye.clone().requires_grad_()
    lse = torch.logsumexp(th, -1)
    loss, _ = lk_loss(dh, head, th, eye, lse, torch.ones(2), **ALPHA)
    loss.backward()
    q, p = torch.softmax(dh[1].detach(), -1), torch.softmax(th[1], -1)
    want = -torch.log(torch.tensor(ALPHA_FLOOR)) - torch.log(torch.minimum(p, q).sum())
    torch.testing.assert_close(loss, want)
    assert torch.isfinite(dh.grad).all() and torch.isfinite(head.grad).all()
    assert not dh.grad[0].any() and dh.grad[1].any()


@pytest.mark.parametrize("options", [LAMBDA, ALPHA], ids=["lambda", "alpha"])
def test_masked_rows_contribute_nothing(options):
    """Weight-0 rows, whatever their inputs (huge draft and teacher states, a NaN teacher lse),
    change neither the loss nor any gradient, nor the lambda variant's mean acceptance."""
    dh, dw, th, tw, _ = _inputs(29, 16, 61, seed=3)
    w = torch.rand(29) + 0.1
    masked = torch.tensor([0, 5, 6, 17, 28])
    w[masked] = 0
    lse = teacher_logsumexp(th, tw)

    def change(dh2, th2, lse2):
        dh2[masked] = torch.randn(len(masked), 16) * 50
        th2[masked] = torch.randn(len(masked), 16) * 50
        lse2[masked] = float("nan")

    check_masked_rows_change_nothing(functools.partial(lk_loss, **options), (dh, dw, th, tw, lse, w), masked, change)


def test_get_loss_fn_binds_the_options():
    dh, dw, th, tw, w = _inputs(7, 8, 19, seed=2)
    lse = teacher_logsumexp(th, tw)
    ref = lk_loss(dh, dw, th, tw, lse, w, **ALPHA)[0]
    for name in ("lk", "lk_reference"):
        fn = get_loss_fn(name, "cpu", ALPHA)
        torch.testing.assert_close(fn(dh, dw, th, tw, lse, w)[0], ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="'lk_reference'"):  # the message lists the modes
        get_loss_fn("lk_fused", "cpu")


# ------------------------------------------------------------------------------ the TTT dispatch


@pytest.mark.parametrize("options", [LAMBDA, ALPHA], ids=["lambda", "alpha"])
@pytest.mark.parametrize("packed", [False, True], ids=["perstep", "packed"])
def test_shared_teacher_ttt_lk_equals_per_step_reference(options, packed):
    """ttt_loss_shared with the LK options (train.loss=lk) == ttt_loss with the plain lk_loss
    (train.loss=lk_reference): loss, gradients and per-step stats, fp32, random inputs with a
    ragged loss mask and some target tokens outside the draft vocabulary (weight 0 there, still
    counted by the accuracy)."""
    from eagleforge.train.ttt_loss import ttt_loss_shared

    gen = torch.Generator().manual_seed(5 + packed)
    b = random_ttt_batch(gen)
    head0 = torch.randn(b.draft_vocab, b.hidden, generator=gen) * 0.3

    loss_a, grads_a, head_a, stats_a = run_ttt_loss(b, head0, shared=True, packed=packed, lk=options)
    loss_b, grads_b, head_b, stats_b = run_ttt_loss(b, head0, shared=False,
                                                    loss_fn=get_loss_fn("lk_reference", "cpu", options))
    assert torch.allclose(loss_a, loss_b, rtol=1e-5), (loss_a, loss_b)
    for ga, gb in zip(grads_a + [head_a], grads_b + [head_b]):
        assert torch.allclose(ga, gb, atol=1e-6, rtol=1e-4)
    assert stats_a.n_valid == stats_b.n_valid and stats_a.n_correct == stats_b.n_correct
    assert stats_a.n_loss == stats_b.n_loss and min(stats_a.n_loss) > 0
    assert all(abs(a - b) < 1e-4 * max(1.0, abs(b)) for a, b in zip(stats_a.ce_sum, stats_b.ce_sum))
    # and it is not the soft cross-entropy
    ce, _ = ttt_loss_shared([h.clone() for h in b.base], head0, b.last_hidden, b.teacher_head, b.loss_mask,
                            b.target_argmax, b.t2d, b.d2t, 0.8, torch.float32, chunk_tokens=7)
    assert abs(ce.item() - loss_a.item()) > 1e-3 * abs(ce.item())


# ------------------------------------------------------------------------------------ the config


def test_config_selects_the_lk_loss_with_the_trainers_options():
    """train.loss=lk selects the LK loss; the trainer's TTTLoss runs it with LK_OPTIONS, the lambda
    variant at scale 1.0 and decay 3.0 (SpecForge's and the paper's); the options' keys are gone
    (each one's removal is a one-line error saying so)."""
    from eagleforge.train.loop import ttt_loss_of
    from eagleforge.train.loss import LK_OPTIONS

    assert LK_OPTIONS == dict(variant="lambda", kl_scale=1.0, kl_decay=3.0)
    cfg = load_config(None, ["train.loss=lk"])
    assert cfg.train.loss == "lk"
    assert ttt_loss_of(cfg, torch.zeros(3, 2), torch.device("cpu"), "none", False).lk == LK_OPTIONS
    assert ttt_loss_of(load_config(None, []), torch.zeros(3, 2), torch.device("cpu"), "none", False).lk is None
    for override, words in (("train.lk_variant=alpha", "train.lk_variant was removed (train.loss=lk always trains the "
                                                       "lambda variant"),
                            ("train.lk_kl_scale=0.5", "train.lk_kl_scale was removed"),
                            ("train.lk_kl_decay=0", "train.lk_kl_decay was removed"),
                            ("train.loss=lk_fused", "'train.loss' must be one of")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_alpha_variant_trains_through_the_ttt_op():
    """The alpha variant (-log acceptance), called through the fused TTT op the trainer's loss
    runs (torch path on the CPU) with variant="alpha": Adam on the draft's hidden states and head
    lowers it, and raises every step's mean acceptance."""
    from eagleforge.kernels.lk import fused_lk_loss_ttt

    g = torch.Generator().manual_seed(4)
    steps, n, h, vd = 3, 24, 16, 40
    hiddens = [torch.randn(n, h, generator=g).requires_grad_() for _ in range(steps)]
    head = (torch.randn(vd, h, generator=g) / h**0.5).requires_grad_()
    teacher_hidden, teacher_head = torch.randn(n, h, generator=g), torch.randn(vd, h, generator=g) * 2 / h**0.5
    weight = torch.ones(steps, n)
    for j in range(steps):
        weight[j, n - 1 - j:] = 0  # rows past the teacher's end
    weight = weight / weight.sum(1, keepdim=True)

    def acceptance() -> list[float]:
        with torch.no_grad():
            p = torch.softmax(teacher_hidden @ teacher_head.T, -1)
            return [float((torch.minimum(torch.softmax(hd @ head.T, -1)[:n - 1 - j], p[1 + j:]).sum(-1)).mean())
                    for j, hd in enumerate(hiddens)]

    optimizer = torch.optim.Adam([*hiddens, head], lr=0.05)
    before, losses = acceptance(), []
    for _ in range(40):
        optimizer.zero_grad()
        loss, _, _ = fused_lk_loss_ttt(hiddens, head, teacher_hidden, teacher_head, weight, variant="alpha")
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    after = acceptance()
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(a > b for a, b in zip(after, before)), (before, after)


# ------------------------------------------------------------------------- a tiny training run


@pytest.mark.usefixtures("one_torch_thread")
def test_tiny_run_trains_with_lk(tmp_path, tiny_llama_config):
    """The real trainer on a tiny random Llama's shards with train.loss=lk (the fused form, torch
    path on the CPU) and lk_reference (plain torch, per step), fp32: the two log the same losses
    step for step, and the LK loss (the lambda variant: the mixed CE / 1 - acceptance) falls."""
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path / "base", tiny_llama_config, n_samples=14, with_argmax=True)
    cfg.vocab.draft_vocab_size = 60
    for key, value in dict(ttt_steps=3, batch_tokens=160, lr=3e-3, warmup_ratio=0.05, holdout_samples=2, log_every=1,
                           max_steps=14, save_every=100, bf16=False, device="cpu", loss_positions="all",
                           activation_checkpoint="none", attention="reference", compile=False).items():
        setattr(cfg.train, key, value)
    cfg.eval.k = 2
    vocab_main(cfg)
    losses = train_variants(cfg, cfg.run, tmp_path, {"lk": dict(loss="lk"), "lk_reference": dict(loss="lk_reference")})
    assert len(losses["lk"]) == len(losses["lk_reference"]) == 14
    assert losses["lk_reference"] == pytest.approx(losses["lk"], rel=1e-4), losses
    first, last = sum(losses["lk"][:3]) / 3, sum(losses["lk"][-3:]) / 3
    assert last < 0.8 * first, (first, last)
