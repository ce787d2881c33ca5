"""Activation checkpointing of one TTT step of the draft (training only; serving never uses it).

Modes per TTT step (eagleforge/modes.py CHECKPOINT_MODES):
    none           keep every activation (most memory, no recompute)
    step           keep only the step's inputs and outputs; the backward reruns the whole step
    selective      torch.utils.checkpoint with a selective policy: the outputs of the matmuls whose
                   inner dimension exceeds H (q/k/v from 2H, o_proj from heads*D, down from the
                   intermediate: ~2/3 of the step's matmul FLOPs) and of the flash attention
                   kernel are kept; norms, RoPE, SiLU, the attention merge and gate/up recomputed
    selective_all  the same, keeping every matmul output (gate/up too): no matmul recomputed
With compile=True the fused elementwise kernels run (and rerun) inside the checkpoint; the policy
only ever sees the eager matmuls and attention kernels.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from eagleforge.modes import CHECKPOINT_MODES


def _flash_ops() -> tuple:
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_efficient_attention")
    return tuple(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


def selective_policy(hidden_size: int, save_all_matmuls: bool):
    """Policy for torch.utils.checkpoint.create_selective_checkpoint_contexts: MUST_SAVE the
    outputs of aten.mm/addmm (those with inner dimension > hidden_size unless save_all_matmuls)
    and of the flash attention ops; PREFER_RECOMPUTE everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    attention = _flash_ops()

    def policy(ctx, func, *args, **kwargs):
        if func in attention:
            return CheckpointPolicy.MUST_SAVE
        if func in matmuls:
            inner = args[-1].shape[-2]  # mm(a [M, K], b [K, N]); addmm(bias, a, b); bmm(.., [K, N])
            if save_all_matmuls or inner > hidden_size:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context(hidden_size: int, save_all_matmuls: bool):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy(hidden_size, save_all_matmuls))


def checkpointed(step: Callable, mode: str, hidden_size: int) -> Callable:
    """`step` wrapped for one of CHECKPOINT_MODES (hidden_size: the draft's H, which decides the
    selective policy's wide matmuls)."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint {mode!r} is not one of {CHECKPOINT_MODES}")
    if mode == "none":
        return step
    if mode == "step":
        return lambda *args: activation_checkpoint(step, *args, use_reentrant=False)
    context = functools.partial(_selective_context, hidden_size, mode == "selective_all")
    return lambda *args: activation_checkpoint(step, *args, use_reentrant=False, context_fn=context)
