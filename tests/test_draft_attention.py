"""TTT attention: the masked reference against a per-row definition, and the fast paths
(SDPA + log-sum-exp merge, flex_attention) against the reference, values and gradients."""

import math
import warnings

import pytest
import torch

from eagleforge.draft import attention as A

# (batch, query heads, kv heads, rows T, head dim, TTT steps so far)
SHAPES = [
    (1, 2, 2, 1, 8, 1),
    (2, 6, 2, 13, 16, 4),  # GQA, odd T, batch > 1
    (3, 4, 1, 7, 12, 7),  # MQA, the full 7 TTT steps
    (2, 3, 3, 29, 10, 3),
]


def _inputs(b, hq, hkv, t, d, steps, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: (torch.randn(*shape, generator=g) * 1.5).to(dtype).requires_grad_(grad)  # noqa: E731
    q = mk(b, hq, t, d)
    keys = [mk(b, hkv, t, d) for _ in range(steps)]
    values = [mk(b, hkv, t, d) for _ in range(steps)]
    return q, keys, values


def _per_row_definition(q, keys, values, scale):
    """Straight from the definition: row t at step j sees step-0 rows <= t and steps 1..j at row t."""
    b, hq, t, d = q.shape
    n_rep = hq // keys[0].shape[1]
    out = torch.empty(b, hq, t, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            g = h // n_rep
            for row in range(t):
                ks = [keys[0][bi, g, s] for s in range(row + 1)] + [k[bi, g, row] for k in keys[1:]]
                vs = [values[0][bi, g, s] for s in range(row + 1)] + [v[bi, g, row] for v in values[1:]]
                scores = torch.stack([q[bi, h, row].double() @ k.double() for k in ks]) * scale
                probs = torch.softmax(scores, dim=0)
                out[bi, h, row] = sum(p * v.double() for p, v in zip(probs, vs))
    return out


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_reference_matches_definition(shape):
    q, keys, values = _inputs(*shape, seed=1)
    scale = shape[4] ** -0.5
    ref = A.ttt_attention_reference(q, keys, values, scale)
    torch.testing.assert_close(ref.double(), _per_row_definition(q, keys, values, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_sdpa_matches_reference_values_and_gradients(shape):
    q, keys, values = _inputs(*shape, grad=True, seed=2)
    scale = 1 / math.sqrt(shape[4])
    upstream = torch.randn(shape[0], shape[1], shape[3], shape[4], generator=torch.Generator().manual_seed(3))
    leaves = [q, *keys, *values]

    ref = A.ttt_attention_reference(q, keys, values, scale)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), leaves)
    fast = A.ttt_attention_sdpa(q, keys, values, scale)
    fast_grads = torch.autograd.grad((fast * upstream).sum(), leaves)

    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    for i, (gf, gr) in enumerate(zip(fast_grads, ref_grads)):
        torch.testing.assert_close(gf, gr, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"gradient of leaf {i}: {m}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_matches_reference_values_and_gradients(shape, dtype):
    """The flash + diagonal merge Function (one flash backward with the merged out/lse) against
    the explicit-mask reference in fp32: values and the gradients of q and every step's k, v."""
    q, keys, values = _inputs(*shape, dtype=dtype, grad=True, seed=12)
    scale = 1 / math.sqrt(shape[4])
    upstream = torch.randn(shape[0], shape[1], shape[3], shape[4], generator=torch.Generator().manual_seed(13))
    leaves = [q, *keys, *values]
    ref32 = [x.detach().float().requires_grad_() for x in leaves]
    ref = A.ttt_attention_reference(ref32[0], ref32[1:1 + shape[5]], ref32[1 + shape[5]:], scale)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), ref32)
    out = A.ttt_attention_merged(q, keys, values, scale)
    grads = torch.autograd.grad((out.float() * upstream).sum(), leaves)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: inputs and outputs rounded to 8 bits
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    for i, (g, gr) in enumerate(zip(grads, ref_grads)):
        # Relative to the gradient, or absolute where the exact gradient is 0 (a query that sees a
        # single key has dq = 0: both sides are rounding noise there, 1e-8 against 1e-30).
        err = ((g.float() - gr).norm() / gr.norm().clamp_min(1.0)).item()
        assert err < tol, f"gradient of leaf {i}: error {err:.2e} (relative where |grad| > 1)"


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_old_cpu_torch_pins_sdpa_to_math_and_matches(shape, monkeypatch):
    """Where the CPU flash kernel is not trusted (torch < CPU_FLASH_MIN_TORCH: torch 2.11's flash
    backward gave a 9e23 q gradient for shape 0 on the device image), sdpa and merged run the math
    backend: the flash ops must not be reached, and values and gradients match the reference."""
    monkeypatch.setattr(A, "CPU_FLASH_MIN_TORCH", (999, 0))
    flags = torch.backends.cuda  # the SDPA backend switches (global, CPU included) that sdpa_kernel sets

    def no_flash(*args, **kwargs):
        raise AssertionError("the CPU flash kernel was called")

    def counting_sdpa(*args, **kwargs):
        calls.append({name for name, on in (("flash", flags.flash_sdp_enabled()), ("efficient", flags.mem_efficient_sdp_enabled()),
                                            ("cudnn", flags.cudnn_sdp_enabled()), ("math", flags.math_sdp_enabled())) if on})
        return real_sdpa(*args, **kwargs)

    calls, real_sdpa = [], A.F.scaled_dot_product_attention
    monkeypatch.setattr(A.F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", no_flash)
    q, keys, values = _inputs(*shape, grad=True, seed=21)
    scale = 1 / math.sqrt(shape[4])
    leaves = [q, *keys, *values]
    ref = A.ttt_attention_reference(q, keys, values, scale)
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    for mode in ("sdpa", "merged"):
        calls.clear()
        out = A.ttt_attention(q, keys, values, scale, mode=mode)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for g, gr in zip(grads, ref_grads):
            torch.testing.assert_close(g, gr, atol=1e-5, rtol=1e-5)
        assert calls and all(backends == {"math"} for backends in calls), (mode, calls)


def test_auto_is_fast_and_equal_on_cpu():
    q, keys, values = _inputs(2, 4, 2, 11, 8, 3, seed=4)
    out = A.ttt_attention(q, keys, values, 0.3, mode="auto")
    torch.testing.assert_close(out, A.ttt_attention_merged(q, keys, values, 0.3), atol=0, rtol=0)
    torch.testing.assert_close(out, A.ttt_attention_sdpa(q, keys, values, 0.3), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, A.ttt_attention(q, keys, values, 0.3, mode="reference"), atol=1e-5, rtol=1e-5)


def test_sdpa_bf16_close_to_fp32_reference():
    q, keys, values = _inputs(2, 4, 2, 17, 16, 4, seed=5)
    ref = A.ttt_attention_reference(q, keys, values, 0.25)
    fast = A.ttt_attention_sdpa(q.bfloat16(), [k.bfloat16() for k in keys], [v.bfloat16() for v in values], 0.25)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), ref, atol=5e-2, rtol=5e-2)


def test_causal_lse_chunked_matches_full():
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 3, 23, 8, generator=g), torch.randn(2, 3, 23, 8, generator=g)
    scores = (q @ k.transpose(-1, -2)) * 0.4
    scores = scores.masked_fill(~torch.ones(23, 23, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(A.causal_lse_chunked(q, k, 0.4, chunk=5), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(A._causal_lse_value(q, k, 0.4), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)


def test_flex_mask_matches_reference_eager_cpu():
    """The flex block mask is the reference mask (eager flex on the CPU; compiled on CUDA)."""
    q, keys, values = _inputs(2, 4, 2, 9, 16, 3, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = A.ttt_attention_flex(q, keys, values, 0.25, compiled=False)
    torch.testing.assert_close(out, A.ttt_attention_reference(q, keys, values, 0.25), atol=1e-5, rtol=1e-5)


def test_merged_cudnn_is_merged_on_cpu_and_checks_kernel():
    """On the CPU the cuDNN mode runs the CPU flash kernel, bit for bit the merged mode."""
    q, keys, values = _inputs(1, 4, 2, 37, 16, 3, seed=21)
    torch.testing.assert_close(A.ttt_attention(q, keys, values, 0.3, mode="merged_cudnn"),
                               A.ttt_attention(q, keys, values, 0.3, mode="merged"), atol=0, rtol=0)
    with pytest.raises(ValueError, match="kernel 'fa3'"):
        A.ttt_attention_merged(q, keys, values, 0.3, kernel="fa3")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["merged", "merged_cudnn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merged_flash_matches_reference_cuda(dtype, mode):
    """FlashAttention-2 / cuDNN forward and ONE backward with the merged out and lse on CUDA,
    against the fp32 reference, at an odd T."""
    q, keys, values = _inputs(1, 8, 2, 333, 128, 5, seed=14)
    leaves = [x.cuda().to(dtype).requires_grad_() for x in [q, *keys, *values]]
    ref32 = [x.detach().float().requires_grad_() for x in leaves]
    ref = A.ttt_attention_reference(ref32[0], ref32[1:6], ref32[6:], 128**-0.5)
    A._cudnn_refused.clear()
    out = A.ttt_attention(leaves[0], leaves[1:6], leaves[6:], 128**-0.5, mode=mode)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    g_ref = torch.autograd.grad(ref.square().sum(), ref32)
    g_out = torch.autograd.grad(out.float().square().sum(), leaves)
    for i, (a, b) in enumerate(zip(g_out, g_ref)):
        err = ((a.float() - b).norm() / b.norm()).item()
        assert err < 2e-2, f"gradient of leaf {i}: relative error {err:.2e}"
    assert not A._cudnn_refused, f"cuDNN fell back to FA2 for {A._cudnn_refused}: the cuDNN path was not tested"


@pytest.mark.gpu
def test_cudnn_kernel_runs_at_the_draft_shape_cuda():
    """At the Kimi draft's head shape (D = 128, bf16) cuDNN must take the inputs: a silent
    fallback to FlashAttention-2 would make the merged_cudnn mode's timings mean nothing."""
    q, keys, values = _inputs(1, 64, 64, 1024, 128, 2, seed=3)
    q, keys, values = q.cuda().bfloat16(), [k.cuda().bfloat16() for k in keys], [v.cuda().bfloat16() for v in values]
    A._cudnn_refused.clear()
    out0, lse0, aux = A._flash_forward(q, keys[0], values[0], 128**-0.5, "cudnn")
    assert aux[0] == "cudnn" and not A._cudnn_refused
    ref_out, ref_lse, _ = A._flash_forward(q, keys[0], values[0], 128**-0.5, "flash")
    torch.testing.assert_close(out0.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse0, ref_lse.float(), atol=1e-3, rtol=1e-3)  # the same natural-log row lse


@pytest.mark.gpu
def test_flex_compiled_matches_reference_cuda():
    q, keys, values = _inputs(2, 8, 2, 300, 64, 4, seed=8)
    q, keys, values = q.cuda(), [k.cuda() for k in keys], [v.cuda() for v in values]
    for t in [q, *keys, *values]:
        t.requires_grad_(True)
    ref = A.ttt_attention_reference(q, keys, values, 0.125)
    out = A.ttt_attention(q, keys, values, 0.125, mode="flex")
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    g_ref = torch.autograd.grad(ref.square().sum(), [q, *keys, *values])
    g_out = torch.autograd.grad(out.square().sum(), [q, *keys, *values])
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_bad_inputs_raise():
    q, keys, values = _inputs(1, 3, 2, 5, 8, 2)
    with pytest.raises(ValueError, match="mode"):
        A.ttt_attention(q, keys, values, 0.3, mode="nope")
    q3, keys3, values3 = _inputs(1, 3, 3, 5, 8, 2)
    with pytest.raises(ValueError):
        A.ttt_attention_reference(q3, keys3, values3[:1], 0.3)
    q4, _, _ = _inputs(1, 4, 3, 5, 8, 1)
    with pytest.raises(ValueError):
        A.ttt_attention_sdpa(q4, keys3, values3, 0.3)


@pytest.mark.parametrize("version, flash", [("2.13.0+cpu", True), ("2.14.1", True), ("2.11.0+cu130", False),
                                            ("2.12.0a0+git1234", False), ("3.0.0", True)])
def test_cpu_flash_only_from_the_trusted_torch(monkeypatch, version, flash):
    """merged on the CPU uses the flash backward only from CPU_FLASH_MIN_TORCH on (torch 2.11's
    gave a garbage q gradient on a one-row block); before that it falls back to sdpa, same math."""
    monkeypatch.setattr(torch, "__version__", version)
    q = torch.randn(1, 2, 3, 8)
    assert A._flash_supported(q) is flash
    q, keys, values = _inputs(1, 2, 2, 1, 8, 1, seed=12)
    torch.testing.assert_close(A.ttt_attention_merged(q, keys, values, 0.3),
                               A.ttt_attention_reference(q, keys, values, 0.3), atol=1e-5, rtol=1e-5)
