"""Crash-safe file writes: a reader (or a resumed run) finds the old file or the whole new one,
never a part. Every writer here: a temporary name beside the target, write, fsync, os.replace,
fsync the directory (the rename is durable only once the directory entry is on disk, POSIX).

    with atomic_path(run / "shard.safetensors") as tmp:   # any writer that takes a file name
        save_file(tensors, str(tmp))
    write_json_atomic(path, obj); write_jsonl_atomic(path, rows); write_text_atomic(path, text)
    with atomic_dir(run / "draft") as tmp:                 # a whole directory, swapped in at once
        save_file(weights, str(tmp / "model.safetensors"))

Plain standard library, so the draft library uses it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then each directory, deepest first."""
    for folder, _, files in sorted(os.walk(path), key=lambda entry: -entry[0].count(os.sep)):
        for name in files:
            with open(Path(folder) / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(folder))


def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the fully written directory `tmp` durable and swap it in as `path`: a reader finds the
    old directory or the new one, never a mix (the old one is moved aside first, then removed)."""
    tmp, path = Path(tmp), Path(path)
    fsync_tree(tmp)
    old = path.with_name(f".old-{path.name}-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty `.tmp-<name>-<pid>` beside `path` (two processes never share one); on a
    clean exit swaps it in (replace_dir); on any error removes it, leaving `path` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
