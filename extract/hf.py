"""The hf extraction backend: any transformers causal LM, hooks, sharded safetensors.

    python -m eagleforge.extract run_dir=runs/x                       # one process
    torchrun --nproc-per-node 8 -m eagleforge.extract run_dir=runs/x  # 8 data-parallel groups

Samples (RUN/data/samples.jsonl, id order) are cut into fixed chunks of
`extract.samples_per_shard`; chunk c is shard c and belongs to group c % world_size (each rank
is a group here, tp = 1). Within a chunk, samples are sorted by length and batched up to
`extract.batch_tokens` padded tokens, right padded with an attention mask; the base model
(`model.model`) runs under HiddenStateCapture, so neither the full logits nor all L + 1 hidden
states are ever materialized. `target_argmax` comes from the captured final state through the
lm_head, a few rows at a time. Because a chunk's batches depend only on the chunk, a killed and
resumed run (or a run on another number of processes) writes the same shards; resume skips the
chunks the manifests already list.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eagleforge.config import Config, UserInputError, save_config
from eagleforge.extract.capture import HiddenStateCapture
from eagleforge.extract.writer import BatchRows, ShardSink, make_writer, writer_summary
from eagleforge.process_group import join_process_group, world_size_from_env
from eagleforge.shards import ShardWriter, load_manifest, merge_manifests
from eagleforge.target import decoder_layers, final_norm, load_target, padding_id, resolve_aux_layers, resolve_device, target_path, text_config

log = logging.getLogger(__name__)

# Rows of last_hidden_state per lm_head matmul for target_argmax: keeps the transient logits
# chunk at about 2**24 elements (64 MiB fp32) whatever the vocabulary (341 rows for SmolLM2's
# 49152, 102 for Kimi's 163840: still large matmuls).
ARGMAX_CHUNK_ELEMENTS = 1 << 24


def init_distributed(device: torch.device) -> tuple[int, int, bool]:
    """(rank, world_size, initialized_here); joins the torchrun process group when WORLD_SIZE > 1."""
    if world_size_from_env() <= 1:
        return 0, 1, False
    import torch.distributed as dist

    created = join_process_group(device)
    return dist.get_rank(), dist.get_world_size(), created


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def check_samples(rows: list[dict], source: Path | str, vocab_size: int, max_length: int,
                  overlong: str = "truncate") -> list[dict]:
    """Rows in id order, each checked, before any forward: a bad row is a UserInputError naming
    `source` and the sample, never an IndexError deep inside the target's embedding.

    Checked: integer ids (not bool), unique; a non-empty input_ids list of ints in [0, vocab_size);
    a loss_mask of 0/1 of the same length. Rows longer than `max_length` (data.max_length, which
    the manifest records) are cut to it (overlong "truncate") or left out ("drop"), and counted.
    """
    checked, seen, cut, dropped = [], set(), 0, []
    for row in rows:
        sample_id = row.get("id") if isinstance(row, dict) else None
        if type(sample_id) is not int:
            raise UserInputError(f"{source}: sample id {sample_id!r:.40} is not an integer")
        if sample_id in seen:
            raise UserInputError(f"{source}: sample id {sample_id} appears twice")
        seen.add(sample_id)
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        where = f"{source}: sample {sample_id}"
        if not isinstance(ids, list) or not ids:
            raise UserInputError(f"{where}: input_ids must be a non-empty list, got {str(ids)[:40]}")
        bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]
        if bad:
            raise UserInputError(f"{where}: token id {bad[0]!r:.40} is not in the target's vocabulary [0, {vocab_size})")
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(type(m) is int and m in (0, 1) for m in mask):
            raise UserInputError(f"{where}: loss_mask must be {len(ids)} values of 0 or 1, got {str(mask)[:60]}")
        if len(ids) > max_length:
            if overlong == "drop":
                dropped.append(sample_id)
                continue
            cut += 1
            ids, mask = ids[:max_length], mask[:max_length]
        checked.append({"id": sample_id, "input_ids": ids, "loss_mask": mask})
    if cut or dropped:
        log.warning("%s: %d samples longer than data.max_length=%d truncated, %d dropped%s", source, cut,
                    max_length, len(dropped), f" (ids {dropped[:10]})" if dropped else "")
    return sorted(checked, key=lambda row: row["id"])


def batch_by_tokens(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Positions grouped into batches of at most `batch_tokens` padded tokens, longest first.

    Sorting by length keeps padding small; a sample longer than the budget gets a batch alone.
    Deterministic: ties keep their input order.
    """
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    batches: list[list[int]] = []
    for j in order:
        # Sorted longest first, so the batch's padded length is its first sample's length.
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


@torch.inference_mode()
def forward_batch(model, capture: HiddenStateCapture, input_ids: list[list[int]], pad_id: int,
                  device: torch.device, write_target_argmax: bool) -> dict[str, torch.Tensor]:
    """One right-padded forward of the base model; the samples' unpadded rows packed end to end.

    Returns, on `device` (no host sync: the copy to the host is the writer's, overlapped),
    aux_hidden_states [sum n, k*H], last_hidden_state [sum n, H] (compute dtype) and
    target_argmax [sum n] int32 when asked; sample b is rows sum(n[:b]) : sum(n[:b+1])
    (`extract.writer.split_rows`).
    """
    lengths = [len(ids) for ids in input_ids]
    batch, width = len(input_ids), max(lengths)
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for b, ids in enumerate(input_ids):
        tokens[b, : lengths[b]] = torch.tensor(ids, dtype=torch.long)
        mask[b, : lengths[b]] = 1
    capture.clear()
    # The base model (model.model for Llama): the decoder stack without the lm_head, so no
    # [B, T, V] logits are computed.
    base = getattr(model, "base_model", model)
    base(input_ids=tokens.to(device), attention_mask=mask.to(device), use_cache=False)
    # Under target.device_map the aux layers and the final norm may sit on other devices than
    # `device` (other GPUs, or the CPU for offloaded ones): the rows are gathered on `device`.
    aux, last = capture.aux_hidden_states.to(device), capture.last_hidden_state.to(device)  # [B, T, k*H], [B, T, H]
    capture.clear()
    # Unpadded rows by slicing (lengths are known on the host): unlike a boolean mask, no sync.
    packed = {"aux_hidden_states": torch.cat([aux[b, :n] for b, n in enumerate(lengths)]),  # [sum n, k*H]
              "last_hidden_state": torch.cat([last[b, :n] for b, n in enumerate(lengths)])}  # [sum n, H]
    if write_target_argmax:
        packed["target_argmax"] = _target_argmax(model, packed["last_hidden_state"])  # [sum n]
    return packed


def _target_argmax(model, last_hidden: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary greedy next token, [N, H] -> [N] int32, in row chunks of the lm_head."""
    head = model.get_output_embeddings()
    if head is None:
        raise UserInputError(f"{type(model).__name__} has no output embeddings: set extract.write_target_argmax=false")
    rows = max(1, ARGMAX_CHUNK_ELEMENTS // head.weight.shape[0])
    # Logit scaling or soft-capping some models apply after the head is monotonic: same argmax.
    # Under target.device_map the head may sit on another device (its hook moves the rows there).
    parts = [head(last_hidden[i : i + rows]).argmax(-1).to(last_hidden.device) for i in range(0, last_hidden.shape[0], rows)]
    if not parts:
        return torch.zeros(0, dtype=torch.int32, device=last_hidden.device)
    return torch.cat(parts).to(torch.int32)


def manifest_header(cfg: Config, model, tokenizer, aux_layers: list[int]) -> dict:
    config = text_config(model.config)
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    return {
        "target": {
            "path": str(target_path(cfg.target)),
            "architecture": architectures[0],
            "num_layers": int(config.num_hidden_layers),
            "hidden_size": int(config.hidden_size),
            "vocab_size": int(config.vocab_size),
        },
        "aux_layer_ids": aux_layers,
        "tokenizer": getattr(tokenizer, "name_or_path", "") if tokenizer is not None else "",
        "chat_template": getattr(tokenizer, "chat_template", None) if tokenizer is not None else None,
        "max_length": cfg.data.max_length,
        "has_target_argmax": bool(cfg.extract.write_target_argmax),
    }


def extract_chunk(model, capture, index: int, chunk: list[dict], cfg: Config, pad_id: int, device: torch.device,
                  writer, progress: tqdm | None = None) -> None:
    """Forward chunk `index` (rows in id order) batch by batch and submit each batch's rows to
    `writer` (OverlappedWriter or InlineWriter around a ShardSink, which writes the shard)."""
    lengths = [len(row["input_ids"]) for row in chunk]
    for positions in batch_by_tokens(lengths, cfg.extract.batch_tokens):
        packed = forward_batch(model, capture, [chunk[j]["input_ids"] for j in positions], pad_id, device,
                               cfg.extract.write_target_argmax)
        writer.submit(packed, BatchRows(index, chunk, positions))
        if progress is not None:
            progress.update(sum(lengths[j] for j in positions))


def extract_hf(cfg: Config) -> dict | None:
    """Extract every sample of RUN/data/samples.jsonl into RUN/hidden/; rank 0 returns the manifest."""
    start_s = time.perf_counter()
    device = resolve_device(cfg.target.device)
    rank, world, initialized_here = init_distributed(device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        return _extract(cfg, device, rank, world, start_s)
    finally:
        if initialized_here:
            import torch.distributed as dist

            dist.destroy_process_group()


def _extract(cfg: Config, device: torch.device, rank: int, world: int, start_s: float) -> dict | None:
    run_dir, hidden_dir = cfg.run, cfg.run / "hidden"
    if rank == 0:
        save_config(cfg, run_dir / "config.yaml")
    from eagleforge.data.stage import load_samples

    samples = load_samples(run_dir)
    model, tokenizer = load_target(cfg.target, device=device)
    samples = check_samples(samples, run_dir / "data" / "samples.jsonl", int(text_config(model.config).vocab_size),
                            cfg.data.max_length, cfg.data.overlong)
    num_layers = int(text_config(model.config).num_hidden_layers)
    aux_layers = resolve_aux_layers(cfg.extract.aux_layers, num_layers)
    pad = padding_id(tokenizer) if tokenizer is not None else 0
    shard_writer = ShardWriter(hidden_dir, manifest_header(cfg, model, tokenizer, aux_layers), cfg.extract.storage_dtype,
                         group=rank if world > 1 else None)
    size = cfg.extract.samples_per_shard
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    # Chunk c belongs to group c % world; resume skips chunks that some manifest already lists.
    mine = [(c, chunk) for c, chunk in enumerate(chunks) if c % world == rank]
    # Keyed on content: a chunk whose samples' tokens changed under the same ids is refused.
    todo = [(c, chunk) for c, chunk in mine if not shard_writer.is_complete(c, [row["id"] for row in chunk], chunk)]
    if rank == 0:
        log.info("%d samples in %d chunks; group %d/%d has %d chunks, %d already done; aux layers %s",
                 len(samples), len(chunks), rank, world, len(mine), len(mine) - len(todo), aux_layers)
    total_tokens = sum(len(row["input_ids"]) for _, chunk in todo for row in chunk)
    sink = ShardSink(shard_writer)
    # The writer thread copies and writes chunk c while the forwards of chunk c+1 run.
    with HiddenStateCapture(decoder_layers(model), aux_layers, final_norm(model)) as capture, \
            make_writer(sink, cfg.extract.overlap_writes) as out, \
            tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="extract", disable=rank != 0) as progress:
        for c, chunk in todo:
            extract_chunk(model, capture, c, chunk, cfg, pad, device, out, progress)
        stats = out.close()  # drains the queue: every shard is on disk, or its error raised here
    log.info(writer_summary(stats, time.perf_counter() - start_s))
    _barrier()
    if rank != 0:
        return None
    manifest = merge_manifests(hidden_dir) if world > 1 else load_manifest(hidden_dir)
    log_extraction_summary(manifest, hidden_dir, sink.skipped, time.perf_counter() - start_s)
    return manifest


def log_extraction_summary(manifest: dict, hidden_dir: Path, skipped_here: int, wall_s: float) -> None:
    shards = manifest["shards"]
    samples = sum(e["samples"] for e in shards)
    tokens = sum(e["tokens"] for e in shards)
    total_bytes = sum(e["bytes"] for e in shards)
    skipped = sum(len(e.get("skipped_ids", [])) for e in shards)
    print(
        f"extract: {len(shards)} shards in {hidden_dir}: {samples} samples, {tokens} tokens, "
        f"{total_bytes / max(tokens, 1):.0f} bytes/token ({total_bytes / 2**20:.1f} MiB), "
        f"{skipped} samples skipped for NaN/Inf ({skipped_here} this run), wall time {wall_s:.1f} s",
        flush=True,
    )
