"""The `data` stage: prompts -> conversations (optionally answered by the target) -> token rows.

    python -m eagleforge.data                                  # embedded default: stdlib prompts, SmolLM2 answers
    python -m eagleforge.data --config configs/x.yaml data.source=chats.jsonl data.regenerate=false
    python -m eagleforge.data data.source=HuggingFaceH4/ultrachat_200k data.split=train_sft

Writes, under RUN = cfg.run_dir:
    RUN/config.yaml                the resolved config (first)
    RUN/data/conversations.jsonl   regeneration only: {"id", "messages", "new_tokens", "finished",
                                   "max_new_tokens"} appended one fsynced batch (in-process) or
                                   answer (data.server_url) at a time, so a killed run resumes
                                   where it stopped (ids already there are skipped)
    RUN/data/samples.jsonl         {"id", "input_ids", "loss_mask"} in id order, chat template
                                   applied, truncated; written atomically once complete
    RUN/data/stats.json            counts (prompts, samples, tokens, assistant tokens, truncated,
                                   dropped, skipped malformed rows with line numbers) and the
                                   generation throughput

Inputs (cfg.data.source): "stdlib" (eagleforge.data.prompts), a local .jsonl/.json file, or a
dataset name / directory for `datasets.load_dataset` (cfg.data.split). Row formats, detected
per row (one file holds one of them; chat and prompt rows may mix):
    chat         {"conversations" | "messages": [{"role", "content"}, ...]}  (an assistant turn may
                 carry "reasoning_content" or "reasoning": a thinking model's, trained on as served)
    ShareGPT     {"conversations": [{"from": "human" | "gpt" | "system", "value"}, ...]}
    prompt       {"prompt": str}                          (needs data.regenerate=true)
    pre-tokenized {"input_ids": [int], "loss_mask": [0/1]} (loss_mask optional = all ones)
Malformed rows are skipped and counted with their line numbers, or are an error naming the
file and line when data.strict is true. Sample ids are the 0-based index of the source row
(line number - 1 for files, prompt index for stdlib): ids can have gaps where rows were
skipped or dropped.

Loss mask: exactly the assistant tokens, i.e. each assistant message's content plus the
special token the chat template puts right after it (the end of turn, e.g. <|im_end|> or
<|eot_id|>), never the role header. Spans are found in the rendered text (prefix renders with
add_generation_prompt) and mapped to tokens through the fast tokenizer's offsets. Message text
holding a special token's text is refused or tokenized as plain text (data.special_text, chat.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagleforge.atomic import write_json_atomic, write_jsonl_atomic
from eagleforge.config import Config, save_config
from eagleforge.data.chat import TemplateMismatch, fit_length, screen_special_text, tokenize_messages
from eagleforge.data.regenerate import regenerate
from eagleforge.data.sources import Record, Stats, load_records, with_system_prompt
from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
STATS_FILE = "stats.json"


# ----------------------------------------------------------------------------------------------
# Files


def load_samples(run_dir) -> list[dict]:
    """RUN/data/samples.jsonl rows {"id", "input_ids", "loss_mask"} in id order."""
    path = Path(run_dir) / "data" / SAMPLES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no samples; run `python -m eagleforge.data run_dir={run_dir}` first")
    samples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserInputError(f"{path} line {line_no}: not JSON ({err.msg})") from None
            if not isinstance(row, dict) or not {"id", "input_ids", "loss_mask"} <= row.keys() \
                    or not isinstance(row["input_ids"], list) or not isinstance(row["loss_mask"], list) \
                    or len(row["input_ids"]) != len(row["loss_mask"]):
                got = (f"a JSON {type(row).__name__}" if not isinstance(row, dict)
                       else f"keys {sorted(map(str, row))[:6]}" if not {"id", "input_ids", "loss_mask"} <= row.keys()
                       else "input_ids and loss_mask that are not lists of one length")
                raise UserInputError(f"{path} line {line_no}: expected an object of id, input_ids and loss_mask "
                                     f"(lists of one length), got {got}")
            samples.append(row)
    samples.sort(key=lambda row: row["id"])
    return samples


# ----------------------------------------------------------------------------------------------
# The stage


def _samples(cfg: Config, tokenizer, records: list[Record], answered: dict | None, stats: Stats):
    """Token rows in id order, counting truncated and dropped samples."""
    from tqdm import tqdm

    data = cfg.data
    rows = []
    for record in tqdm(records, unit="sample", desc="tokenize", dynamic_ncols=True, disable=len(records) < 1000):
        if record.input_ids is not None:
            input_ids, loss_mask = record.input_ids, record.loss_mask
        else:
            messages = answered.get(record.id) if answered is not None else record.messages
            if messages is None:
                continue  # dropped before generation (counted there)
            plain_text = screen_special_text(tokenizer, record.id, messages, data.special_text, stats)
            if plain_text is None:
                continue  # refused, counted
            try:
                input_ids, loss_mask = tokenize_messages(tokenizer, messages, plain_text)
            except TemplateMismatch:
                stats.drop("template_rewrites_assistant_text")
                continue
        input_ids, loss_mask, status = fit_length(input_ids, loss_mask, data.max_length, data.overlong)
        if status == "dropped":
            stats.drop("longer_than_max_length")
            continue
        if not any(loss_mask):
            stats.drop("no_assistant_token_left_after_truncation")
            continue
        stats.truncated += status == "truncated"
        rows.append({"id": record.id, "input_ids": input_ids, "loss_mask": loss_mask})
    rows.sort(key=lambda row: row["id"])
    return rows


def main(cfg: Config) -> None:
    run = cfg.run
    save_config(cfg, run / "config.yaml")
    data_dir = run / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    stats = Stats()
    from eagleforge.target.loading import load_tokenizer, target_vocab_size

    # Pre-tokenized ids are checked against the target's vocabulary from its config alone: that
    # path never loads a tokenizer (a Kimi-K2.5 node may have none it can run).
    records = load_records(cfg, data_dir, lambda: target_vocab_size(cfg.target), stats)
    pretokenized = all(record.input_ids is not None for record in records)  # a source holds one kind
    tokenizer = None if pretokenized else load_tokenizer(cfg.target)
    stats.prompts = len(records)
    for record in records:
        if record.messages is not None:
            record.messages = with_system_prompt(record.messages, cfg.data.system_prompt)
    answered = None
    if cfg.data.regenerate:
        if any(r.input_ids is not None for r in records):
            log.warning("data.source %s is pre-tokenized: its rows are used as they are (data.regenerate does not apply)", cfg.data.source)
        else:
            answered = regenerate(cfg, records, data_dir, stats, tokenizer)
    rows = _samples(cfg, tokenizer, records, answered, stats)
    stats.samples = len(rows)
    stats.tokens = sum(len(r["input_ids"]) for r in rows)
    stats.assistant_tokens = sum(sum(r["loss_mask"]) for r in rows)
    write_json_atomic(data_dir / STATS_FILE, stats.__dict__)
    if not rows:
        raise UserInputError(f"data.source {cfg.data.source}: no sample left (see {data_dir / STATS_FILE})")
    write_jsonl_atomic(data_dir / SAMPLES_FILE, rows)
    log.info(
        "%s: %d samples, %d tokens (%d assistant), %d truncated, %d dropped, %d malformed rows skipped",
        data_dir / SAMPLES_FILE, stats.samples, stats.tokens, stats.assistant_tokens, stats.truncated, stats.dropped, stats.skipped_malformed,
    )

