"""Everything distributed about training, in one place: process group, FSDP2/DDP wrapping, the
loss-in-forward module, gradient sync, norms and small collectives.

One process (no WORLD_SIZE, or WORLD_SIZE=1) needs no torch.distributed at all: `init_distributed`
returns a single-rank `DistEnv` and every helper here is then a plain local operation. Under
torchrun (WORLD_SIZE > 1) it initializes the default process group from the env:// variables
(nccl on CUDA with rank r on cuda:LOCAL_RANK, gloo on the CPU).

Parallel layouts (`train.parallel`):
    none   one process, the module as it is
    fsdp   FSDP2: fully_shard of the root DraftWithLoss (see _fully_shard for why one unit),
           mixed precision bf16 parameters / fp32 gradient reduction when train.bf16 (fp32
           master weights stay sharded and the optimizer steps them); the frozen embed_tokens
           is left out of sharding (ignored_params: replicated, never gathered or reduced)
    ddp    DistributedDataParallel over fp32 parameters (bf16 autocast as in one process)
    auto   fsdp when the world has more than one rank, else none

The loss runs INSIDE the root module's forward (`DraftWithLoss`): FSDP gathers a module's
parameters only around its forward, and the fused TTT loss reads lm_head.weight directly, so
lm_head (in the root's group) is gathered only there.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from eagleforge.config import UserInputError
from eagleforge.modes import PARALLEL_MODES
from eagleforge.process_group import join_process_group, world_size_from_env
from eagleforge.target import resolve_device

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. rank 0 of a single-process run is the whole world."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_process_group: bool = False  # True when init_distributed created it (and shutdown ends it)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_rank() -> int:
    """RANK from torchrun's environment (0 outside torchrun), readable before any process group."""
    return int(os.environ.get("RANK", "0"))


def init_distributed(device: str = "auto") -> DistEnv:
    """The DistEnv of this process; under torchrun (WORLD_SIZE > 1) the default process group is
    created here unless the caller already made one (tests, notebooks), which is then reused."""
    import torch.distributed as dist

    world = world_size_from_env()
    if world <= 1 and not (dist.is_available() and dist.is_initialized()):
        return DistEnv(device=resolve_device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        resolved = torch.device("cuda", local_rank)
        torch.cuda.set_device(resolved)
    owns = join_process_group(resolved)
    env = DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, resolved, owns)
    if env.is_main:
        log.info("distributed: %d ranks, backend %s, device %s on rank 0", env.world_size, dist.get_backend(), resolved)
    return env


def shutdown(env: DistEnv) -> None:
    """Destroy the process group if init_distributed created it."""
    if env.owns_process_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        import torch.distributed as dist

        dist.barrier()


def broadcast_object(obj, env: DistEnv):
    """rank 0's `obj` on every rank (a small picklable value: a path, a string)."""
    if not env.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj, env: DistEnv) -> list:
    """Every rank's `obj` (a small picklable value), in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    import torch.distributed as dist

    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_tensor(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """A summed copy of `tensor` over all ranks, on its device (no host sync with NCCL)."""
    out = tensor.clone()
    if env.distributed:
        import torch.distributed as dist

        dist.all_reduce(out)
    return out


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Element-wise sum of a list of numbers over all ranks (float64 on the collective's device)."""
    if not env.distributed:
        return list(values)
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


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


def resolve_parallel(mode: str, env: DistEnv) -> str:
    """'auto' -> fsdp on more than one rank, else none; fsdp/ddp on one process -> none."""
    if mode not in PARALLEL_MODES:
        raise UserInputError(f"config key 'train.parallel' must be one of {list(PARALLEL_MODES)}, got {mode!r}")
    if mode == "auto":
        return "fsdp" if env.distributed else "none"
    if mode != "none" and not env.distributed:
        log.info("train.parallel=%s on a single process: training unwrapped (launch with torchrun for more ranks)", mode)
        return "none"
    return mode


def parallelize(module: DraftWithLoss, env: DistEnv, mode: str, bf16: bool) -> nn.Module:
    """Wrap `module` (already on env.device) for `mode` (resolve_parallel's answer)."""
    if mode == "none":
        return module
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [env.device.index] if env.device.type == "cuda" else None
        # broadcast_buffers: d2t/t2d never change; the frozen embedding is not a gradient bucket.
        return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)
    if mode == "fsdp":
        return _fully_shard(module, env, bf16)
    raise ValueError(f"parallelize: unknown mode {mode!r}")


def _fully_shard(module: DraftWithLoss, env: DistEnv, bf16: bool) -> nn.Module:
    """FSDP2 over the whole draft as one unit (the root).

    Why not one unit per block: the draft has one block (midlayer) and the TTT forward runs it
    K times through methods the draft calls itself (Eagle3Draft.ttt_step reads the layer's
    weights directly), which no forward hook of a sub-unit sees. A per-block unit would have to
    stay gathered from its first use to the end of the backward anyway, so one root unit
    gathers the same bytes once per forward (all-gather of the bf16 weights, reduce-scatter of
    the fp32 gradients: at Kimi's draft ~2 GB and ~4 GB per step, a few ms on NVLink against
    a step of ~1 s at 8192 tokens per GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    # Inputs are left as they come (cast_forward_inputs=False): the loss reads the teacher's
    # states in fp32 and autocast picks the matmul dtype, as in one process.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32,
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
