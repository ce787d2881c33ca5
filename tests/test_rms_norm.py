"""kernels/rms_norm.py against transformers' DeepseekV3RMSNorm: the torch reference bit for bit on
the CPU, the Triton kernel under TRITON_INTERPRET=1 (a subprocess) and compiled on CUDA."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

from eagleforge.kernels.rms_norm import HAS_TRITON, rms_norm, rms_norm_reference

HAS_CUDA = torch.cuda.is_available()


def _inputs(rows, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_reference_is_transformers_deepseek_v3_rmsnorm(dtype):
    x, weight = _inputs(13, 100, dtype, 1)
    hf = DeepseekV3RMSNorm(100, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        assert torch.equal(rms_norm_reference(x, weight, 1e-6), hf(x))
        if dtype == torch.float64 or not HAS_CUDA:  # the CPU dispatch of rms_norm is the reference
            assert torch.equal(rms_norm(x, weight, 1e-6), hf(x))


_INTERPRETED = r"""
import json, torch
from eagleforge.kernels.rms_norm import rms_norm, rms_norm_reference
out = {}
for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 5, 300, generator=gen) * 3).to(dtype)  # 3-D, width not a power of two
    w = (torch.rand(300, generator=gen) + 0.5).to(dtype)
    got, want = rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    out[name] = float(((got.double() - want.double()).abs() / want.double().abs().clamp(min=1e-3)).max())
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its interpreter runs the kernel on the CPU)")
def test_triton_kernel_interpreted_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    err = json.loads(result.stdout.strip().splitlines()[-1])
    assert err["fp32"] < 1e-6, err
    # the interpreter rounds fp32 -> bf16 by truncation (seen in the MoE combine's test): <= 2 ulps
    assert err["bf16"] <= 2 * 2**-7, err


@pytest.mark.gpu
def test_triton_kernel_on_cuda_matches_reference():
    """Kimi's width (7168) and the latent norms' (1536, 512), bf16, odd row counts: at most one
    ulp anywhere (the sum of squares in another order), almost every element bit-equal."""
    for hidden, rows in ((7168, 1031), (1536, 77), (512, 3)):
        x, weight = _inputs(rows, hidden, torch.bfloat16, hidden)
        x, weight = x.cuda(), weight.cuda()
        got, want = rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
        ulps = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)) / 2**-8
        assert float(ulps.max()) <= 2.0, (hidden, float(ulps.max()))
        assert float((got == want).float().mean()) > 0.99, hidden


def test_autograd_inputs_take_the_differentiable_reference():
    """The kernel has no backward: with autograd recording, the reference runs (gradients flow)."""
    x, weight = _inputs(4, 64, torch.float32, 7)
    x.requires_grad_()
    rms_norm(x, weight, 1e-6).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()



@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (compiles the kernel, runs nothing)")
@pytest.mark.parametrize("hidden", [7168, 1536, 512])
def test_triton_kernel_builds_for_sm90(hidden):
    """The one-pass kernel compiled for sm_90 as rms_norm launches it for Kimi's norms (hidden,
    q_lora, kv_lora); no GPU needed, and the interpreter does not see compile-time errors."""
    import triton
    from triton_build import build_sm90

    from eagleforge.kernels import rms_norm as module

    block = triton.next_power_of_2(hidden)
    compiled = build_sm90(module._rms_norm_kernel, dict(BLOCK=block), int_types={"eps": "fp32"},
                          num_warps=8 if block >= 4096 else 4)
    assert compiled.asm["cubin"]
