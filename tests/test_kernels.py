"""eagleforge.kernels.soft_ce against a plain-torch reference written here (fp32, autograd).

Runs the torch path in-process; the Triton path runs the same tests in a subprocess under
TRITON_INTERPRET=1 on the CPU (skipped with a reason where triton is missing), and on CUDA in
the tests marked gpu.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from eagleforge.kernels import grads_kept, row_triton, soft_ce, soft_ce_ttt
from eagleforge.kernels import teacher_lse as teacher_lse_kernels

INNER = os.environ.get("EAGLEFORGE_TRITON_INNER") == "1"  # set by test_triton_interpreter's subprocess
BACKEND = "triton" if INNER else "torch"

# dtype -> (loss relative tolerance, gradient relative-norm tolerance). bf16: the matmuls run in
# bf16 and the logits are rounded to bf16 (as the trainer's GPU path does); the reference is fp32.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 4e-2)}
SHAPES = [(37, 72, 1000), (37, 72, 997), (5, 16, 33)]  # (N, H, Vd): odd N and H, Vd not a power of 2


def plain_soft_ce(h, w_draft, t, w_teacher, weight):
    """Independent reference: the formula of docs/training.md in fp32, log_softmax teacher, autograd."""
    z = h.float() @ w_draft.float().T
    with torch.no_grad():
        log_p = torch.log_softmax(t.float() @ w_teacher.float().T, dim=-1)
    return (weight * -(log_p.exp() * torch.log_softmax(z, -1)).sum(-1)).sum(), z.detach()


def make_inputs(n, h, vocab, dtype, seed, device="cpu"):
    """Fresh random inputs with logits of std ~3 (a peaked, realistic softmax)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 3 * h ** -0.5

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dtype).to(device)

    draft_hidden = rnd(n, h).requires_grad_()
    draft_head = rnd(vocab, h, s=scale).requires_grad_()
    teacher_hidden, teacher_head = rnd(n, h), rnd(vocab, h, s=scale)
    weight = torch.rand(n, generator=gen).to(device)
    weight[torch.rand(n, generator=gen).to(device) < 0.3] = 0  # masked rows
    return draft_hidden, draft_head, teacher_hidden, teacher_head, weight


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_both(inputs, upstream, chunk, backend=BACKEND):
    h, w_d, t, w_t, weight = inputs
    lse = soft_ce.teacher_logsumexp(t, w_t, chunk_tokens=chunk, backend=backend)
    loss, argmax = soft_ce.fused_soft_cross_entropy(h, w_d, t, w_t, lse, weight, chunk_tokens=chunk, backend=backend)
    (loss * upstream).backward()
    ours = (loss.detach(), argmax, h.grad.clone(), w_d.grad.clone())
    h.grad = w_d.grad = None
    ref_loss, ref_logits = plain_soft_ce(h, w_d, t, w_t, weight)
    (ref_loss * upstream).backward()
    ref = (ref_loss.detach(), ref_logits, h.grad.clone(), w_d.grad.clone())
    h.grad = w_d.grad = None
    return ours, ref


def check_argmax(argmax, ref_logits, dtype):
    """The chosen index holds the row maximum (exact in fp32; within bf16 logit error).

    bf16: our argmax runs over logits rounded to bf16 (half an ulp is up to 2^-8 relative, so two
    roundings alone reach 2 * 2^-8 * |best|) and computed by a bf16 GEMM whose own error
    (cuBLAS may reduce split-K partial sums in bf16) comes on top: 4 * 2^-8 * |best|. An H200
    run saw 0.0824 at |best| ~ 10.5 (2 * 2^-8 would allow 0.082) at Vd = 4093,
    while the Triton row pass matched the torch row pass exactly on the same logits
    (test_triton_rows_match_torch_rows_cuda): a tolerance, not a kernel bug."""
    chosen = ref_logits.gather(1, argmax[:, None])[:, 0]
    best = ref_logits.max(-1).values
    if dtype == torch.float32:
        assert torch.equal(argmax, ref_logits.argmax(-1)), "argmax differs from the reference"
    else:
        slack = 4 * 2**-8 * best.abs() + 1e-3
        assert bool((best - chosen <= slack).all()), f"argmax off by {(best - chosen).max().item()}"


def check_against_reference(ours, ref, dtype):
    """run_both's (fused, reference) within TOLERANCES[dtype]: loss, gradients (in the inputs'
    dtype), argmax."""
    (loss, argmax, gh, gw), (rloss, rlogits, rgh, rgw) = ours, ref
    loss_tol, grad_tol = TOLERANCES[dtype]
    assert abs(loss.item() - rloss.item()) <= loss_tol * abs(rloss.item()), (loss.item(), rloss.item())
    assert gh.dtype == dtype and gw.dtype == dtype
    assert rel_err(gh, rgh) < grad_tol, rel_err(gh, rgh)
    assert rel_err(gw, rgw) < grad_tol, rel_err(gw, rgw)
    check_argmax(argmax, rlogits, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("chunk", [10, 4096], ids=["chunk10", "onechunk"])
def test_loss_grads_argmax(dtype, shape, chunk):
    inputs = make_inputs(*shape, dtype, seed=sum(shape) * 7 + chunk + (dtype == torch.bfloat16))
    check_against_reference(*run_both(inputs, upstream=1.0, chunk=chunk), dtype)


@pytest.mark.parametrize("upstream", [2.5, -0.3])
def test_non_unit_upstream_gradient(upstream):
    inputs = make_inputs(37, 72, 997, torch.float32, seed=11)
    (loss, _, gh, gw), (rloss, _, rgh, rgw) = run_both(inputs, upstream=upstream, chunk=16)
    assert rel_err(gh, rgh) < 1e-5 and rel_err(gw, rgw) < 1e-5
    assert torch.allclose(loss, rloss, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_masked(dtype):
    h, w_d, t, w_t, weight = make_inputs(37, 72, 1000, dtype, seed=5)
    weight = torch.zeros_like(weight)
    (loss, argmax, gh, gw), (_, rlogits, _, _) = run_both((h, w_d, t, w_t, weight), upstream=1.0, chunk=8)
    assert loss.item() == 0.0
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0
    check_argmax(argmax, rlogits, dtype)


def test_masked_rows_with_nonfinite_teacher_are_ignored():
    """A weight-0 row whose teacher lse is inf/nan (e.g. a padding row) must not poison the loss."""
    h, w_d, t, w_t, weight = make_inputs(37, 72, 997, torch.float32, seed=7)
    weight[[2, 9]] = 0
    lse = soft_ce.teacher_logsumexp(t, w_t, backend=BACKEND)
    bad = lse.clone()
    bad[2], bad[9] = float("-inf"), float("nan")
    loss, _ = soft_ce.fused_soft_cross_entropy(h, w_d, t, w_t, bad, weight, chunk_tokens=10, backend=BACKEND)
    loss.backward()
    ref_loss, _ = plain_soft_ce(h, w_d, t, w_t, weight)
    assert torch.isfinite(h.grad).all() and torch.isfinite(w_d.grad).all()
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    assert torch.count_nonzero(h.grad[[2, 9]]) == 0


def test_inexact_teacher_lse_follows_the_formula():
    """p = exp(u - teacher_lse) as given, even when it does not sum to 1 (S = e^-0.2 here)."""
    h, w_d, t, w_t, weight = make_inputs(19, 24, 997, torch.float32, seed=23)
    lse = torch.logsumexp(t @ w_t.T, -1) + 0.2
    loss, _ = soft_ce.fused_soft_cross_entropy(h, w_d, t, w_t, lse, weight, chunk_tokens=5, backend=BACKEND)
    loss.backward()
    ours = (h.grad.clone(), w_d.grad.clone())
    h.grad = w_d.grad = None
    p = torch.exp(t @ w_t.T - lse[:, None])
    ref = (weight * -(p * torch.log_softmax(h @ w_d.T, -1)).sum(-1)).sum()
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-5)
    assert rel_err(ours[0], h.grad) < 1e-5 and rel_err(ours[1], w_d.grad) < 1e-5


def test_grad_to_one_input_only_and_no_grad():
    h, w_d, t, w_t, weight = make_inputs(29, 40, 501, torch.float32, seed=3)
    lse = torch.logsumexp(t.float() @ w_t.float().T, dim=-1)
    h_const = h.detach()
    loss, _ = soft_ce.fused_soft_cross_entropy(h_const, w_d, t, w_t, lse, weight, chunk_tokens=7, backend=BACKEND)
    loss.backward()
    ref_loss, _ = plain_soft_ce(h_const, w_d.detach().requires_grad_(), t, w_t, weight)
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    with torch.no_grad():
        loss2, _ = soft_ce.fused_soft_cross_entropy(h, w_d, t, w_t, lse, weight, backend=BACKEND)
    assert not loss2.requires_grad and torch.allclose(loss2, ref_loss, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_teacher_logsumexp(dtype):
    _, _, t, w_t, _ = make_inputs(41, 24, 997, dtype, seed=13)
    lse = soft_ce.teacher_logsumexp(t, w_t, chunk_tokens=6, backend=BACKEND)
    ref = torch.logsumexp(t.float() @ w_t.float().T, -1)
    assert lse.dtype == torch.float32 and lse.shape == (41,)
    assert torch.allclose(lse, ref, atol=1e-5 if dtype == torch.float32 else 5e-2)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty and torch.empty_like return NaN-filled floats: the TTT gradients are allocated
    empty (every row must be written or zeroed), and a row left unwritten shows as NaN instead of
    passing by luck."""
    for name in ("empty", "empty_like"):
        real = getattr(torch, name)

        def poisoned(*args, _real=real, **kwargs):
            out = _real(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

        monkeypatch.setattr(torch, name, poisoned)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [6, 13, 4096], ids=["chunk6", "chunk13", "onechunk"])
@pytest.mark.parametrize("packed", [False, True], ids=["perstep", "packed"])
def test_ttt_shared_teacher(dtype, chunk, packed, poisoned_empty):
    """All steps at once == K shifted single-step calls of the plain reference, loss and grads;
    per step and with the K steps of a teacher chunk packed into one matmul (chunk 6: one
    teacher row per packed chunk; 13: three, spans cut at odd places)."""
    n, hid, vocab, k_steps, shift = 31, 40, 333, 4, 1
    gen = torch.Generator().manual_seed(17 + chunk)
    scale = 3 * hid ** -0.5
    hiddens = [torch.randn(n, hid, generator=gen).to(dtype).requires_grad_() for _ in range(k_steps)]
    w_d = (torch.randn(vocab, hid, generator=gen) * scale).to(dtype).requires_grad_()
    t = torch.randn(n, hid, generator=gen).to(dtype)
    w_t = (torch.randn(vocab, hid, generator=gen) * scale).to(dtype)
    weight = torch.rand(k_steps, n, generator=gen)
    for j in range(k_steps):
        weight[j, n - shift - j :] = 0  # no teacher past the end
    weight[1, 3:7] = 0
    loss, step_losses, argmax = soft_ce_ttt.fused_soft_cross_entropy_ttt(
        hiddens, w_d, t, w_t, weight, teacher_shift=shift, chunk_tokens=chunk, backend=BACKEND, packed=packed)
    with torch.no_grad():  # the no-gradient path gives the same numbers
        nograd = soft_ce_ttt.fused_soft_cross_entropy_ttt(
            hiddens, w_d, t, w_t, weight, teacher_shift=shift, chunk_tokens=chunk, backend=BACKEND, packed=packed)
    assert torch.equal(nograd[1], step_losses) and torch.equal(nograd[2], argmax)
    (loss * 1.5).backward()
    ours = [h.grad.clone() for h in hiddens] + [w_d.grad.clone()]
    for x in hiddens + [w_d]:
        x.grad = None
    ref_steps, ref_logits = [], []
    for j, h in enumerate(hiddens):
        rows = (torch.arange(n) + shift + j).clamp(max=n - 1)
        step_loss, logits = plain_soft_ce(h, w_d, t[rows], w_t, weight[j])
        ref_steps.append(step_loss)
        ref_logits.append(logits)
    (torch.stack(ref_steps).sum() * 1.5).backward()
    loss_tol, grad_tol = TOLERANCES[dtype]
    assert torch.allclose(step_losses, torch.stack(ref_steps).detach(), rtol=loss_tol)
    assert abs(loss.item() - sum(s.item() for s in ref_steps)) <= loss_tol * abs(loss.item())
    for ours_g, x in zip(ours, hiddens + [w_d]):
        assert rel_err(ours_g, x.grad) < grad_tol, rel_err(ours_g, x.grad)
    for j in range(k_steps):
        check_argmax(argmax[j], ref_logits[j], dtype)


def test_ttt_packed_all_masked_and_short(poisoned_empty):
    """Packed form: every weight 0 gives loss 0 and zero gradients; N shorter than K + shift
    leaves late steps without any teacher row (argmax only)."""
    gen = torch.Generator().manual_seed(29)
    for n in (3, 12):
        hiddens = [torch.randn(n, 8, generator=gen).requires_grad_() for _ in range(5)]
        w_d = torch.randn(19, 8, generator=gen).requires_grad_()
        t = torch.randn(n, 8, generator=gen)
        loss, steps, argmax = soft_ce_ttt.fused_soft_cross_entropy_ttt(
            hiddens, w_d, t, torch.randn(19, 8, generator=gen), torch.zeros(5, n), chunk_tokens=7,
            backend=BACKEND, packed=True)
        loss.backward()
        assert loss.item() == 0 and not steps.any()
        assert all(not h.grad.any() for h in hiddens) and not w_d.grad.any()
        for j, h in enumerate(hiddens):
            assert torch.equal(argmax[j], (h.detach() @ w_d.detach().T).argmax(-1))


@pytest.mark.parametrize("packed", [False, True], ids=["perstep", "packed"])
def test_ttt_gradient_to_some_steps_only(packed, poisoned_empty):
    """A step whose hidden states need no gradient gets none, and the others get the same gradients
    as when every step needs one."""
    gen = torch.Generator().manual_seed(41)
    n, k_steps = 23, 3
    base = [torch.randn(n, 12, generator=gen) for _ in range(k_steps)]
    w_d, t, w_t = torch.randn(29, 12, generator=gen), torch.randn(n, 12, generator=gen), torch.randn(29, 12, generator=gen)
    weight = torch.rand(k_steps, n, generator=gen)
    for j in range(k_steps):
        weight[j, n - 1 - j:] = 0
    grads = []
    for needs in ([True] * k_steps, [True, False, True]):
        hiddens = [b.clone().requires_grad_(need) for b, need in zip(base, needs)]
        loss, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, w_d, t, w_t, weight, chunk_tokens=7,
                                                          backend=BACKEND, packed=packed)
        loss.backward()
        grads.append([h.grad for h in hiddens])
    assert grads[1][1] is None
    for j in (0, 2):
        assert torch.equal(grads[0][j], grads[1][j]) and not grads[1][j].isnan().any(), j


def test_ttt_float64_gradients_scaled_in_float64():
    """fp64 inputs (the references' dtype): the backward scales the saved gradients by the (fp32)
    upstream in fp64, on the Triton path too (its kernel scales 16- and 32-bit gradients in fp32),
    without rounding them through fp32."""
    gen = torch.Generator().manual_seed(43)
    n, k_steps = 11, 2
    hiddens = [torch.randn(n, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(k_steps)]
    w_d = torch.randn(13, 8, generator=gen, dtype=torch.float64).requires_grad_()
    t, w_t = torch.randn(n, 8, generator=gen, dtype=torch.float64), torch.randn(13, 8, generator=gen, dtype=torch.float64)
    weight = torch.rand(k_steps, n, generator=gen)
    for j in range(k_steps):
        weight[j, n - 1 - j:] = 0
    grads = []
    for upstream in (1.0, 1 / 3):
        loss, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, w_d, t, w_t, weight, chunk_tokens=4, backend=BACKEND)
        (loss * upstream).backward()
        grads.append([x.grad.clone() for x in hiddens + [w_d]])
        for x in hiddens + [w_d]:
            x.grad = None
    third_fp32 = torch.tensor(1 / 3, dtype=torch.float32).double()  # the loss is fp32: so is its upstream
    for unit, third in zip(*grads):
        torch.testing.assert_close(third, unit * third_fp32, rtol=1e-15, atol=0)  # not rounded through fp32


def test_ttt_rejects_weight_without_teacher():
    hiddens = [torch.randn(9, 8) for _ in range(2)]
    w = torch.randn(50, 8)
    weight = torch.ones(2, 9)
    with pytest.raises(ValueError, match=r"weight\[0, 8:\] must be 0"):
        soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, w, torch.randn(9, 8), w, weight, backend=BACKEND)
    weight[0, 8] = 0  # step 0 now fine; step 1's row 7 has no teacher either (7 + 1 + 1 = 9)
    with pytest.raises(ValueError, match=r"weight\[1, 7:\] must be 0"):
        soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, w, torch.randn(9, 8), w, weight, backend=BACKEND)
    weight[1, 7:] = 0
    soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, w, torch.randn(9, 8), w, weight, backend=BACKEND)  # accepted


@pytest.mark.parametrize("packed", [False, True], ids=["perstep", "packed"])
def test_ttt_unchecked_weight_ignores_rows_without_teacher(packed):
    """check_weight=False (no host sync): weight on rows without a teacher is ignored, never
    scored against a row past the end; the numbers equal those with the weight zeroed."""
    gen = torch.Generator().manual_seed(31)
    n, k_steps = 11, 3
    hiddens = [torch.randn(n, 8, generator=gen).requires_grad_() for _ in range(k_steps)]
    w_d, t, w_t = torch.randn(23, 8, generator=gen), torch.randn(n, 8, generator=gen), torch.randn(23, 8, generator=gen)
    dirty = torch.rand(k_steps, n, generator=gen)  # weight everywhere, past the end too
    clean = dirty.clone()
    for j in range(k_steps):
        clean[j, n - 1 - j:] = 0
    runs = []
    for weight, check in ((dirty, False), (clean, True)):
        loss, steps, argmax = soft_ce_ttt.fused_soft_cross_entropy_ttt(
            hiddens, w_d, t, w_t, weight, chunk_tokens=5, backend=BACKEND, packed=packed, check_weight=check)
        loss.backward()
        runs.append((steps, argmax, [h.grad.clone() for h in hiddens]))
        for h in hiddens:
            h.grad = None
    (s0, a0, g0), (s1, a1, g1) = runs
    assert torch.equal(s0, s1) and torch.equal(a0, a1) and all(torch.equal(x, y) for x, y in zip(g0, g1))


def test_ttt_upstream_scaled_in_fp32_and_second_backward_refused():
    """The saved bf16 gradients are scaled by the upstream in fp32 (1/3 is not rounded to bf16
    first), in place; a second backward through the same graph is refused, not scaled twice."""
    gen = torch.Generator().manual_seed(37)
    n, k_steps = 13, 2
    hiddens = [torch.randn(n, 16, generator=gen).bfloat16().requires_grad_() for _ in range(k_steps)]
    w_d = torch.randn(41, 16, generator=gen).bfloat16().requires_grad_()
    t, w_t = torch.randn(n, 16, generator=gen).bfloat16(), torch.randn(41, 16, generator=gen).bfloat16()
    weight = torch.rand(k_steps, n, generator=gen)
    weight[0, n - 1:], weight[1, n - 2:] = 0, 0
    grads = []
    for upstream in (1.0, 1 / 3):
        loss, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, w_d, t, w_t, weight, chunk_tokens=4, backend=BACKEND)
        (loss * upstream).backward(retain_graph=True)
        grads.append([x.grad.clone() for x in hiddens + [w_d]])
        for x in hiddens + [w_d]:
            x.grad = None
        if upstream != 1.0:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                (loss * upstream).backward()
    for unit, third in zip(*grads):
        expected = (unit.float() * torch.tensor(1 / 3)).bfloat16()
        if INNER:  # Triton's interpreter rounds fp32 -> bf16 its own way (numpy bit arithmetic): 1 ulp
            torch.testing.assert_close(third.float(), expected.float(), rtol=2**-7, atol=0)
            assert not torch.equal(third, (unit * torch.tensor(1 / 3).bfloat16()))  # yet not scaled by bf16(1/3)
        else:
            assert torch.equal(third, expected)


def test_preconditions_name_the_values():
    h, w_d, t, w_t, weight = make_inputs(7, 8, 21, torch.float32, seed=1)
    lse = torch.zeros(7)
    with pytest.raises(ValueError, match="draft_hidden is torch.bfloat16 but draft_head is torch.float32"):
        soft_ce.fused_soft_cross_entropy(h.detach().bfloat16(), w_d, t, w_t, lse, weight)
    with pytest.raises(ValueError, match=r"weight must be fp32 \[7\], got torch.float64"):
        soft_ce.fused_soft_cross_entropy(h, w_d, t, w_t, lse, weight.double())
    with pytest.raises(ValueError, match=r"teacher_lse must be fp32 \[7\], got torch.float32 \(6,\)"):
        soft_ce.fused_soft_cross_entropy(h, w_d, t, w_t, lse[:6], weight)
    with pytest.raises(ValueError, match="differ in H"):
        soft_ce.fused_soft_cross_entropy(h, w_d[:, :5], t, w_t, lse, weight)
    with pytest.raises(ValueError, match="backend 'cuda'"):
        soft_ce.fused_soft_cross_entropy(h, w_d, t, w_t, lse, weight, backend="cuda")


@pytest.mark.skipif(INNER, reason="this is the outer test")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the compiled Triton kernels are tested directly "
                    "(test_triton_cuda_*; Triton 3.6's interpreter failed under numpy 2.5 on the device image)")
def test_triton_interpreter():
    """The Triton path on the CPU: this file's tests again, in a subprocess under TRITON_INTERPRET=1."""
    # The interpreter runs kernels in numpy, about 100x slower: a subset of the cases.
    # 29 of the 32 selected pass; 3 skip there by design (test_triton_kernel_builds_*: outside the interpreter)
    run_interpreted(__file__, "not onechunk and not 5x16x33 and not 37x72x1000 and not test_triton_interpreter and not gpu",
                    min_passed=29)


def run_interpreted(test_file: str, select: str, min_passed: int) -> None:
    """The tests of `test_file` selected by `select` (pytest -k) in a subprocess under
    TRITON_INTERPRET=1 with EAGLEFORGE_TRITON_INNER=1 (their BACKEND is then triton); skips
    where triton is not installed. At least `min_passed` of them must pass and none fail: an exit
    code of 0 alone would also pass a run that skipped or deselected them all."""
    if not soft_ce.HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton): the interpreter cannot run here")
    env = dict(os.environ, TRITON_INTERPRET="1", EAGLEFORGE_TRITON_INNER="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k", select],
        env=env, capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, output
    counts = pytest_counts(proc.stdout)
    assert counts.get("passed", 0) >= min_passed, f"{counts.get('passed', 0)} passed, at least {min_passed} expected: {output}"
    assert not counts.get("failed") and not counts.get("error") and not counts.get("errors"), output


def pytest_counts(stdout: str) -> dict[str, int]:
    """{outcome: count} from pytest's closing line ('12 passed, 2 skipped, 3 deselected in 4.5s')."""
    summary = [line for line in stdout.splitlines() if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", line)]
    assert summary, f"no pytest summary line in: {stdout[-2000:]}"
    return {outcome: int(n) for n, outcome in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", summary[-1])}


# ----------------------------------------------------------------------------------------------
# CUDA: the Triton path at realistic sizes against the fp32 reference (skipped on the CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 4093])
def test_triton_cuda_bf16(vocab):
    check_bf16_at_scale(run_both, vocab)


def check_bf16_at_scale(run, vocab: int, grad_tols=None, device="cuda", backend="triton"):
    """A bf16 run at a realistic size (N = 1531, H = 512, this Vd) against the fp32 reference:
    `run(inputs, upstream=, chunk=, backend=)` -> run_both's (fused, reference). The gradients'
    tolerance is TOLERANCES' unless `grad_tols(inputs, reference) -> (hidden's, head's)`."""
    inputs = make_inputs(1531, 512, vocab, torch.bfloat16, seed=vocab, device=device)
    inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
    (loss, argmax, gh, gw), ref = run(inputs, upstream=0.7, chunk=512, backend=backend)
    rloss, rlogits, rgh, rgw = ref
    loss_tol, grad_tol = TOLERANCES[torch.bfloat16]
    tol_h, tol_w = grad_tols(inputs, ref) if grad_tols else (grad_tol, grad_tol)
    numbers = (f"Vd={vocab}: loss {loss.item()} vs {rloss.item()}, grad rel err hidden {rel_err(gh, rgh):.3g} "
               f"(tolerance {tol_h:.3g}) head {rel_err(gw, rgw):.3g} (tolerance {tol_w:.3g}), "
               f"finite {bool(torch.isfinite(gh).all())}/{bool(torch.isfinite(gw).all())}")
    assert abs(loss.item() - rloss.item()) <= loss_tol * abs(rloss.item()), numbers
    assert rel_err(gh, rgh) < tol_h and rel_err(gw, rgw) < tol_w, numbers
    check_argmax(argmax, rlogits, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 4093, 4096, 1000])
def test_triton_rows_match_torch_rows_cuda(vocab):
    """The Triton row pass against the torch row pass on the SAME bf16 CUDA logits: isolates the
    kernel (block masking at a Vd that is not a multiple of the block, odd row strides) from the
    rounding of the matmuls."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 777
    z = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16().cuda()
    t = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16().cuda()
    lse = torch.logsumexp(t.float(), -1)
    weight = torch.rand(rows, generator=gen).cuda()
    weight[::5] = 0
    z_torch, z_triton = z.clone(), z.clone()
    loss_torch, arg_torch = soft_ce._rows_torch(z_torch, t, lse, weight)
    loss_triton, arg_triton = soft_ce._rows_triton(z_triton, t, lse, weight)
    torch.cuda.synchronize()
    assert torch.allclose(loss_triton, loss_torch, rtol=1e-4, atol=1e-4), (loss_triton - loss_torch).abs().max().item()
    assert rel_err(z_triton, z_torch) < 1e-2, rel_err(z_triton, z_torch)
    assert torch.equal(arg_triton, arg_torch), int((arg_triton != arg_torch).sum())


@pytest.mark.gpu
def test_triton_cuda_ttt_matches_single_steps():
    n, hid, vocab, k_steps = 1000, 256, 8191, 7
    gen = torch.Generator(device="cuda").manual_seed(0)
    hiddens = [torch.randn(n, hid, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_() for _ in range(k_steps)]
    w_d = (torch.randn(vocab, hid, device="cuda", generator=gen) * 0.2).bfloat16().requires_grad_()
    t = torch.randn(n, hid, device="cuda", generator=gen, dtype=torch.bfloat16)
    w_t = (torch.randn(vocab, hid, device="cuda", generator=gen) * 0.2).bfloat16()
    weight = torch.rand(k_steps, n, device="cuda", generator=gen)
    for j in range(k_steps):
        weight[j, n - 1 - j :] = 0
    loss, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, w_d, t, w_t, weight, chunk_tokens=384)
    loss.backward()
    ours = [h.grad.clone() for h in hiddens] + [w_d.grad.clone()]
    for x in hiddens + [w_d]:
        x.grad = None
    lse = soft_ce.teacher_logsumexp(t, w_t)
    total = 0
    for j, h in enumerate(hiddens):
        rows = (torch.arange(n, device="cuda") + 1 + j).clamp(max=n - 1)
        total = total + soft_ce.fused_soft_cross_entropy(h, w_d, t[rows], w_t, lse[rows], weight[j])[0]
    total.backward()
    assert abs(loss.item() - total.item()) <= 1e-3 * abs(total.item())
    for ours_g, x in zip(ours, hiddens + [w_d]):
        assert rel_err(ours_g, x.grad) < 2e-2


def test_transposed_inputs_and_second_order_refused():
    """Inputs that are transposed views (their gradients are still made contiguous, as the
    in-place upstream scaling needs) give the same gradients as contiguous ones; a create_graph
    backward through the fused loss is refused (its saved gradients are constants)."""
    gen = torch.Generator().manual_seed(41)
    n, hid, vocab = 11, 8, 29
    h_t = torch.randn(hid, n, generator=gen).requires_grad_()  # draft_hidden = h_t.T, a transposed view
    w_t = torch.randn(hid, vocab, generator=gen).requires_grad_()  # draft_head = w_t.T
    t, w_teacher = torch.randn(n, hid, generator=gen), torch.randn(vocab, hid, generator=gen)
    weight = torch.rand(2, n, generator=gen)
    weight[0, n - 1:], weight[1, n - 2:] = 0, 0
    hiddens = [h_t.T, h_t.T * 0.5]
    loss, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, w_t.T, t, w_teacher, weight, chunk_tokens=4, backend=BACKEND)
    (loss * 0.7).backward()
    got = (h_t.grad.clone(), w_t.grad.clone())
    h, w = h_t.detach().T.contiguous().requires_grad_(), w_t.detach().T.contiguous().requires_grad_()
    ref, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt([h, h * 0.5], w, t, w_teacher, weight, chunk_tokens=4, backend=BACKEND)
    (ref * 0.7).backward()
    torch.testing.assert_close(got[0], h.grad.T)
    torch.testing.assert_close(got[1], w.grad.T)
    loss2, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt([h], w, t, w_teacher, weight[:1], chunk_tokens=4, backend=BACKEND)
    (grad,) = torch.autograd.grad(loss2, h, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|second"):
        grad.sum().backward()



@pytest.mark.skipif(INNER, reason="compiles, does not run: outside the interpreter subprocess")
@pytest.mark.parametrize("has_tidx,has_psum", [(False, False), (True, True), (False, True)],
                         ids=["own_teacher", "shared_teacher_psum", "own_teacher_psum"])
def test_triton_kernels_build_for_sm90(has_tidx, has_psum):
    """The row pass, the teacher lse (with S) and the gradients' scaling compiled for sm_90 as they
    launch at Vd = 32000 (no GPU needed; the interpreter does not see compile-time errors)."""
    pytest.importorskip("triton")
    from triton_build import build_sm90

    block, warps = row_triton.launch_config(32000)
    fp32 = {"tlse_ptr": "*fp32", "psum_ptr": "*fp32", "w_ptr": "*fp32", "loss_ptr": "*fp32", "out_ptr": "*fp32"}
    rows = build_sm90(soft_ce._soft_ce_rows_kernel, dict(BLOCK=block, HAS_TIDX=has_tidx, HAS_PSUM=has_psum),
                      {**fp32, "tidx_ptr": "*i32" if has_tidx else "*fp32", "argmax_ptr": "*i64"}, num_warps=warps)
    lse = build_sm90(teacher_lse_kernels._row_lse_kernel, dict(BLOCK=block, WITH_PSUM=has_psum), fp32, num_warps=warps)
    scale = build_sm90(grads_kept._scale_kernel, dict(BLOCK=grads_kept._SCALE_BLOCK), {"up_ptr": "*fp32"}, num_warps=8)
    assert rows.asm["cubin"] and lse.asm["cubin"] and scale.asm["cubin"]
