"""AdamW on bf16 weights with exact fp32 masters (kernels/master_adamw.py, train/optimizer.py)
against the reference: torch.optim.AdamW over fp32 parameters fed the same gradients. The CPU
path runs here; the Triton kernel under TRITON_INTERPRET=1 (a subprocess) and on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eagleforge.kernels.master_adamw import HAS_TRITON, join_master, master_adamw_step_, split_master
from eagleforge.train.optimizer import MasterAdamW

HAS_CUDA = torch.cuda.is_available()


def _master_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 values over many magnitudes and both signs (norm gains near 1, weights near 0.02)."""
    scale = torch.exp2(torch.randint(-20, 4, (n,), generator=gen).float())
    return torch.randn(n, generator=gen) * scale


def test_split_then_join_is_the_master_bit_for_bit(test_seed):
    gen = torch.Generator().manual_seed(test_seed)
    master = torch.cat([_master_values(100_003, gen), torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, -1e-40])])
    weight, remainder = split_master(master)
    assert weight.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_master(weight, remainder).view(torch.int32), master.view(torch.int32))
    # the weight is the master rounded to nearest (torch's cast) wherever that is not a tie
    bits = master.view(torch.int32)
    not_tie = (bits & 0xFFFF) != 0x8000
    assert torch.equal(weight[not_tie], master[not_tie].to(torch.bfloat16))


def test_a_tie_rounds_away_from_zero():
    # 1 + 2^-8 lies halfway between the bf16 neighbours 1 and 1 + 2^-7 (bits 0x3F808000)
    master = torch.tensor([1 + 2**-8, -(1 + 2**-8)])
    weight, remainder = split_master(master)
    assert weight.tolist() == [1 + 2**-7, -(1 + 2**-7)]
    assert torch.equal(join_master(weight, remainder), master)


def _run_both(shape, steps: int, lr: float, weight_decay: float, gen: torch.Generator, device="cpu", skip_at=()):
    """(MasterAdamW's masters and weights, the fp32 reference's parameters, MasterAdamW's state, the
    start) after `steps` steps of the same bf16 gradients; a step in `skip_at` is skipped for both."""
    master0 = _master_values(int(torch.tensor(shape).prod()), gen).reshape(shape).to(torch.bfloat16)  # a bf16 start, as trained
    param = torch.nn.Parameter(master0.clone().to(device))
    reference = torch.nn.Parameter(master0.float().clone().to(device))
    ours = MasterAdamW([param], lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    theirs = torch.optim.AdamW([reference], lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay, foreach=False)
    for step in range(steps):
        grad = (torch.randn(shape, generator=gen) * 10.0 ** float(torch.randint(-6, 1, (), generator=gen))).to(torch.bfloat16)
        skip = step in skip_at
        param.grad = grad.to(device) if not skip else torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
        ours.found_inf = torch.tensor(float(skip), device=device)
        ours.step()
        if not skip:
            reference.grad = grad.float().to(device)
            theirs.step()
    state = ours.state[param]
    return join_master(param.detach(), state["master_remainder"]), param.detach(), reference.detach(), state, master0


def _assert_rounding_close(master: torch.Tensor, reference: torch.Tensor, start: torch.Tensor, lr: float, steps: int) -> None:
    """fp32 rounding apart (another operation order, or fused multiply-adds on the GPU): a few
    ulps per step of the largest value an element passed through, |start| + lr x steps."""
    bound = 8 * steps * 2.0**-24 * (start.float().abs() + lr * steps)
    excess = (master.cpu() - reference.cpu()).abs() - bound.cpu()
    assert float(excess.max()) <= 0, f"off by more than rounding: {float(excess.max()):.3g} over the bound"


@pytest.mark.parametrize("shape", [(37, 13), (1001,), (3, 5, 7)], ids=lambda s: "x".join(map(str, s)))
def test_steps_equal_adamw_over_fp32_masters(shape, test_seed):
    gen = torch.Generator().manual_seed(test_seed)
    master, weight, reference, state, start = _run_both(shape, steps=12, lr=3e-3, weight_decay=0.1, gen=gen, skip_at={4})
    _assert_rounding_close(master, reference, start, lr=3e-3, steps=12)
    not_tie = (master.view(torch.int32) & 0xFFFF) != 0x8000  # a tie (one in 2^16) rounds away from zero
    assert torch.equal(weight[not_tie], master.to(torch.bfloat16)[not_tie])  # the matmuls' weight: the master's cast
    assert float(state["step"]) == 11  # the skipped step is not counted


def test_updates_smaller_than_a_bf16_step_accumulate():
    """Norm gains at 1.0 and a learning rate far below bf16's spacing there (2^-7): the master
    moves as fp32 AdamW's parameter does, and the weight follows once the master crosses."""
    param = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    optimizer = MasterAdamW([param], lr=5e-5, betas=(0.9, 0.999))
    reference = torch.nn.Parameter(torch.ones(64))
    reference_opt = torch.optim.AdamW([reference], lr=5e-5, betas=(0.9, 0.999), weight_decay=0.0)
    for _ in range(200):
        param.grad = torch.full((64,), -1.0, dtype=torch.bfloat16)  # always push up
        reference.grad = torch.full((64,), -1.0)
        optimizer.step()
        reference_opt.step()
    master = join_master(param.detach(), optimizer.state[param]["master_remainder"])
    torch.testing.assert_close(master, reference.detach(), rtol=1e-6, atol=0)
    assert float(master[0]) > 1.009  # 200 steps of ~5e-5
    assert float(param.detach()[0]) == 1 + 2**-7  # the bf16 weight has taken its first step


def test_skipped_step_changes_nothing():
    param = torch.nn.Parameter(torch.randn(17, dtype=torch.bfloat16))
    optimizer = MasterAdamW([param], lr=1e-2)
    param.grad = torch.randn(17, dtype=torch.bfloat16)
    optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[param].items()}, param.detach().clone()
    param.grad = torch.full((17,), float("inf"), dtype=torch.bfloat16)
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    for key, value in before[0].items():
        assert torch.equal(optimizer.state[param][key], value), key
    assert torch.equal(param.detach(), before[1])


def test_refuses_what_it_cannot_step():
    param = torch.nn.Parameter(torch.randn(4))
    param.grad = torch.randn(4)
    with pytest.raises(ValueError, match="bfloat16 parameters"):
        MasterAdamW([param], lr=1e-3).step()
    w = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="differ in shape"):
        master_adamw_step_(w, torch.zeros(4, dtype=torch.int16), torch.zeros(5), torch.zeros(4), torch.zeros(4), torch.zeros(()),
                           None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def test_state_dict_round_trip_continues_the_same_steps():
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(9, 4, generator=gen).to(torch.bfloat16) for _ in range(6)]
    start = torch.randn(9, 4, generator=gen).to(torch.bfloat16)

    def train(grads, param, optimizer):
        for g in grads:
            param.grad = g.clone()
            optimizer.step()

    whole = torch.nn.Parameter(start.clone())
    whole_opt = MasterAdamW([whole], lr=1e-2)
    train(grads, whole, whole_opt)
    first = torch.nn.Parameter(start.clone())
    first_opt = MasterAdamW([first], lr=1e-2)
    train(grads[:3], first, first_opt)
    resumed = torch.nn.Parameter(first.detach().clone())
    resumed_opt = MasterAdamW([resumed], lr=1e-2)
    resumed_opt.load_state_dict(first_opt.state_dict())
    train(grads[3:], resumed, resumed_opt)
    assert torch.equal(resumed.detach(), whole.detach())
    assert torch.equal(resumed_opt.state[resumed]["master_remainder"], whole_opt.state[whole]["master_remainder"])


_INTERPRETED = r"""
import json, os, torch
from test_master_adamw import _assert_rounding_close, _run_both
gen = torch.Generator().manual_seed(int(os.environ["SEED"]))
master, weight, reference, state, start = _run_both((7, 300), steps=6, lr=3e-3, weight_decay=0.1, gen=gen, skip_at={2})
_assert_rounding_close(master, reference, start, lr=3e-3, steps=6)
print(json.dumps({"step": float(state["step"])}))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its interpreter runs the kernel on the CPU)")
def test_triton_kernel_interpreted_matches_reference(test_seed):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(__file__), SEED=str(test_seed))
    result = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["step"] == 5, out


@pytest.mark.gpu
def test_triton_kernel_on_cuda_matches_reference():
    gen = torch.Generator().manual_seed(11)
    master, weight, reference, state, start = _run_both((1031, 517), steps=8, lr=1e-3, weight_decay=0.01, gen=gen,
                                                         device="cuda", skip_at={3})
    _assert_rounding_close(master, reference, start, lr=1e-3, steps=8)
    assert float(state["step"]) == 7
