"""The native extraction stage: Kimi-K2.5 / DeepSeek-V3 under torchrun, tensor parallel per group.

    torchrun --nproc-per-node 8 -m eagleforge.extract --config configs/kimi_k25_pilot.yaml
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m eagleforge.extract --config configs/kimi_k25_b300.yaml

The world is cut into groups of `target.tp` ranks (parallel.py). Every rank loads only its slices
(loader.py); a group runs the forward together; after each block's all-reduce all ranks of a group
hold the same states, so the group's first rank captures them (extract/capture.py) and writes the
group's shards (eagleforge/shards.py). Samples are cut into fixed chunks of `extract.samples_per_shard`
in id order; chunk c belongs to group c % groups (the hf backend's rule, so shards and resume
behave the same). Rank 0 merges the groups' manifest parts at the end.

Input: RUN/data/samples.jsonl from the data stage, or, when that file is absent, the pre-tokenized
JSONL named by data.source ({"input_ids": [...], "loss_mask": [...]}, loss_mask optional), read
directly so a Kimi run needs no tokenizer on the extraction nodes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eagleforge.config import Config, UserInputError, save_config
from eagleforge.extract.capture import HiddenStateCapture
from eagleforge.extract.hf import batch_by_tokens, check_samples, log_extraction_summary
from eagleforge.extract.native.loader import build_model, load_weights, read_checkpoint_info
from eagleforge.extract.native.model import DeepseekV3ForExtraction
from eagleforge.extract.native.parallel import ParallelState, barrier, gather_objects, init_parallel, shutdown
from eagleforge.extract.native.plan import GIB, check_fits, format_plan
from eagleforge.extract.writer import BatchRows, ShardSink, make_writer, writer_summary
from eagleforge.shards import ShardWriter, load_manifest, merge_manifests
from eagleforge.target import resolve_aux_layers, target_path, torch_dtype

log = logging.getLogger(__name__)


def extract_native(cfg: Config) -> dict | None:
    """Extract every sample into RUN/hidden/ with the native backend; rank 0 returns the manifest."""
    state = init_parallel(cfg.target.tp, cfg.target.device, cfg.target.split_rows_min_tokens, cfg.target.overlap_min_rows)
    if not state.is_main:
        logging.getLogger("eagleforge").setLevel(logging.WARNING)  # logs from rank 0 only
    try:
        return _extract(cfg, state)
    finally:
        shutdown(state)


def load_samples_native(cfg: Config) -> list[dict]:
    """Rows {"id", "input_ids", "loss_mask"} as read: the data stage's file, else data.source.

    `check_samples` (ids, token range, mask, data.max_length) runs once the vocabulary is known.
    """
    path = cfg.run / "data" / "samples.jsonl"
    if not path.is_file() and cfg.data.source.endswith(".jsonl") and Path(cfg.data.source).is_file():
        path = Path(cfg.data.source)
    if not path.is_file():
        raise FileNotFoundError(f"{cfg.run / 'data' / 'samples.jsonl'}: no samples (run the data stage, or set data.source to a pre-tokenized JSONL)")
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as err:
            raise UserInputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as err:
            raise UserInputError(f"{path} line {line_no}: not JSON ({getattr(err, 'msg', type(err).__name__)})") from None
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if not isinstance(ids, list) or not ids:
            raise UserInputError(f"{path} line {line_no}: no 'input_ids' list (the native backend reads token ids)")
        mask = row.get("loss_mask", [1] * len(ids))
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise UserInputError(f"{path} line {line_no}: {len(ids)} input_ids but loss_mask {str(mask)[:40]}")
        rows.append({"id": row.get("id", line_no - 1), "input_ids": ids, "loss_mask": mask})
    return rows


def samples_source(cfg: Config) -> Path:
    path = cfg.run / "data" / "samples.jsonl"
    return path if path.is_file() else Path(cfg.data.source)


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


def _check_memory(cfg: Config, info, state: ParallelState) -> None:
    """Refuse to start when the planner says the layout does not fit this GPU."""
    gpu_gib = cfg.target.gpu_memory_gib
    if gpu_gib:
        gpu_bytes = int(gpu_gib * GIB)
    elif state.device.type == "cuda":
        gpu_bytes = torch.cuda.get_device_properties(state.device).total_memory
    else:
        return
    plan = check_fits(cfg, info.args, info.quantized_experts, gpu_bytes)
    if state.is_main:
        log.info("memory plan:\n%s", format_plan(plan, gpu_bytes))


def _extract(cfg: Config, state: ParallelState) -> dict | None:
    start_s = time.perf_counter()
    info = read_checkpoint_info(target_path(cfg.target))
    _check_memory(cfg, info, state)
    if state.is_main:
        save_config(cfg, cfg.run / "config.yaml")
    samples = check_samples(load_samples_native(cfg), samples_source(cfg), info.args.vocab_size,
                            cfg.data.max_length, cfg.data.overlong)
    aux_layers = resolve_aux_layers(cfg.extract.aux_layers, info.args.num_hidden_layers)
    model = build_model(info, state.tp, cfg.target.expert_layout, torch_dtype(cfg.target.dtype), state.device,
                        cfg.target.prefill_attention, cfg.target.moe_backend)
    stats = load_weights(model, info, show_progress=state.is_main)
    log.info("rank 0 read %.2f GiB in %d tensors", stats.bytes_read / GIB, stats.tensors_read)
    size = cfg.extract.samples_per_shard
    chunks = [samples[i:i + size] for i in range(0, len(samples), size)]
    mine = [c for c in range(len(chunks)) if c % state.num_groups == state.group_index]
    writer = None
    todo = None
    if state.is_group_leader:
        writer = ShardWriter(cfg.run / "hidden", manifest_header(cfg, info, aux_layers), cfg.extract.storage_dtype,
                             group=state.group_index if state.num_groups > 1 else None)
        todo = [c for c in mine if not writer.is_complete(c, [row["id"] for row in chunks[c]], chunks[c])]
    # the group's other ranks follow their leader's list (collectives need the same forwards)
    todo = gather_objects(state, todo)[state.group_index * state.tp.size]
    log.info("%d samples in %d chunks, %d groups of tp %d (%s experts); group 0 has %d chunks to do; aux layers %s",
             len(samples), len(chunks), state.num_groups, state.tp.size, cfg.target.expert_layout, len(todo), aux_layers)
    total_tokens = sum(len(row["input_ids"]) for c in todo for row in chunks[c])
    # Only the group leader writes: its writer thread copies and writes chunk c while the group
    # runs the forwards of chunk c+1. The other ranks take part in the forwards and keep nothing.
    sink = ShardSink(writer) if writer is not None else None
    out = make_writer(sink, cfg.extract.overlap_writes) if sink is not None else None
    with HiddenStateCapture(model.model.layers, aux_layers, model.model.norm) as capture, \
            (out if out is not None else contextlib.nullcontext()), \
            tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="extract", disable=not state.is_main) as progress:
        for c in todo:
            extract_chunk(model, capture, c, chunks[c], cfg, state, out, progress)
        if out is not None:
            log.info(writer_summary(out.close(), time.perf_counter() - start_s))
    barrier(state)
    if not state.is_main:
        return None
    hidden_dir = cfg.run / "hidden"
    manifest = merge_manifests(hidden_dir) if state.num_groups > 1 else load_manifest(hidden_dir)
    log_extraction_summary(manifest, hidden_dir, sink.skipped if sink is not None else 0, time.perf_counter() - start_s)
    return manifest


@torch.inference_mode()
def forward_batch(model: DeepseekV3ForExtraction, capture: HiddenStateCapture, input_ids: list[list[int]],
                  device: torch.device, write_target_argmax: bool, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """One right-padded forward (causal, so padding never reaches real tokens); the samples'
    unpadded rows packed end to end, on `device`: aux_hidden_states [sum n, k*H],
    last_hidden_state [sum n, H], target_argmax [sum n] int32 when asked.

    `keep` = False (a group's non-leader ranks): take part in the forward and the argmax, return None.
    """
    lengths = [len(ids) for ids in input_ids]
    tokens = torch.zeros(len(input_ids), max(lengths), dtype=torch.long)
    for b, ids in enumerate(input_ids):
        tokens[b, :lengths[b]] = torch.tensor(ids, dtype=torch.long)
    capture.clear()
    model(tokens.to(device))
    aux, last = capture.aux_hidden_states, capture.last_hidden_state  # [B, T, k*H], [B, T, H]
    capture.clear()
    # Unpadded rows by slicing (lengths are known on the host): no device sync.
    packed = {"aux_hidden_states": torch.cat([aux[b, :n] for b, n in enumerate(lengths)]),
              "last_hidden_state": torch.cat([last[b, :n] for b, n in enumerate(lengths)])}
    del aux, last  # the padded copies are not needed by the argmax: its logits take their place
    if write_target_argmax:
        # a collective over the group's vocabulary shards: every rank calls it
        packed["target_argmax"] = model.greedy_tokens(packed["last_hidden_state"])  # [sum n]
    return packed if keep else None


def extract_chunk(model, capture, index: int, chunk: list[dict], cfg: Config, state: ParallelState,
                  writer=None, progress: tqdm | None = None) -> None:
    """Forward chunk `index` batch by batch (all ranks of a group); the leader submits each batch's
    rows to `writer` (a ShardSink behind OverlappedWriter / InlineWriter writes the shard)."""
    lengths = [len(row["input_ids"]) for row in chunk]
    for positions in batch_by_tokens(lengths, cfg.extract.batch_tokens):
        packed = forward_batch(model, capture, [chunk[j]["input_ids"] for j in positions], state.device,
                               cfg.extract.write_target_argmax, keep=writer is not None)
        if writer is not None:
            writer.submit(packed, BatchRows(index, chunk, positions))
        if progress is not None:
            progress.update(sum(lengths[j] for j in positions))
