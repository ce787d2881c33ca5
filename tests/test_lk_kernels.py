"""eagleforge.kernels.lk against the plain-torch reference eagleforge.train.loss.lk_loss (itself
checked against the explicit formula and by gradcheck in tests/test_lk_loss.py).

The torch path runs in-process; the Triton path runs the same tests in a subprocess under
TRITON_INTERPRET=1 on the CPU (as tests/test_kernels.py), and on CUDA in the tests marked gpu.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from test_kernels import (  # noqa: F401 - poisoned_empty: a fixture
    TOLERANCES,
    check_against_reference,
    check_argmax,
    check_bf16_at_scale,
    make_inputs,
    poisoned_empty,
    rel_err,
    run_interpreted,
)

from eagleforge.kernels import lk, row_triton, soft_ce
from eagleforge.train.loss import lk_loss, lk_loss_ttt

INNER = os.environ.get("EAGLEFORGE_TRITON_INNER") == "1"  # set by test_triton_interpreter's subprocess
BACKEND = "triton" if INNER else "torch"
VARIANTS = [dict(variant="lambda", kl_scale=0.9, kl_decay=3.0), dict(variant="alpha")]
VARIANT_IDS = ["lambda", "alpha"]
SHAPES = [(37, 72, 997), (5, 16, 33)]  # (N, H, Vd): odd N and H, Vd not a power of 2


def grid(gen, *shape, head=False):
    """Random values whose bf16 matmuls are exact: hidden entries in {-1, 0, 1}, head entries in
    multiples of 1/8 in [-1, 1], so a logit is a multiple of 1/8 and exact in bf16 while below 32
    (std ~3.5 at H = 72; `exact_logits` checks). With bf16 logits rounded, min(p, q) switches
    branch on the largest components (the TV gradient is discontinuous where q meets p, and the
    alpha variant scales a row by 1 / alpha): the fp32 and bf16 gradients of the same inputs
    differed by 5-38% while the kernel given the same bf16 logits was within 0.3% of the formula.
    On these inputs the bf16 tests check the kernel's bf16 loads, casts and stores, not rounding."""
    if head:
        return torch.randint(-8, 9, shape, generator=gen).float() / 8
    return torch.randint(-1, 2, shape, generator=gen).float()


def grid_inputs(n, h, vocab, seed):
    """make_inputs' tuple in bf16 with logits exact in bf16 (`grid`)."""
    gen = torch.Generator().manual_seed(seed)
    draft_hidden = grid(gen, n, h).bfloat16().requires_grad_()
    draft_head = grid(gen, vocab, h, head=True).bfloat16().requires_grad_()
    teacher_hidden, teacher_head = grid(gen, n, h).bfloat16(), grid(gen, vocab, h, head=True).bfloat16()
    weight = torch.rand(n, generator=gen)
    weight[torch.rand(n, generator=gen) < 0.3] = 0
    return draft_hidden, draft_head, teacher_hidden, teacher_head, weight


def exact_logits(hidden, head):
    assert torch.equal((hidden @ head.T).float(), hidden.float() @ head.float().T), "bf16 logits not exact"


def run_both(inputs, options, upstream, chunk, backend=BACKEND):
    """(fused loss, argmax, grad hidden, grad head), (reference loss, fp32 logits, grads)."""
    h, w_d, t, w_t, weight = inputs
    lse = soft_ce.teacher_logsumexp(t, w_t, chunk_tokens=chunk, backend=backend)
    loss, argmax = lk.fused_lk_loss(h, w_d, t, w_t, lse, weight, chunk_tokens=chunk, backend=backend, **options)
    (loss * upstream).backward()
    ours = (loss.detach(), argmax, h.grad.clone(), w_d.grad.clone())
    h.grad = w_d.grad = None
    ref_loss, _ = lk_loss(h, w_d, t, w_t, lse, weight, **options)
    (ref_loss * upstream).backward()
    ref = (ref_loss.detach(), (h.detach().float() @ w_d.detach().float().T), h.grad.clone(), w_d.grad.clone())
    h.grad = w_d.grad = None
    return ours, ref


@pytest.mark.parametrize("options", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("chunk", [10, 4096], ids=["chunk10", "onechunk"])
def test_loss_grads_argmax(options, dtype, shape, chunk):
    seed = sum(shape) * 11 + chunk + len(options)
    inputs = make_inputs(*shape, dtype, seed=seed) if dtype == torch.float32 else grid_inputs(*shape, seed=seed)
    if dtype == torch.bfloat16:
        exact_logits(inputs[0], inputs[1])
        exact_logits(inputs[2], inputs[3])
    check_against_reference(*run_both(inputs, options, upstream=1.3, chunk=chunk), dtype)


@pytest.mark.parametrize("kind", [lk.LINEAR, lk.LOG, lk.ACCEPT], ids=["linear", "log", "accept"])
@pytest.mark.parametrize("shared_teacher", [False, True], ids=["own_teacher", "teacher_index_psum"])
def test_row_pass_on_bf16_logits(kind, shared_teacher):
    """The row pass alone on bf16 logits (the trainer's GPU dtype), against the formula of
    eagleforge.kernels.lk evaluated in float64 on the same logits: loss rows, argmax, and G
    written over the logits in bf16. Random row weights (c_ce, c_acc), some rows all zero; with
    a teacher index and given S, as the packed TTT form calls it."""
    gen = torch.Generator().manual_seed(kind * 2 + shared_teacher)
    rows, vocab = 29, 1031
    z = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16()
    t = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16()
    weight = torch.rand(rows, 2, generator=gen)
    weight[::4] = 0
    index = torch.randperm(rows, generator=gen).to(torch.int32) if shared_teacher else None
    lse = torch.logsumexp(t.float(), -1)
    psum = torch.exp(t.float() - lse[:, None]).sum(-1) if shared_teacher else None
    grad = z.clone()
    loss_rows, argmax = lk.lk_rows_fn(BACKEND, kind)(grad, t, lse, weight, index, teacher_psum=psum)

    u = t.double()[index.long()] if shared_teacher else t.double()
    p = torch.exp(u - lse.double()[index.long() if shared_teacher else slice(None)][:, None])
    zz = z.double().requires_grad_()
    q = torch.softmax(zz, -1)
    alpha = torch.where(q < p, q, p).sum(-1)
    c_ce, c_acc = weight.double().unbind(-1)
    if kind == lk.ACCEPT:
        want = c_acc * alpha
    else:
        acc_term = 1 - alpha if kind == lk.LINEAR else -torch.log(alpha)
        want = c_ce * -(p * torch.log_softmax(zz, -1)).sum(-1) + c_acc * acc_term
    want.sum().backward()
    torch.testing.assert_close(loss_rows.double(), want.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(argmax, z.float().argmax(-1))
    if kind == lk.ACCEPT:
        assert torch.equal(grad, z)  # the first pass leaves the logits as they are
    else:
        assert rel_err(grad, zz.grad) < 1e-2, rel_err(grad, zz.grad)
        assert not grad[::4].any()


@pytest.mark.parametrize("options", VARIANTS, ids=VARIANT_IDS)
def test_masked_rows_with_nonfinite_teacher_are_ignored_and_no_grad_path(options):
    """A weight-0 row whose teacher lse is inf/nan must not poison the loss, nor enter the lambda
    variant's mean acceptance; without gradients the numbers are the same."""
    h, w_d, t, w_t, weight = make_inputs(37, 72, 997, torch.float32, seed=7)
    weight[[2, 9]] = 0
    lse = soft_ce.teacher_logsumexp(t, w_t, backend=BACKEND)
    bad = lse.clone()
    bad[2], bad[9] = float("-inf"), float("nan")
    loss, _ = lk.fused_lk_loss(h, w_d, t, w_t, bad, weight, chunk_tokens=10, backend=BACKEND, **options)
    loss.backward()
    ref_loss, _ = lk_loss(h, w_d, t, w_t, lse, weight, **options)
    assert torch.isfinite(h.grad).all() and torch.isfinite(w_d.grad).all()
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    assert torch.count_nonzero(h.grad[[2, 9]]) == 0
    with torch.no_grad():
        loss_ng, _ = lk.fused_lk_loss(h, w_d, t, w_t, bad, weight, chunk_tokens=10, backend=BACKEND, **options)
    assert torch.equal(loss_ng, loss.detach())


@pytest.mark.parametrize("options", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [6, 13], ids=["chunk6", "chunk13"])
@pytest.mark.parametrize("packed", [False, True], ids=["perstep", "packed"])
def test_ttt_shared_teacher(options, dtype, chunk, packed, poisoned_empty):  # noqa: F811 - the fixture
    """All steps at once == the reference's K shifted steps (each with its own lam), loss, step
    losses, gradients and argmax; per step and packed (chunk 6: one teacher row per packed chunk
    of 4 steps; 13: spans cut at odd places). Gradients are allocated empty and NaN-poisoned."""
    n, hid, vocab, k_steps, shift = 31, 24, 333, 4, 1
    gen = torch.Generator().manual_seed(19 + chunk + packed)
    if dtype == torch.float32:
        scale = 3 * hid ** -0.5
        hiddens = [torch.randn(n, hid, generator=gen).requires_grad_() for _ in range(k_steps)]
        w_d = (torch.randn(vocab, hid, generator=gen) * scale).requires_grad_()
        t, w_t = torch.randn(n, hid, generator=gen), torch.randn(vocab, hid, generator=gen) * scale
    else:  # logits exact in bf16 (grid)
        hiddens = [grid(gen, n, hid).bfloat16().requires_grad_() for _ in range(k_steps)]
        w_d = grid(gen, vocab, hid, head=True).bfloat16().requires_grad_()
        t, w_t = grid(gen, n, hid).bfloat16(), grid(gen, vocab, hid, head=True).bfloat16()
        for x, head in [(h, w_d) for h in hiddens] + [(t, w_t)]:
            exact_logits(x, head)
    weight = torch.rand(k_steps, n, generator=gen)
    for j in range(k_steps):
        weight[j, n - shift - j:] = 0  # no teacher past the end
    weight[1, 3:7] = 0
    loss, step_losses, argmax = lk.fused_lk_loss_ttt(hiddens, w_d, t, w_t, weight, teacher_shift=shift,
                                                     chunk_tokens=chunk, backend=BACKEND, packed=packed, **options)
    with torch.no_grad():
        nograd = lk.fused_lk_loss_ttt(hiddens, w_d, t, w_t, weight, teacher_shift=shift, chunk_tokens=chunk,
                                      backend=BACKEND, packed=packed, **options)
    assert torch.equal(nograd[1], step_losses) and torch.equal(nograd[2], argmax)
    (loss * 1.5).backward()
    ours = [h.grad.clone() for h in hiddens] + [w_d.grad.clone()]
    for x in hiddens + [w_d]:
        x.grad = None
    ref_loss, ref_steps, _ = lk_loss_ttt(hiddens, w_d, t, w_t, weight, teacher_shift=shift, **options)
    (ref_loss * 1.5).backward()
    loss_tol, grad_tol = TOLERANCES[dtype]
    assert torch.allclose(step_losses, ref_steps, rtol=loss_tol), (step_losses, ref_steps)
    for ours_g, x in zip(ours, hiddens + [w_d]):
        assert not ours_g.isnan().any() and rel_err(ours_g, x.grad) < grad_tol, rel_err(ours_g, x.grad)
    for j in range(k_steps):
        check_argmax(argmax[j], hiddens[j].detach().float() @ w_d.detach().float().T, dtype)


@pytest.mark.parametrize("packed", [False, True], ids=["perstep", "packed"])
def test_ttt_unchecked_weight_ignores_rows_without_teacher(packed):
    """check_weight=False: weight left on rows without a teacher is ignored, by the scores AND
    by the lambda variant's mean acceptance (its denominator); the numbers equal the clean ones."""
    gen = torch.Generator().manual_seed(31)
    n, k_steps = 11, 3
    hiddens = [torch.randn(n, 8, generator=gen).requires_grad_() for _ in range(k_steps)]
    w_d, t, w_t = torch.randn(23, 8, generator=gen), torch.randn(n, 8, generator=gen), torch.randn(23, 8, generator=gen)
    dirty = torch.rand(k_steps, n, generator=gen) + 0.5  # weight everywhere, past the end too
    clean = dirty.clone()
    for j in range(k_steps):
        clean[j, n - 1 - j:] = 0
    runs = []
    for weight, check in ((dirty, False), (clean, True)):
        loss, steps, _ = lk.fused_lk_loss_ttt(hiddens, w_d, t, w_t, weight, chunk_tokens=5, backend=BACKEND,
                                              packed=packed, check_weight=check, variant="lambda", kl_decay=2.0)
        loss.backward()
        runs.append((steps, [h.grad.clone() for h in hiddens]))
        for h in hiddens:
            h.grad = None
    (s0, g0), (s1, g1) = runs
    assert torch.equal(s0, s1) and all(torch.equal(x, y) for x, y in zip(g0, g1))


def test_options_and_preconditions_name_the_values():
    h, w_d, t, w_t, weight = make_inputs(7, 8, 21, torch.float32, seed=1)
    lse = torch.zeros(7)
    with pytest.raises(ValueError, match="LK variant 'beta'"):
        lk.fused_lk_loss(h, w_d, t, w_t, lse, weight, variant="beta")
    with pytest.raises(ValueError, match=r"kl_scale must be in \[0, 1\].*got 1.5"):
        lk.fused_lk_loss(h, w_d, t, w_t, lse, weight, kl_scale=1.5)
    with pytest.raises(ValueError, match="got 1.0 and nan"):
        lk.fused_lk_loss_ttt([h], w_d, t, w_t, weight[None], kl_decay=float("nan"))
    with pytest.raises(ValueError, match=r"weight must be fp32 \[7\], got torch.float64"):
        lk.fused_lk_loss(h, w_d, t, w_t, lse, weight.double())
    with pytest.raises(ValueError, match=r"weight must be fp32 \[1, 7\]"):
        lk.fused_lk_loss_ttt([h], w_d, t, w_t, weight)


@pytest.mark.skipif(INNER, reason="this is the outer test")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the compiled Triton kernel is tested directly "
                    "(test_triton_cuda_*)")
def test_triton_interpreter():
    """The Triton path on the CPU: this file's tests again, in a subprocess under TRITON_INTERPRET=1."""
    # The interpreter runs kernels in numpy, about 100x slower: a subset of the cases.
    run_interpreted(__file__, "not onechunk and not 5x16x33 and not chunk6 and not (ttt_shared and fp32) "
                              "and not test_triton_interpreter and not gpu and not sm90", min_passed=19)  # all 19 selected


@pytest.mark.skipif(INNER, reason="compiles, does not run: outside the interpreter subprocess")
@pytest.mark.parametrize("kind", [lk.LINEAR, lk.LOG, lk.ACCEPT], ids=["linear", "log", "accept"])
@pytest.mark.parametrize("has_tidx,has_psum", [(False, False), (True, True)], ids=["own_teacher", "shared_teacher_psum"])
def test_triton_kernel_builds_for_sm90(kind, has_tidx, has_psum):
    """The LK row pass compiled for sm_90 as it launches at Vd = 32000 (no GPU needed; the
    interpreter does not see compile-time errors)."""
    pytest.importorskip("triton")
    from triton_build import build_sm90

    block, warps = row_triton.launch_config(32000)
    fp32 = {"tlse_ptr": "*fp32", "psum_ptr": "*fp32", "w_ptr": "*fp32", "loss_ptr": "*fp32"}
    rows = build_sm90(lk._lk_rows_kernel, dict(BLOCK=block, HAS_TIDX=has_tidx, HAS_PSUM=has_psum, KIND=kind),
                      {**fp32, "tidx_ptr": "*i32" if has_tidx else "*fp32", "argmax_ptr": "*i64"},
                      int_types={"floor": "fp32"}, num_warps=warps)
    assert rows.asm["cubin"]


# ----------------------------------------------------------------------------------------------
# CUDA: the Triton path at realistic sizes against the fp32 reference (skipped on the CPU)
# ----------------------------------------------------------------------------------------------


# How far the fused op's gradients may be from the fp32 reference's, in multiples of the
# reference's own bf16 error (`reference_bf16_error`): the logits' rounding accounts for 1x; the
# fused op rounds G to bf16 and runs the gradient GEMMs in bf16 on top (2.8e-3 and 3.3e-3 more,
# measured on the CPU at Vd = 4093), and its GEMMs may round a logit the other way from the
# measurement's own. A wrong term of G is off by far more.
BF16_ERROR_MULTIPLE = 1.5


def reference_bf16_error(inputs, ref, options, upstream=0.7) -> tuple[float, float]:
    """The reference's own error in bf16 on these inputs: lk_loss given the draft and teacher
    logits rounded to bf16, as the fused op's bf16 GEMMs give them to its row pass (as hidden
    states, with identity heads: an exact product), its gradient carried to the hidden states
    and the head in fp32 -> the relative errors (hidden's, head's) of those gradients against
    the fp32 reference's `ref` (run_both's)."""
    h, w_d, t, w_t, weight = inputs
    with torch.no_grad():
        z, u = (h @ w_d.T).float(), (t @ w_t.T).float()  # bf16 GEMMs: the rounded logits [N, Vd]
        eye = torch.eye(z.shape[1], device=z.device)
    z.requires_grad_()
    loss, _ = lk_loss(z, eye, u, eye, torch.logsumexp(u, -1), weight, **options)
    (loss * upstream).backward()
    grad_h, grad_w = z.grad @ w_d.detach().float(), z.grad.T @ h.detach().float()
    return rel_err(grad_h, ref[2]), rel_err(grad_w, ref[3])


@pytest.mark.gpu
@pytest.mark.parametrize("options", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("vocab", [32000, 4093])
def test_triton_cuda_bf16(options, vocab):
    """The gradient tolerance follows from the reference's own bf16 error on the same inputs
    (BF16_ERROR_MULTIPLE times it, at least TOLERANCES'). These inputs are random, not `grid`'s,
    and the bf16 rounding of the logits moves the LK gradient more than the soft CE's: min(p, q)
    changes branch where q meets p, and the alpha variant divides each row by its acceptance. On
    these inputs at Vd = 4093, on the CPU (the torch row pass, the same chunk loop), the alpha
    variant's gradients were 4.4e-2 / 4.6e-2 (hidden / head) from the fp32 reference, above
    TOLERANCES' 4e-2, and so was the reference itself given the bf16 logits (4.4e-2 / 4.6e-2):
    the fused op was within 3e-3 of that. (Lambda, half of it CE: 1.6e-2 both.) The Triton row
    pass itself is held to the torch one on the same logits by test_triton_rows_match_torch_rows_cuda."""
    run = functools.partial(run_both, options=options)
    check_bf16_at_scale(run, vocab, grad_tols=lambda inputs, ref: tuple(
        max(TOLERANCES[torch.bfloat16][1], BF16_ERROR_MULTIPLE * err) for err in reference_bf16_error(inputs, ref, options)))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [lk.LINEAR, lk.LOG, lk.ACCEPT], ids=["linear", "log", "accept"])
def test_triton_rows_match_torch_rows_cuda(kind):
    """The Triton row pass against the torch row pass on the SAME bf16 CUDA logits."""
    gen = torch.Generator().manual_seed(kind)
    rows, vocab = 777, 32000
    z = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16().cuda()
    t = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16().cuda()
    lse = torch.logsumexp(t.float(), -1)
    weight = torch.rand(rows, 2, generator=gen).cuda()
    weight[::5] = 0
    z_torch, z_triton = z.clone(), z.clone()
    loss_torch, arg_torch = lk._lk_rows_torch(z_torch, t, lse, weight, kind=kind)
    loss_triton, arg_triton = lk._lk_rows_triton(z_triton, t, lse, weight, kind=kind)
    torch.cuda.synchronize()
    assert torch.allclose(loss_triton, loss_torch, rtol=1e-4, atol=1e-4), (loss_triton - loss_torch).abs().max().item()
    assert rel_err(z_triton, z_torch) < 1e-2, rel_err(z_triton, z_torch)
    assert torch.equal(arg_triton, arg_torch), int((arg_triton != arg_torch).sum())
