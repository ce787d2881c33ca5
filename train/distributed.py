"""Everything distributed about training the draft, in one place: FSDP2/DDP wrapping, the
loss-in-forward module, gradient sync and norms. Where each rank sits, its process groups and
the small collectives are the job's one Layout (eagleforge/layout.py); one process needs no
torch.distributed at all.

Parallel layouts (`train.parallel`):
    none   one process, the module as it is
    fsdp   FSDP2: fully_shard of the root DraftWithLoss (see _fully_shard for why one unit),
           bf16 parameters gathered when train.bf16 (fp32 ones cast for the gather; the
           optimizer steps the sharded weights); gradients reduced in fp32 for fp32 parameters
           and in bf16 for bf16 ones (their gradients are bf16 already: see _fully_shard); the
           frozen embed_tokens is left out of sharding (ignored_params: replicated, never
           gathered or reduced)
    ddp    DistributedDataParallel over fp32 parameters (bf16 autocast as in one process)
    auto   fsdp when the world has more than one rank, else none

The loss runs INSIDE the root module's forward (`DraftWithLoss`): FSDP gathers a module's
parameters only around its forward, and the fused TTT loss reads lm_head.weight directly, so
lm_head (in the root's group) is gathered only there.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
from torch import nn

from eagleforge.errors import UserInputError
from eagleforge.layout import Layout
from eagleforge.modes import PARALLEL_MODES

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------- the module


class DraftWithLoss(nn.Module):
    """The unit FSDP/DDP wrap: forward = the draft's TTT forward AND the loss.

    `loss(draft, *inputs) -> (loss, stats)` is the trainer's TTT loss (train/loop.py TTTLoss);
    it is a plain callable, not a module, so its tensors (the teacher head) are neither
    sharded nor checkpointed. The state dict is the draft's under the prefix `draft.`.
    """

    def __init__(self, draft: nn.Module, loss: Callable):
        super().__init__()
        self.draft = draft
        self.loss = loss

    def forward(self, *inputs):
        return self.loss(self.draft, *inputs)


def resolve_parallel(mode: str, layout: Layout) -> str:
    """'auto' -> fsdp on more than one rank, else none; fsdp/ddp on one process -> none."""
    if mode not in PARALLEL_MODES:
        raise UserInputError(f"config key 'train.parallel' must be one of {list(PARALLEL_MODES)}, got {mode!r}")
    if mode == "auto":
        return "fsdp" if layout.distributed else "none"
    if mode != "none" and not layout.distributed:
        log.info("train.parallel=%s on a single process: training unwrapped (launch with torchrun for more ranks)", mode)
        return "none"
    return mode


def reduce_dtype_of(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 reduce-scatters gradients in: bf16 for bf16 parameters, whose gradients
    the GEMMs already accumulate and keep in bf16 (an fp32 reduce would round the same bf16 sum
    once at the end instead of at each hop, for an fp32 copy of every gradient: 4 bytes per
    trainable parameter at the end of the backward instead of 2); fp32 otherwise."""
    return torch.bfloat16 if param_dtype == torch.bfloat16 else torch.float32


def parallelize(module: DraftWithLoss, layout: Layout, mode: str, bf16: bool,
                reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Wrap `module` (already on layout.device) for `mode` (resolve_parallel's answer); FSDP2
    reduce-scatters the gradients in `reduce_dtype` (reduce_dtype_of the parameters')."""
    if mode == "none":
        return module
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [layout.device.index] if layout.device.type == "cuda" else None
        # broadcast_buffers: d2t/t2d never change; the frozen embedding is not a gradient bucket.
        return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)
    if mode == "fsdp":
        return _fully_shard(module, layout, bf16, reduce_dtype)
    raise ValueError(f"parallelize: unknown mode {mode!r}")


def _fully_shard(module: DraftWithLoss, layout: Layout, bf16: bool, reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """FSDP2 over the whole draft as one unit (the root).

    Why not one unit per block: the draft has one block (midlayer) and the TTT forward runs it
    K times through methods the draft calls itself (Eagle3Draft.ttt_step reads the layer's
    weights directly), which no forward hook of a sub-unit sees. A per-block unit would have to
    stay gathered from its first use to the end of the backward anyway, so one root unit
    gathers the same bytes once per forward (all-gather of the bf16 weights, reduce-scatter of
    the gradients: at Kimi's draft ~2 GB each per step in bf16, a few ms on NVLink against a
    step of ~1 s at 8192 tokens per GPU).

    Memory at the end of the backward (torch's foreach_reduce): the gathered weights are freed
    first, then the unsharded gradients [P] are copied into one reduce-scatter input [P] of
    `reduce_dtype` and freed: 2 + 2 bytes per trainable parameter at that moment with bf16
    parameters, 2 + 4 with an fp32 reduce (train/online_plan.py counts it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(layout.device.type, (layout.world_size,))
    # Inputs are left as they come (cast_forward_inputs=False): the loss reads the teacher's
    # states in fp32 and autocast picks the matmul dtype, as in one process.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce_dtype,
                                  cast_forward_inputs=False)
    # embed_tokens is frozen and only indexed: replicated on every rank, never gathered or reduced.
    fully_shard(module, mesh=mesh, mp_policy=policy, ignored_params={module.draft.embed_tokens.weight})
    return module


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Gradient accumulation: reduce gradients across ranks only on the last micro-batch."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync") and not enabled:  # DDP
        with model.no_sync():
            yield
    else:
        yield


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over local or sharded (DTensor) gradients; the global norm as a 0-dim
    tensor on the gradients' device (float() it when it is logged: reading it every step would
    make the host wait for the GPU every step)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # DTensor: the partial norms are reduced here
        norm = norm.full_tensor()
    return norm.detach()
