"""The `data` stage: prompts -> conversations (optionally answered by the target) -> token rows.

    python -m eagleforge.data                                  # embedded default: stdlib prompts, SmolLM2 answers
    python -m eagleforge.data --config configs/x.yaml data.source=chats.jsonl data.regenerate=false
    python -m eagleforge.data data.source=HuggingFaceH4/ultrachat_200k data.split=train_sft

Writes, under RUN = cfg.run_dir:
    RUN/config.yaml                the resolved config (first)
    RUN/data/conversations.jsonl   regeneration only: {"id", "messages", "new_tokens", "finished",
                                   "max_new_tokens"} appended one fsynced batch at a time, so a
                                   killed run resumes where it stopped (ids already there are skipped)
    RUN/data/samples.jsonl         {"id", "input_ids", "loss_mask"} in id order, chat template
                                   applied, truncated; written atomically once complete
    RUN/data/stats.json            counts (prompts, samples, tokens, assistant tokens, truncated,
                                   dropped, skipped malformed rows with line numbers) and the
                                   generation throughput

Inputs (cfg.data.source): "stdlib" (eagleforge.prompts), a local .jsonl/.json file, or a
dataset name / directory for `datasets.load_dataset` (cfg.data.split). Row formats, detected
per row (one file holds one of them; chat and prompt rows may mix):
    chat         {"conversations" | "messages": [{"role", "content"}, ...]}
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
add_generation_prompt) and mapped to tokens through the fast tokenizer's offsets.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import write_json_atomic, write_jsonl_atomic
from .config import Config, UserInputError, run_main, save_config

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
CONVERSATIONS_FILE = "conversations.jsonl"
STATS_FILE = "stats.json"
CLEAN_INPUT_FILE = "input.clean.jsonl"

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# Tokens that end an assistant turn in common chat templates; generation stops at any of them
# that the tokenizer knows as a special token, besides the model's own eos ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "</s>")
MAX_LISTED_MALFORMED = 1000  # stats.json lists at most this many malformed lines (the count is exact)


class TemplateMismatch(ValueError):
    """The chat template does not reproduce an assistant message verbatim (it rewrites it)."""


class _Malformed(ValueError):
    """A row that cannot be used; the message is the reason recorded in stats.json."""


class _NeedsRegeneration(_Malformed):
    """A prompt row while data.regenerate is off: a configuration error, never skipped."""


@dataclass
class Record:
    """One input row after validation: a conversation (messages) or a pre-tokenized sample."""

    id: int
    line: int  # 1-based line (file) or row number (hub dataset) for messages
    messages: list | None = None
    input_ids: list | None = None
    loss_mask: list | None = None


@dataclass
class Stats:
    source: str = ""
    prompts: int = 0  # input rows taken (after data.num_prompts)
    samples: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    truncated: int = 0
    dropped: int = 0
    dropped_reasons: dict = field(default_factory=dict)
    formats: dict = field(default_factory=dict)
    skipped_malformed: int = 0
    malformed_lines: list = field(default_factory=list)  # [{"line": n, "reason": str}]
    generation: dict = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped += 1
        self.dropped_reasons[reason] = self.dropped_reasons.get(reason, 0) + 1


# ----------------------------------------------------------------------------------------------
# Row validation and normalization


def _messages_from(turns, key: str) -> list[dict]:
    """Chat or ShareGPT turns -> [{"role", "content"}], raising _Malformed with the reason."""
    if not isinstance(turns, list):
        raise _Malformed(f"'{key}' is {type(turns).__name__}, expected a list of turns")
    if not turns:
        raise _Malformed(f"empty '{key}'")
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _Malformed(f"'{key}'[{index}] is {type(turn).__name__}, expected an object")
        if turn.get("role") is not None:
            role, content, roles = turn["role"], turn.get("content"), {r: r for r in ROLES}
        elif turn.get("from") is not None:
            role, content, roles = turn["from"], turn.get("value"), SHAREGPT_ROLES
        else:
            raise _Malformed(f"'{key}'[{index}] has neither 'role' nor 'from'")
        if not isinstance(role, str) or role not in roles:  # a list/dict role is unhashable
            raise _Malformed(f"'{key}'[{index}] has unknown role {role!r} (known: {sorted(roles)})")
        if not isinstance(content, str):
            raise _Malformed(f"'{key}'[{index}] content is {type(content).__name__}, expected a string")
        _check_utf8(content, f"'{key}'[{index}] content")
        messages.append({"role": roles[role], "content": content})
    return messages


def _check_utf8(text: str, what: str) -> None:
    """JSON escapes can spell a lone surrogate ("\\ud800"), which no UTF-8 file or tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _Malformed(f"{what} holds {text[err.start]!r}, a lone surrogate (not encodable as UTF-8)") from None


def _token_list(value, key: str, limit: int | None) -> list[int]:
    if not isinstance(value, list) or not value:
        raise _Malformed(f"'{key}' must be a non-empty list of integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _Malformed(f"'{key}' holds a non-integer")
    if limit is not None and not all(0 <= v < limit for v in value):
        raise _Malformed(f"'{key}' holds a value outside [0, {limit})")
    return value


def normalize_row(row, regenerate: bool, vocab_size: int | None = None) -> tuple[str, dict]:
    """(format, fields) of one input row; raises _Malformed(reason) for an unusable row.

    format is "chat", "sharegpt", "prompt" or "pretokenized"; fields hold "messages" or
    "input_ids"/"loss_mask". Keys whose value is None count as missing (a hub dataset with
    mixed rows fills absent columns with None).
    """
    if not isinstance(row, dict):
        raise _Malformed(f"row is {type(row).__name__}, expected a JSON object")
    if row.get("input_ids") is not None:
        input_ids = _token_list(row["input_ids"], "input_ids", vocab_size)
        loss_mask = row.get("loss_mask")
        if loss_mask is None:
            loss_mask = [1] * len(input_ids)
        if not isinstance(loss_mask, list) or len(loss_mask) != len(input_ids) or any(v not in (0, 1) or isinstance(v, bool) for v in loss_mask):
            raise _Malformed(f"'loss_mask' must be a list of 0/1 as long as input_ids ({len(input_ids)})")
        if not any(loss_mask):
            raise _Malformed("'loss_mask' has no 1 (no token to train on)")
        return "pretokenized", {"input_ids": input_ids, "loss_mask": list(loss_mask)}
    for key in ("conversations", "messages"):
        if row.get(key) is not None:
            messages = _messages_from(row[key], key)
            fmt = "sharegpt" if isinstance(row[key][0], dict) and "from" in row[key][0] else "chat"
            break
    else:
        if row.get("prompt") is None:
            raise _Malformed("missing keys: expected 'conversations', 'messages', 'prompt' or 'input_ids'")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise _Malformed("'prompt' must be a non-empty string")
        _check_utf8(row["prompt"], "'prompt'")
        if not regenerate:
            raise _NeedsRegeneration("a prompt row needs data.regenerate=true (the target writes the answer)")
        return "prompt", {"messages": [{"role": "user", "content": row["prompt"]}]}
    has_assistant = any(m["role"] == "assistant" for m in messages)
    if not has_assistant and not regenerate:
        raise _Malformed("no assistant turn")
    if regenerate and not any(m["role"] == "user" for m in _prompt_part(messages)):
        raise _Malformed("no user turn before the first assistant turn")
    return fmt, {"messages": messages}


def _prompt_part(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant turn (what the target answers when regenerating)."""
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            return messages[:index]
    return messages


class _RowChecker:
    """Validates rows one by one; counts malformed ones or raises in strict mode; one file format."""

    def __init__(self, where: str, regenerate: bool, strict: bool, vocab_size: int | None, stats: Stats):
        self.where, self.regenerate, self.strict, self.vocab_size, self.stats = where, regenerate, strict, vocab_size, stats
        self.kind = None  # "messages" or "pretokenized", fixed by the first valid row
        self.kind_line = 0

    def check(self, row, line: int) -> tuple[str, dict] | None:
        try:
            fmt, fields = normalize_row(row, self.regenerate, self.vocab_size)
            kind = "pretokenized" if fmt == "pretokenized" else "messages"
            if self.kind is None:
                self.kind, self.kind_line = kind, line
            elif kind != self.kind:
                raise _Malformed(f"{fmt} row in a file of {self.kind} rows (line {self.kind_line})")
        except _NeedsRegeneration as err:
            raise UserInputError(f"{self.where} line {line}: {err}") from None
        except _Malformed as err:
            self.malformed(line, str(err))
            return None
        self.stats.formats[fmt] = self.stats.formats.get(fmt, 0) + 1
        return fmt, fields

    def malformed(self, line: int, reason: str) -> None:
        if self.strict:
            raise UserInputError(f"{self.where} line {line}: {reason} (data.strict=true)")
        self.stats.skipped_malformed += 1
        if len(self.stats.malformed_lines) < MAX_LISTED_MALFORMED:
            self.stats.malformed_lines.append({"line": line, "reason": reason})


# ----------------------------------------------------------------------------------------------
# Loading the sources


def _read_local(path: Path, checker: _RowChecker) -> list[tuple[int, dict]]:
    """Line-by-line validation of a JSONL file (or one JSON array): [(line, normalized fields)]."""
    raw = path.read_bytes()
    if not raw.strip():
        raise UserInputError(f"data.source {path}: the file is empty")
    if path.suffix == ".json" and raw.lstrip()[:1] == b"[":
        try:
            rows = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise UserInputError(f"data.source {path}: not a valid JSON array ({err})") from None
        return [(i + 1, f) for i, row in enumerate(rows) if (f := checker.check(row, i + 1))]
    valid = []
    for line_no, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline) are not rows
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            checker.malformed(line_no, "not UTF-8")
            continue
        except json.JSONDecodeError as err:
            checker.malformed(line_no, f"bad JSON ({err.msg} at column {err.colno})")
            continue
        except RecursionError:  # e.g. 100k nested "[": json's recursive decoder gives up
            checker.malformed(line_no, "JSON nested too deeply")
            continue
        fields = checker.check(row, line_no)
        if fields:
            valid.append((line_no, fields[1]))
    return valid


def _load_local(path: Path, data_dir: Path, checker: _RowChecker) -> list[Record]:
    """Validate, write the valid rows in one canonical schema, and load that through `datasets`.

    The canonical file (RUN/data/input.clean.jsonl) has the same keys on every row, so the
    json builder infers one Arrow schema; `datasets` memory-maps it, which keeps large inputs
    out of Python objects until they are used.
    """
    valid = _read_local(path, checker)
    if not valid:
        raise UserInputError(f"data.source {path}: no usable row ({checker.stats.skipped_malformed} malformed)")
    clean = data_dir / CLEAN_INPUT_FILE
    write_jsonl_atomic(clean, ({"line": line, **fields} for line, fields in valid))
    import datasets

    dataset = datasets.load_dataset("json", data_files=str(clean), split="train")
    return [Record(id=row["line"] - 1, **row) for row in dataset]


def _load_hub(name: str, split: str, checker: _RowChecker) -> list[Record]:
    import datasets

    try:
        dataset = datasets.load_dataset(name, split=split)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise UserInputError(f"data.source {name!r} (split {split!r}): cannot load the dataset ({str(err).splitlines()[0]})") from None
    records = []
    for index, row in enumerate(dataset):
        fields = checker.check(row, index + 1)
        if fields:
            records.append(Record(id=index, line=index + 1, **fields[1]))
    if not records:
        raise UserInputError(f"data.source {name!r} (split {split!r}): no usable row ({checker.stats.skipped_malformed} malformed)")
    return records


def _stdlib_records(num_prompts: int, seed: int, stats: Stats, code_share: float = 0.0,
                    extra_modules: tuple[str, ...] = ()) -> list[Record]:
    from .prompts import build_prompts

    try:
        prompts = build_prompts(num_prompts, seed, code_share, tuple(extra_modules))
    except ValueError as err:
        raise UserInputError(str(err)) from None
    stats.formats["prompt"] = len(prompts)
    return [Record(id=p.id, line=p.id + 1, messages=[{"role": "user", "content": p.text}]) for p in prompts]


def load_records(cfg: Config, data_dir: Path, vocab_size: int | None, stats: Stats) -> list[Record]:
    """The input rows of cfg.data.source, validated, at most data.num_prompts (seeded choice)."""
    source, data = cfg.data.source, cfg.data
    stats.source = source
    if source == "stdlib":
        return _stdlib_records(data.num_prompts, data.seed, stats, data.code_share, data.extra_modules)
    path = Path(source)
    checker = _RowChecker(f"data.source {path}", data.regenerate, data.strict, vocab_size, stats)
    if path.is_file():
        records = _load_local(path, data_dir, checker)
    elif path.suffix in (".jsonl", ".json") or (source.startswith(("/", "./", "../")) and not path.is_dir()):
        raise FileNotFoundError(f"data.source: no such file: {path}")
    else:
        checker.where = f"data.source {source!r} (split {data.split!r})"
        records = _load_hub(source, data.split, checker)
    if len(records) > data.num_prompts:
        # A seeded subset in source order: reproducible, and spread over the whole input.
        keep = sorted(random.Random(data.seed).sample(range(len(records)), data.num_prompts))
        records = [records[i] for i in keep]
    return records


def _with_system_prompt(messages: list[dict], system_prompt: str) -> list[dict]:
    """Prepend data.system_prompt unless the conversation brings its own system message."""
    if not system_prompt or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


# ----------------------------------------------------------------------------------------------
# Chat template and loss mask


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _try_prefix(tokenizer, messages: list[dict]) -> str | None:
    """The render of `messages` followed by the assistant header, or None if the template refuses."""
    from jinja2 import TemplateError

    try:
        return _render(tokenizer, messages, True)
    except (TemplateError, IndexError, KeyError, TypeError, ValueError):
        return None  # e.g. a template that reads messages[0] of an empty list


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [(start, end)] character span of each assistant message's content).

    The content of assistant message i starts where the render of messages[:i] with the
    generation prompt ends, when that render is a prefix of the full one (true for ChatML,
    Llama-3, Kimi and most templates). Otherwise, or when the template trims the content, the
    content (or its stripped form) is searched after the previous span.
    """
    text = _render(tokenizer, messages, False)
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        candidates = [c for c in dict.fromkeys((message["content"], message["content"].strip()))]
        start = found = None
        prefix = _try_prefix(tokenizer, messages[:index]) if index else None
        if prefix is not None and len(prefix) >= cursor and text.startswith(prefix):
            found = next((c for c in candidates if text.startswith(c, len(prefix))), None)
            start = len(prefix) if found is not None else None
        if start is None:
            for c in candidates:
                position = text.find(c, cursor) if c else -1
                if position >= 0:
                    start, found = position, c
                    break
        if start is None:
            raise TemplateMismatch(f"the chat template does not reproduce assistant message {index} verbatim")
        spans.append((start, start + len(found)))
        cursor = start + len(found)
    return text, spans


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(token, "special", False))
    return ids


def tokenize_messages(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of the whole rendered conversation, no length limit.

    Masked: every token overlapping an assistant content span, plus the token right after it
    when that is a special token (the end of turn that closes the assistant message; the
    newline some templates add after it is not masked). The ids equal
    `apply_chat_template(messages, tokenize=True)`.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserInputError(f"{type(tokenizer).__name__}: the data stage needs a fast tokenizer (offsets)")
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    starts = [start for start, _ in offsets]
    special = _special_ids(tokenizer)
    loss_mask = [0] * len(input_ids)
    for span_start, span_end in spans:
        # tokens overlapping [span_start, span_end): begin before span_end, end after span_start
        first = bisect.bisect_left(starts, span_start)
        while first > 0 and offsets[first - 1][1] > span_start:
            first -= 1  # a token that begins before the span and reaches into it
        for t in range(first, len(input_ids)):
            token_start, token_end = offsets[t]
            if token_start >= span_end:
                break
            if token_end > span_start:
                loss_mask[t] = 1
        after = bisect.bisect_left(starts, span_end)
        while after < len(input_ids) and offsets[after][1] <= span_end:
            after += 1  # skip zero-width or straddling tokens already inside the span
        if after < len(input_ids) and input_ids[after] in special:
            loss_mask[after] = 1
    return input_ids, loss_mask


def fit_length(input_ids: list[int], loss_mask: list[int], max_length: int, overlong: str):
    """(input_ids, loss_mask, status) with status "ok" | "truncated" | "dropped" (None ids when dropped)."""
    if len(input_ids) <= max_length:
        return input_ids, loss_mask, "ok"
    if overlong == "drop":
        return None, None, "dropped"
    if overlong != "truncate":
        raise ValueError(f"data.overlong must be 'truncate' or 'drop', got {overlong!r}")
    return input_ids[:max_length], loss_mask[:max_length], "truncated"


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int, overlong: str = "truncate"):
    """(input_ids, loss_mask) of one chat conversation, or None when it is dropped.

    Dropped: longer than max_length with overlong="drop", or no assistant token left after
    truncation. Raises TemplateMismatch when the template rewrites an assistant message.
    """
    input_ids, loss_mask = tokenize_messages(tokenizer, messages)
    input_ids, loss_mask, _ = fit_length(input_ids, loss_mask, max_length, overlong)
    if input_ids is None or not any(loss_mask):
        return None
    return input_ids, loss_mask


# ----------------------------------------------------------------------------------------------
# Regeneration (greedy, batched, resumable)


def _stop_ids(model, tokenizer) -> list[int]:
    """Token ids that end an answer: the model's eos ids, the tokenizer's eos, end-of-turn tokens."""
    ids = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    special = _special_ids(tokenizer)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] in special)
    return sorted(ids)


def read_conversations(path: Path) -> dict[int, dict]:
    """Answered conversations by id; a torn last line (a killed writer) is cut off the file.

    Rows are appended whole with their newline, so only the tail after the last newline can
    be incomplete; a complete line that is not JSON means the file was damaged otherwise.
    """
    if not path.is_file():
        return {}
    raw = path.read_bytes()
    done, position, line_no = {}, 0, 0
    while position < len(raw):
        newline = raw.find(b"\n", position)
        line_no += 1
        if newline < 0:
            log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(raw) - position)
            with open(path, "r+b") as f:
                f.truncate(position)
                f.flush()
                os.fsync(f.fileno())
            break
        line = raw[position:newline]
        if line.strip():
            try:
                row = json.loads(line.decode("utf-8"))
                done[int(row["id"])] = row
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise UserInputError(f"{path} line {line_no}: not a conversation row; the file is damaged, delete it to regenerate") from None
        position = newline + 1
    return done


def _append_rows(path: Path, rows: list[dict]) -> None:
    """Append whole rows and make them durable before the next batch starts."""
    with open(path, "ab") as f:
        f.write(b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in rows))
        f.flush()
        os.fsync(f.fileno())


def _generate_batch(model, prompt_ids: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int):
    """Greedy answers of a left-padded batch: [(answer ids without the stop token, stopped?)].

    Our own loop rather than `model.generate`: generate keeps computing rows that already
    stopped (a third of the answers stop early) and runs its logits processors every step.
    Here stopped rows leave the batch (their KV cache rows are dropped, a group at a time), the
    KV cache is preallocated (StaticCache: no per-step torch.cat of every layer's K and V), the
    CPU attention groups query heads per KV head (eagleforge.target.use_cpu_attention), and one
    step costs one forward of the rows still in the batch plus one argmax and one host sync. Positions come from the attention
    mask (left padding), as in generate, so each row equals its own unbatched greedy decoding
    up to the numerics of batched matmuls.
    """
    import torch

    from .target import use_cpu_attention

    use_cpu_attention(model)
    if max_new_tokens < 1:
        raise ValueError(f"data.max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    batch, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((batch, width), dtype=torch.long)  # [B, T], 0 = left pad
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    stop_set = set(stop_ids)
    cache = _new_cache(model, width + max_new_tokens)
    answers: list[list[int]] = [[] for _ in prompt_ids]
    finished = [False] * batch
    alive = list(range(batch))  # original row of each row still in the batch
    with torch.inference_mode():
        logits = _forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep=1)  # [B, 1, V]
        next_pos = position_ids[:, -1:] + 1  # [B, 1]
        for step in range(max_new_tokens):
            tokens = logits[:, -1].argmax(dim=-1)  # [b]
            for row, token in zip(alive, tokens.tolist()):  # one host sync per step
                if finished[row]:
                    continue  # stopped earlier, still in the batch until the next drop
                if token in stop_set:
                    finished[row] = True
                else:
                    answers[row].append(token)
            if step == max_new_tokens - 1:
                break
            done = [finished[row] for row in alive]
            # Drop stopped rows once they are an eighth of the batch: each drop copies the
            # whole cache (GBs at batch 512 on a GPU), so it is batched rather than per row.
            if sum(done) >= max(1, len(alive) // 8):
                keep_rows = [i for i, is_done in enumerate(done) if not is_done]
                if not keep_rows:
                    break
                keep = torch.tensor(keep_rows, dtype=torch.long, device=device)  # [b']
                alive = [alive[i] for i in keep_rows]
                _select_rows(cache, keep)
                tokens, attention_mask, next_pos = tokens[keep], attention_mask[keep], next_pos[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(alive), 1)], dim=1)  # [b, T+1]
            logits = _forward(model, tokens[:, None], attention_mask, next_pos, cache)  # [b, 1, V]
            next_pos = next_pos + 1
    return list(zip(answers, finished))


def _generate_fitting(model, prompt_ids: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int):
    """_generate_batch, halving the batch on an accelerator out-of-memory error (the longest
    prompts come last and need the most KV cache); the answers are the same up to the numerics
    of batched matmuls (as between any two batch sizes)."""
    import torch

    try:
        return _generate_batch(model, prompt_ids, max_new_tokens, stop_ids, pad_id)
    except torch.OutOfMemoryError:
        if len(prompt_ids) == 1:
            raise
    torch.cuda.empty_cache()  # outside the except block: the error's frames no longer hold the cache
    half = len(prompt_ids) // 2
    log.warning("out of memory generating %d rows: retrying as %d + %d (lower data.gen_batch_size to avoid this)",
                len(prompt_ids), half, len(prompt_ids) - half)
    return (_generate_fitting(model, prompt_ids[:half], max_new_tokens, stop_ids, pad_id)
            + _generate_fitting(model, prompt_ids[half:], max_new_tokens, stop_ids, pad_id))


def _new_cache(model, max_len: int):
    """A preallocated KV cache: a DynamicCache re-copies every layer's K and V on each step
    (torch.cat), 40% of a bf16 CPU decode step at batch 64."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def _select_rows(cache, keep) -> None:
    """Keep only batch rows `keep` [b'] of a StaticCache (StaticLayer has no batch_select_indices)."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            layer.batch_size = layer.keys.shape[0]


def _forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep: int = 0):
    """One cached forward; transformers >= 5.2x names the cache argument `cache`."""
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kwargs = {key: cache, "use_cache": True}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep  # the prefill needs only the last row of [T, V]
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs).logits


def regenerate(cfg: Config, records: list[Record], data_dir: Path, stats: Stats) -> dict[int, list[dict]]:
    """Answer each record's prompt with the target (greedy); {id: conversation messages}.

    Batches are formed from all prompts sorted by token length (less padding), so a resumed
    run forms the same batches and skips those already in conversations.jsonl.
    """
    from tqdm import tqdm

    from .target import load_target, padding_id

    path = data_dir / CONVERSATIONS_FILE
    done = read_conversations(path)
    model, tokenizer = load_target(cfg.target)
    data = cfg.data
    prompts = {}  # id -> (prompt messages, prompt token ids)
    for record in records:
        messages = _prompt_part(record.messages)
        ids = tokenizer(_render(tokenizer, messages, True), add_special_tokens=False)["input_ids"]
        if len(ids) >= data.max_length:
            stats.drop("prompt_longer_than_max_length")
            continue
        prompts[record.id] = (messages, list(ids))
    for record_id, row in done.items():
        if record_id in prompts and (row["messages"][:-1] != prompts[record_id][0] or row.get("max_new_tokens") != data.max_new_tokens):
            raise UserInputError(
                f"{path}: id {record_id} was answered for another prompt or max_new_tokens (the config changed?); "
                "delete the file or use another run_dir"
            )
    order = sorted(prompts, key=lambda i: (len(prompts[i][1]), i))
    batches = [order[i:i + data.gen_batch_size] for i in range(0, len(order), data.gen_batch_size)]
    todo = [[i for i in batch if i not in done] for batch in batches]
    todo = [batch for batch in todo if batch]
    pending = sum(len(b) for b in todo)
    log.info("regeneration: %d prompts, %d already answered in %s, %d to go", len(prompts), len(prompts) - pending, path, pending)

    stop_ids = _stop_ids(model, tokenizer)
    pad = padding_id(tokenizer)
    new_tokens, seconds = 0, 0.0
    with tqdm(total=pending, unit="prompt", desc="generate", dynamic_ncols=True) as bar:
        for batch in todo:
            start = time.perf_counter()
            answers = _generate_fitting(model, [prompts[i][1] for i in batch], data.max_new_tokens, stop_ids, pad)
            seconds += time.perf_counter() - start
            rows = []
            for record_id, (answer_ids, finished) in zip(batch, answers):
                text = tokenizer.decode(answer_ids, skip_special_tokens=True)
                count = len(answer_ids) + int(finished)  # the stop token is generated too
                new_tokens += count
                rows.append({"id": record_id, "messages": prompts[record_id][0] + [{"role": "assistant", "content": text}],
                             "new_tokens": count, "finished": finished, "max_new_tokens": data.max_new_tokens})
            _append_rows(path, rows)
            done.update((row["id"], row) for row in rows)
            bar.update(len(batch))
            bar.set_postfix(new_tok_s=f"{new_tokens / max(seconds, 1e-9):.1f}")
    stats.generation = {
        "prompts_answered_now": pending,
        "prompts_answered_before": len(prompts) - pending,
        "new_tokens": new_tokens,
        "seconds": round(seconds, 2),
        "new_tokens_per_s": round(new_tokens / seconds, 2) if seconds else None,
        "batch_size": data.gen_batch_size,
        "max_new_tokens": data.max_new_tokens,
        "torch_threads": _torch_threads(),
    }
    log.info("generated %d new tokens in %.1f s (%.1f new tokens/s)", new_tokens, seconds, new_tokens / max(seconds, 1e-9))
    return {i: done[i]["messages"] for i in prompts}


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


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
            if not isinstance(row, dict) or not {"id", "input_ids", "loss_mask"} <= row.keys() or len(row["input_ids"]) != len(row["loss_mask"]):
                raise UserInputError(f"{path} line {line_no}: expected id, input_ids and loss_mask of equal length")
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
            try:
                input_ids, loss_mask = tokenize_messages(tokenizer, messages)
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
    from .target import load_tokenizer

    tokenizer = load_tokenizer(cfg.target)
    records = load_records(cfg, data_dir, len(tokenizer), stats)
    stats.prompts = len(records)
    for record in records:
        if record.messages is not None:
            record.messages = _with_system_prompt(record.messages, cfg.data.system_prompt)
    answered = None
    if cfg.data.regenerate:
        if any(r.input_ids is not None for r in records):
            log.warning("data.source %s is pre-tokenized: its rows are used as they are (data.regenerate does not apply)", cfg.data.source)
        else:
            answered = regenerate(cfg, records, data_dir, stats)
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


if __name__ == "__main__":
    run_main(main, "data stage: prompts -> conversations -> token rows with assistant loss masks")
