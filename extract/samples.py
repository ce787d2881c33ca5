"""The samples an extraction (or online training) forwards: read, checked, cut, batched.

Rows are `{"id": int, "input_ids": [int], "loss_mask": [0/1]}` in id order. The data stage writes
them to RUN/data/samples.jsonl; the native backend may instead read the pre-tokenized JSONL named
by data.source directly (so a Kimi run needs no tokenizer on the extraction nodes). Every row is
checked against the target's vocabulary before any forward, and a batch is a list of positions
packed up to `extract.batch_tokens` padded tokens, longest first: a pure function of the lengths,
so a resumed run (or one on another number of processes) forwards exactly the same batches.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagleforge.config import Config
from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)


def read_samples(cfg: Config, vocab_size: int) -> tuple[list[dict], Path]:
    """(checked rows in id order, the file they came from) for the configured backend: the data
    stage's RUN/data/samples.jsonl; with the native backend, data.source when that file is absent."""
    from eagleforge.data.stage import load_samples

    if cfg.target.backend == "native":
        rows, source = load_samples_native(cfg), samples_source(cfg)
    else:
        rows, source = load_samples(cfg.run), cfg.run / "data" / "samples.jsonl"
    return check_samples(rows, source, vocab_size, cfg.data.max_length, cfg.data.overlong), source


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
