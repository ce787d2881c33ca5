"""How a target's ranks form groups: the job's Layout for a stage that runs the target (groups of
target.tp x target.pp ranks for the native backend, one rank for the hf backend), the GPU size
the memory plans fit a layout to, and target.layout=auto's choice of that split. The extract
stage and online training start their target's group here.
"""

from __future__ import annotations

import logging

import torch

from eagleforge.config import Config
from eagleforge.layout import Layout, init_layout

log = logging.getLogger(__name__)


def target_layout(cfg: Config, device: str) -> Layout:
    """The job's Layout for a stage that runs the target: groups of target.tp ranks (native
    backend; the hf backend is tp 1). On CUDA the native backend's allocator is set up first."""
    if cfg.target.backend != "native":
        return init_layout(device)
    from eagleforge.layout import use_expandable_segments

    use_expandable_segments()  # before CUDA starts (its plan's reserve assumes it)
    return init_layout(device, tp=cfg.target.tp, pp=cfg.target.pp)


def plan_gpu_bytes(cfg: Config, device: str) -> float | None:
    """The GPU size the memory plans fit a layout to: target.gpu_memory_gib, else this rank's CUDA
    device's (every rank's GPU alike; the native backend's allocator set up before CUDA starts),
    else None (the CPU)."""
    if cfg.target.gpu_memory_gib:
        return cfg.target.gpu_memory_gib * 2**30
    from eagleforge.layout import resolve_device

    if resolve_device(device).type != "cuda":
        return None
    from eagleforge.layout import resolve_rank_device, use_expandable_segments, world_size_from_env

    use_expandable_segments()
    # this rank's own GPU, made current as init_layout makes it (no CUDA context on another rank's GPU)
    return torch.cuda.get_device_properties(resolve_rank_device(device, world_size_from_env())).total_memory


def with_chosen_layout(cfg: Config, device: str, choose) -> Config:
    """cfg with target.tp and target.pp as `choose(cfg, gpu bytes) -> (tp, pp, line)` splits the
    group under target.layout=auto (native backend), the line logged once; cfg as it is otherwise.
    Every rank chooses alike (the same config, GPU size and stated rates)."""
    import dataclasses

    from eagleforge.layout import env_rank

    if cfg.target.backend != "native" or cfg.target.layout != "auto":
        return cfg
    tp, pp, line = choose(cfg, plan_gpu_bytes(cfg, device))
    if env_rank() == 0:
        log.info("%s", line)
    return dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, tp=tp, pp=pp))
