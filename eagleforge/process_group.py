"""The one process-group setup of every stage that runs under torchrun (extract's backends, train).

Outside torchrun (WORLD_SIZE unset or 1) nothing is created and every stage runs as one process.
"""

from __future__ import annotations

import datetime
import os

import torch

# Long enough for the slowest work one rank does between two collectives: writing a large
# draft's checkpoint or a shard of hidden states to slow shared storage, loading a target's
# slices from a network disk.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=60)


def world_size_from_env() -> int:
    """WORLD_SIZE from torchrun's environment (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


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
