"""Where each process sits in a job: the one parallel layout of every stage (extract, train).

    world = groups x pp x tp        rank = group * (pp * tp) + stage * tp + tp_rank

A *group* holds one copy of the target and works on its own slice of the samples (data
parallelism: adding nodes adds groups). Inside a group the target's layers are cut into `pp`
pipeline *stages* of consecutive layers, and each stage's layers are split over `tp` ranks
(tensor parallelism). The tp ranks of a stage are neighbours in rank order, so on one node they
are neighbouring GPUs. The group's *leader* is the rank that ends up holding the group's
outputs (the captured rows and the greedy tokens): tp rank 0 of the last stage; it writes the
group's shards. The trainer's draft spans the whole world (every rank trains it under FSDP2),
whatever tp and pp the target uses.

Outside torchrun (WORLD_SIZE unset or 1) no process group exists and every helper here is a
plain local operation. Under torchrun the default process group is created from torchrun's
env:// variables (NCCL bound to the rank's GPU on CUDA, gloo on the CPU) unless the caller made
one (tests, notebooks), which is then used and left alone. `Layout.shutdown` ends a group that
`init_layout` created.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch

from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)

# Long enough for the slowest work one rank does between two collectives: writing a large
# draft's checkpoint or a shard of hidden states to slow shared storage, loading a target's
# slices from a network disk.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=60)


def world_size_from_env() -> int:
    """WORLD_SIZE from torchrun's environment (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    """RANK from torchrun's environment (0 outside torchrun), readable before any process group."""
    return int(os.environ.get("RANK", "0"))


def join_process_group(device: torch.device) -> bool:
    """Create the default process group from torchrun's env:// variables (NCCL bound to `device` on
    CUDA, gloo on the CPU) unless one exists already (a caller's, or a test's); True when it was
    created here, so that the caller also destroys it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if device.type == "cuda":
        dist.init_process_group("nccl", timeout=PROCESS_GROUP_TIMEOUT, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    return True


@dataclass(frozen=True)
class Layout:
    """This process's coordinates in the job and its process groups. The defaults are one
    process: rank 0 of a world of one, one group, one stage, no tensor parallelism."""

    world_size: int = 1
    rank: int = 0
    tp: int = 1
    pp: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local_rank: int = 0
    # The torch.distributed ProcessGroup of this rank's tp ranks (same group and stage) when tp > 1.
    tp_group: object = None
    owns_process_group: bool = False  # True when init_layout created it (and shutdown ends it)

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise UserInputError(f"target.tp x target.pp = {self.tp} x {self.pp} does not divide the world size "
                                 f"{self.world_size} (torchrun --nproc-per-node x --nnodes)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")

    # -- coordinates

    @property
    def group_size(self) -> int:
        """Ranks holding one copy of the target: pp x tp."""
        return self.tp * self.pp

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    @property
    def group_index(self) -> int:
        return self.rank // self.group_size

    @property
    def stage(self) -> int:
        return self.rank % self.group_size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def rank_of(self, group: int, stage: int, tp_rank: int = 0) -> int:
        """The global rank at those coordinates."""
        return group * self.group_size + stage * self.tp + tp_rank

    @property
    def group_ranks(self) -> list[int]:
        """The global ranks of this rank's group, in rank order."""
        first = self.group_index * self.group_size
        return list(range(first, first + self.group_size))

    @property
    def leader(self) -> int:
        """The global rank of this group's leader: tp rank 0 of the last stage."""
        return self.rank_of(self.group_index, self.pp - 1, 0)

    @property
    def is_group_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # -- collectives over the whole world (no-ops in one process)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` (a small picklable value), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s `obj` (a small picklable value: a path, a string) on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_reduce_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A summed copy of `tensor` over all ranks, on its device (no host sync with NCCL)."""
        out = tensor.clone()
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(out)
        return out

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of a list of numbers over all ranks (float64 on the collective's device)."""
        if not self.distributed:
            return list(values)
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def shutdown(self) -> None:
        """Destroy the process group if init_layout created it."""
        if self.owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments() -> bool:
    """Ask the CUDA caching allocator for expandable segments, unless the user configured it
    (any of ALLOC_CONF_VARS) or CUDA already runs in this process (the setting is read once).
    Called by the stages that use CUDA before it starts (the target's and the trainer's memory
    plans assume it). A target layer's forward and a draft step allocate GiBs of transients of
    many sizes; with fixed segments the cache held a multiple of the activation peak besides it (measured: BENCHMARKS.md, "Smaller
    measurements the code's choices rest on"), memory the planner could not count on. True if
    set here."""
    # torch reads the first of these that is set (PYTORCH_ALLOC_CONF is the newer name)
    if any(name in os.environ for name in ALLOC_CONF_VARS) or torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


def resolve_device(name: str) -> torch.device:
    """A device key ("auto", "cpu", "cuda", "cuda:N"): auto = the GPU when there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_rank_device(name: str, world_size: int) -> torch.device:
    """The device key ("auto", "cpu", "cuda", "cuda:N") as this rank's device: under torchrun
    (or for a bare "cuda") a GPU is cuda:LOCAL_RANK, made the current device."""
    device = resolve_device(name)
    if device.type == "cuda":
        if world_size > 1 or device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def init_layout(device: str = "auto", tp: int = 1, pp: int = 1) -> Layout:
    """This process's Layout: joins torchrun's world (NCCL on CUDA, gloo on the CPU) unless it is
    one process, and builds the tensor-parallel groups; every rank must call it (each rank takes
    part in creating every group)."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else world_size_from_env()
    if world <= 1 and not initialized:
        return Layout(tp=tp, pp=pp, device=resolve_rank_device(device, 1))
    resolved = resolve_rank_device(device, world)
    owns = join_process_group(resolved)
    layout = layout_of_world(tp, pp, resolved, owns)
    if layout.is_main:
        log.info("distributed: %d ranks (%d groups x pp %d x tp %d), backend %s, device %s on rank 0", layout.world_size,
                 layout.num_groups, pp, tp, dist.get_backend(), resolved)
    return layout


def layout_of_world(tp: int, pp: int, device: torch.device, owns_process_group: bool = False) -> Layout:
    """The Layout of this rank in the existing default process group, its tp groups created
    (collectively: every rank calls this with the same tp and pp)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    Layout(world_size=world, rank=rank, tp=tp, pp=pp)  # checks that tp x pp divides the world, before any group
    tp_group = None
    if tp > 1:
        for first in range(0, world, tp):  # one group per (data group, stage), in rank order
            group = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                tp_group = group
    return Layout(world_size=world, rank=rank, tp=tp, pp=pp, device=device,
                  local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                  tp_group=tp_group, owns_process_group=owns_process_group)
