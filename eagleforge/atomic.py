"""Crash-safe file writes: a reader (or a resumed run) finds the old file or the whole new one,
never a part. Every writer here: a temporary name beside the target, write, fsync, os.replace,
fsync the directory (the rename is durable only once the directory entry is on disk, POSIX).

    with atomic_path(run / "shard.safetensors") as tmp:   # any writer that takes a file name
        save_file(tensors, str(tmp))
    write_json_atomic(path, obj); write_jsonl_atomic(path, rows); write_text_atomic(path, text)

(draft/io.py keeps its own directory swap: the draft package imports nothing of the pipeline.)
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator


def fsync_dir(path: Path) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync elsewhere
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields `.tmp-<name>` beside `path`; on a clean exit fsyncs it and renames it over `path`;
    on any error (disk full, Ctrl-C) removes it and re-raises, leaving `path` as it was."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)  # after a rename there is nothing left to remove
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj, indent: int = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    """One compact JSON object per line (ensure_ascii off: text stays readable)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"))
