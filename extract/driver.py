"""The extract stage: samples -> target forwards with hooks -> RUN/hidden shards, one loop for both backends.

    python -m eagleforge.extract run_dir=runs/x                                  # the processes the config needs
    torchrun --nproc-per-node 8 -m eagleforge.extract --config configs/kimi_k25_pilot.yaml

Samples (extract/samples.py, id order) are cut into fixed chunks of `extract.samples_per_shard`;
chunk c is shard c and belongs to group c % groups (eagleforge/layout.py: a group is one copy of
the target over target.tp ranks; with the hf backend every rank is a group). Within a chunk,
samples are batched up to `extract.batch_tokens` padded tokens, longest first; every rank of a
group forwards the same batches (eagleforge/target/protocol.py) and the group's leader hands each batch's rows
to the writer (extract/writer.py), whose thread copies and writes chunk c while the forwards of
chunk c+1 run. Because a chunk's batches depend only on the chunk, a killed and resumed run (or a
run on another number of processes) writes the same shards; resume skips the chunks the manifests
already list. Rank 0 merges the groups' manifest parts at the end.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eagleforge.config import Config, save_config
from eagleforge.extract.samples import batch_by_tokens, read_samples
from eagleforge.extract.writer import BatchRows, ShardSink, make_writer, writer_summary
from eagleforge.failures import out_of_memory
from eagleforge.layout import Layout
from eagleforge.shards import ShardWriter, load_manifest, merge_manifests
from eagleforge.target.groups import target_layout, with_chosen_layout
from eagleforge.target.protocol import Target, nonfinite_cause, open_target

log = logging.getLogger(__name__)


def extract(cfg: Config) -> dict | None:
    """Extract every sample into RUN/hidden/; rank 0 returns the manifest. target.layout=auto:
    the split of the group's GPUs the extraction plan fits and projects fastest
    (preflight.choose_extract_layout)."""
    start_s = time.perf_counter()
    from eagleforge.extract.native.preflight import choose_extract_layout

    cfg = with_chosen_layout(cfg, cfg.target.device, choose_extract_layout)
    layout = target_layout(cfg, cfg.target.device)
    if not layout.is_main:
        logging.getLogger("eagleforge").setLevel(logging.WARNING)  # logs from rank 0 only
    try:
        if layout.is_main:
            save_config(cfg, cfg.run / "config.yaml")
        samples: list[dict] = []
        target = open_target(cfg, layout, check_inputs=lambda vocab_size: samples.extend(read_samples(cfg, vocab_size)[0]))
        try:
            return _extract(cfg, layout, target, samples, start_s)
        finally:
            target.close()
    finally:
        layout.shutdown()


def _extract(cfg: Config, layout: Layout, target: Target, samples: list[dict], start_s: float) -> dict | None:
    hidden_dir = cfg.run / "hidden"
    size = cfg.extract.samples_per_shard
    chunks = [samples[i:i + size] for i in range(0, len(samples), size)]
    mine = [c for c in range(len(chunks)) if c % layout.num_groups == layout.group_index]
    writer, todo = None, None
    if layout.is_group_leader:
        writer = ShardWriter(hidden_dir, target.header, cfg.extract.storage_dtype,
                             group=layout.group_index if layout.num_groups > 1 else None)
        # Keyed on content: a chunk whose samples' tokens changed under the same ids is refused.
        todo = [c for c in mine if not writer.is_complete(c, [row["id"] for row in chunks[c]], chunks[c])]
    # the group's other ranks follow their leader's list (collectives need the same forwards)
    todo = layout.all_gather_object(todo)[layout.leader]
    log.info("%d samples in %d chunks, %d groups of %d rank(s); group 0 has %d chunks, %d already done; aux layers %s",
             len(samples), len(chunks), layout.num_groups, layout.group_size, len(mine), len(mine) - len(todo),
             target.header["aux_layer_ids"])
    total_tokens = sum(len(row["input_ids"]) for c in todo for row in chunks[c])
    # Only the group leader writes: its writer thread copies and writes chunk c while the group
    # runs the forwards of chunk c+1. The other ranks take part in the forwards and keep nothing.
    cause = nonfinite_cause(target.nonfinite_weights)
    sink = ShardSink(writer, cause) if writer is not None else None
    out = make_writer(sink, cfg.extract.overlap_writes) if sink is not None else None
    batches = [(c, positions) for c in todo for positions in batch_by_tokens(
        [len(row["input_ids"]) for row in chunks[c]], cfg.extract.batch_tokens)]
    if layout.pp > 1:
        # The run's forwards stream through the stages: each is a micro-batch; the pipeline
        # fills and drains once per run, so each stage idles (pp - 1) / (M + pp - 1) of the time.
        log.info("pipeline: %d stages, %d micro-batches (the run's forwards of up to extract.batch_tokens=%d tokens), "
                 "bubble %.1f%%", layout.pp, len(batches), cfg.extract.batch_tokens,
                 100 * (layout.pp - 1) / max(1, len(batches) + layout.pp - 1))
    with (out if out is not None else contextlib.nullcontext()), \
            tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="extract", disable=not layout.is_main) as progress:
        try:
            forward_batches(target, chunks, batches, out, progress)
        except torch.OutOfMemoryError:
            raise out_of_memory("extract", "extract.batch_tokens", cfg.extract.batch_tokens, target.planned_bytes,
                                layout.device) from None
        if out is not None:
            log.info(writer_summary(out.close(), time.perf_counter() - start_s))  # every shard is on disk, or its error raised
    layout.barrier()
    if not layout.is_main:
        return None
    manifest = merge_manifests(hidden_dir) if layout.num_groups > 1 else load_manifest(hidden_dir)
    log_extraction_summary(manifest, hidden_dir, sink.skipped if sink is not None else 0, time.perf_counter() - start_s, cause)
    return manifest


def forward_batches(target: Target, chunks: list[list[dict]], batches: list[tuple[int, list[int]]], writer=None,
                    progress: tqdm | None = None) -> None:
    """Forward each (chunk c, positions in it) of `batches` in order, every rank of the group
    alike; the leader submits each batch's rows to `writer` (OverlappedWriter or InlineWriter
    around a ShardSink, which writes chunk c's shard when its last batch arrives)."""
    for i, (c, positions) in enumerate(batches):
        then = None
        if i + 1 < len(batches):  # the next forward's input: a pipeline stage posts its receive ahead
            c_next, next_positions = batches[i + 1]
            then = [chunks[c_next][j]["input_ids"] for j in next_positions]
        packed = target.forward([chunks[c][j]["input_ids"] for j in positions], then=then)
        if writer is not None:
            writer.submit(packed, BatchRows(c, chunks[c], positions))
        if progress is not None:
            progress.update(sum(len(chunks[c][j]["input_ids"]) for j in positions))


def log_extraction_summary(manifest: dict, hidden_dir: Path, skipped_here: int, wall_s: float, cause: str | None = None) -> None:
    """The stage's last line; with samples skipped for NaN/Inf and a target weight holding NaN/Inf
    (`cause`, nonfinite_cause), that weight is named after the count."""
    shards = manifest["shards"]
    samples = sum(e["samples"] for e in shards)
    tokens = sum(e["tokens"] for e in shards)
    total_bytes = sum(e["bytes"] for e in shards)
    skipped = sum(len(e.get("skipped_ids", [])) for e in shards)
    because = f"; {cause}" if cause is not None and skipped else ""
    print(
        f"extract: {len(shards)} shards in {hidden_dir}: {samples} samples, {tokens} tokens, "
        f"{total_bytes / max(tokens, 1):.0f} bytes/token ({total_bytes / 2**20:.1f} MiB), "
        f"{skipped} samples skipped for NaN/Inf ({skipped_here} this run{because}), wall time {wall_s:.1f} s",
        flush=True,
    )
