"""The native backend as a Target (extract/target.py): Kimi-K2.5 / DeepSeek-V3, tensor parallel per group.

    torchrun --nproc-per-node 8 -m eagleforge.extract --config configs/kimi_k25_pilot.yaml
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m eagleforge.extract --config configs/kimi_k25_b300.yaml

The job's Layout (eagleforge/layout.py) cuts the world into groups of `target.tp` ranks. Every rank
loads only its slices (loader.py) and the group runs each forward together; after each block's
all-reduce all ranks of a group hold the same states, so the group's leader keeps the captured
rows (extract/capture.py) and the others only take part. The memory plan (plan.py) is checked
before any weight is read.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

import torch

from eagleforge.config import Config
from eagleforge.extract.capture import HiddenStateCapture
from eagleforge.extract.native.loader import build_model, load_weights, read_checkpoint_info
from eagleforge.extract.native.model import DeepseekV3ForExtraction
from eagleforge.extract.native.parallel import tensor_parallel
from eagleforge.extract.native.plan import GIB, check_fits, format_plan
from eagleforge.extract.target import CapturingTarget, forward_packed
from eagleforge.layout import Layout
from eagleforge.target import resolve_aux_layers, target_path, torch_dtype

log = logging.getLogger(__name__)


class NativeTarget(CapturingTarget):
    """This rank's slices of the target (a built model on its tensor-parallel group), hooks
    attached; `forward` returns the rows on the group's leader, None on its other ranks."""

    def __init__(self, model: DeepseekV3ForExtraction, layout: Layout, aux_layers: list[int], write_target_argmax: bool,
                 rows_to: str = "leader", header: dict | None = None, hf_config: dict | None = None):
        self.model, self.layout, self.device = model, layout, layout.device
        # every rank of the group holds the rows after the last all-reduce; the others drop theirs
        self.keep_rows = rows_to == "group" or layout.is_group_leader
        self.vocab_size = model.args.vocab_size
        self.write_target_argmax = write_target_argmax
        self.header, self.hf_config = header or {}, hf_config or {}
        super().__init__(model.model.layers, aux_layers, model.model.norm)

    def forward(self, input_ids: list[list[int]]) -> dict[str, torch.Tensor] | None:
        """Every rank of the group calls it with the same ids (collectives)."""
        return forward_batch(self.model, self.capture, input_ids, self.device, self.write_target_argmax, keep=self.keep_rows)


def load_native_target(cfg: Config, layout: Layout, write_target_argmax: bool, rows_to: str = "leader",
                       check_memory: Callable | None = None, check_inputs: Callable[[int], None] | None = None) -> NativeTarget:
    """The target of target.path on this rank: checkpoint info, the memory check (check_memory(info),
    default: the extraction plan's) and the caller's check_inputs(vocab_size) before any weight is
    read, then this rank's slices loaded."""
    info = read_checkpoint_info(target_path(cfg.target))
    (check_memory or (lambda i: check_extract_memory(cfg, i, layout)))(info)
    if check_inputs is not None:
        check_inputs(info.args.vocab_size)
    aux_layers = resolve_aux_layers(cfg.extract.aux_layers, info.args.num_hidden_layers)
    header = manifest_header(cfg, info, aux_layers)
    header["has_target_argmax"] = bool(write_target_argmax)
    # the raw config.json (text_config inside for Kimi): the draft is sized from it
    hf_config = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
    tp = tensor_parallel(layout, cfg.target.split_rows_min_tokens, cfg.target.overlap_min_rows)
    model = build_model(info, tp, cfg.target.expert_layout, torch_dtype(cfg.target.dtype), layout.device,
                        cfg.target.prefill_attention, cfg.target.moe_backend)
    stats = load_weights(model, info, show_progress=layout.is_main)
    log.info("rank 0 read %.2f GiB in %d tensors", stats.bytes_read / GIB, stats.tensors_read)
    return NativeTarget(model, layout, aux_layers, write_target_argmax, rows_to, header, hf_config)


def forward_batch(model: DeepseekV3ForExtraction, capture: HiddenStateCapture, input_ids: list[list[int]],
                  device: torch.device, write_target_argmax: bool, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """One right-padded forward (causal, so padding never reaches real tokens; no mask needed):
    the packed rows of target.forward_packed. `keep` = False (a group's non-leader ranks): take
    part in the forward and the argmax, return None."""
    # the argmax is a collective over the group's vocabulary shards: every rank calls it
    greedy = model.greedy_tokens if write_target_argmax else None
    packed = forward_packed(lambda tokens, mask: model(tokens), capture, input_ids, 0, device, greedy)
    return packed if keep else None


def manifest_header(cfg: Config, info, aux_layers: list[int]) -> dict:
    a = info.args
    tokenizer_config = info.path / "tokenizer_config.json"
    chat_template = None
    if tokenizer_config.is_file():
        chat_template = json.loads(tokenizer_config.read_text(encoding="utf-8")).get("chat_template")
    return {
        "target": {"path": str(info.path), "architecture": info.architecture, "num_layers": a.num_hidden_layers,
                   "hidden_size": a.hidden_size, "vocab_size": a.vocab_size},
        "aux_layer_ids": aux_layers,
        "tokenizer": str(info.path),
        "chat_template": chat_template,
        "max_length": cfg.data.max_length,
        "has_target_argmax": bool(cfg.extract.write_target_argmax),
    }


def check_extract_memory(cfg: Config, info, layout: Layout) -> None:
    """Refuse to start when the planner says the layout does not fit this GPU."""
    gpu_gib = cfg.target.gpu_memory_gib
    if gpu_gib:
        gpu_bytes = int(gpu_gib * GIB)
    elif layout.device.type == "cuda":
        gpu_bytes = torch.cuda.get_device_properties(layout.device).total_memory
    else:
        return
    plan = check_fits(cfg, info.args, info.quantized_experts, gpu_bytes)
    if layout.is_main:
        log.info("memory plan:\n%s", format_plan(plan, gpu_bytes))
