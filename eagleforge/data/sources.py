"""The data stage's inputs: rows from a local JSONL/JSON file, a `datasets` hub dataset or the
built-in stdlib prompts, validated and normalized into `Record`s (a conversation or a
pre-tokenized sample), with malformed rows skipped and counted in `Stats` (or an error naming
file and line under data.strict). Row formats: docs/run-directory.md.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eagleforge.atomic import write_jsonl_atomic
from eagleforge.config import Config
from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)

CLEAN_INPUT_FILE = "input.clean.jsonl"
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MAX_LISTED_MALFORMED = 1000  # stats.json lists at most this many malformed lines (the count is exact)


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
    """Chat or ShareGPT turns -> [{"role", "content"}], raising _Malformed with the reason. An
    assistant turn's reasoning (a thinking model's, `reasoning_content` or `reasoning` as vLLM
    and SGLang send it) is kept as `reasoning_content`: the last turn's is rendered as served
    (data/chat.py), so the draft learns the tokens the target spends most of its time on."""
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
        message = {"role": roles[role], "content": content}
        reasoning = turn.get("reasoning_content") or turn.get("reasoning")  # as chat_client.split_reasoning reads a reply
        if reasoning is not None and message["role"] == "assistant":
            if not isinstance(reasoning, str):
                raise _Malformed(f"'{key}'[{index}] reasoning is {type(reasoning).__name__}, expected a string")
            _check_utf8(reasoning, f"'{key}'[{index}] reasoning")
            if reasoning:
                message["reasoning_content"] = reasoning
        messages.append(message)
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
    if regenerate and not any(m["role"] == "user" for m in prompt_part(messages)):
        raise _Malformed("no user turn before the first assistant turn")
    return fmt, {"messages": messages}


def prompt_part(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant turn (what the target answers when regenerating)."""
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            return messages[:index]
    return messages


class _RowChecker:
    """Validates rows one by one; counts malformed ones or raises in strict mode; one file format.

    vocab_size bounds pre-tokenized ids: an int, None (unchecked) or a function giving it, called
    at the first row with input_ids (so a source of messages never asks for it)."""

    def __init__(self, where: str, regenerate: bool, strict: bool, vocab_size: int | Callable[[], int] | None, stats: Stats):
        self.where, self.regenerate, self.strict, self.vocab_size, self.stats = where, regenerate, strict, vocab_size, stats
        self.kind = None  # "messages" or "pretokenized", fixed by the first valid row
        self.kind_line = 0

    def check(self, row, line: int) -> tuple[str, dict] | None:
        if callable(self.vocab_size) and isinstance(row, dict) and row.get("input_ids") is not None:
            self.vocab_size = self.vocab_size()
        try:
            fmt, fields = normalize_row(row, self.regenerate, None if callable(self.vocab_size) else self.vocab_size)
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
    from eagleforge.data.prompts import build_prompts

    try:
        prompts = build_prompts(num_prompts, seed, code_share, tuple(extra_modules))
    except ValueError as err:
        raise UserInputError(str(err)) from None
    stats.formats["prompt"] = len(prompts)
    return [Record(id=p.id, line=p.id + 1, messages=[{"role": "user", "content": p.text}]) for p in prompts]


def load_records(cfg: Config, data_dir: Path, vocab_size: int | Callable[[], int] | None, stats: Stats) -> list[Record]:
    """The input rows of cfg.data.source, validated, at most data.num_prompts (seeded choice);
    vocab_size as _RowChecker takes it."""
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


def with_system_prompt(messages: list[dict], system_prompt: str) -> list[dict]:
    """Prepend data.system_prompt unless the conversation brings its own system message."""
    if not system_prompt or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}] + messages
