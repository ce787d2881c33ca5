"""Crash-safe file writes: a reader (or a resumed run) finds the old file or the whole new one,
never a part. Every writer here: a temporary name beside the target, write, fsync, rename, fsync
the directory (the rename is durable only once the directory entry is on disk, POSIX).

A temporary name carries its writer's host and process id, `.tmp-<name>-<host>-<pid>`, so what a
killed write leaves has a known owner: `sweep_leftovers` (each stage's start, over the run
directory) and the next `atomic_dir` of the same name remove those of dead processes on this
host and never touch a live writer's or another host's.

    with atomic_path(run / "shard.safetensors") as tmp:   # any writer that takes a file name
        save_file(tensors, str(tmp))
    write_json_atomic(path, obj); write_jsonl_atomic(path, rows); write_text_atomic(path, text)
    with atomic_dir(run / "draft") as tmp:                 # a whole directory, swapped in at once
        save_file(weights, str(tmp / "model.safetensors"))

A write that fails for lack of room (ENOSPC, EDQUOT, EFBIG; safetensors' "os error 28") is
one project error naming the path and that the disk is full (`disk_full_error`), the old file
left as it was and nothing partial under its name: `atomic_path`, `atomic_dir` and
`append_durably` turn it into that line themselves.

Plain standard library (and eagleforge.errors), so the draft library uses it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterable, Iterator

from eagleforge.errors import UserInputError

# A write that fails for lack of room: one line naming the file, not a traceback.
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
_OS_ERROR_RE = re.compile(r"os error (\d+)")


def disk_full_errno(err: BaseException) -> int | None:
    """The errno of a write that failed for lack of room (ENOSPC, EFBIG, EDQUOT), else None:
    an OSError's, safetensors' SafetensorError("... (os error 28)") (its Rust writer raises no
    OSError), or the one a `disk_full_error` line records."""
    code = getattr(err, "disk_full_errno", None)
    if code is None and isinstance(err, OSError):
        code = err.errno
    if code is None and type(err).__name__ == "SafetensorError":
        match = _OS_ERROR_RE.search(str(err))
        code = int(match.group(1)) if match else None
    return code if code in DISK_FULL_ERRNOS else None


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing parent)."""
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return None


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def disk_full_error(path: str | os.PathLike, code: int, kept: str = "nothing partial was kept") -> UserInputError:
    """One line (a UserInputError) for a write to `path` that failed for lack of
    room: the errno, the free space there, and `kept` (what the failed write left behind)."""
    path = Path(path)
    free = _free_bytes(path)
    room = "" if free is None else f", {_size(free)} free there"
    err = UserInputError(
        f"{path}: cannot write, {os.strerror(code).lower()} (errno {errno.errorcode.get(code, code)}: "
        f"no space left / file too large{room}); {kept}, free space and rerun to resume"
    )
    err.disk_full_errno = code
    return err


def fsync_dir(path: Path) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync elsewhere
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Remove a file or a whole directory tree, whichever `path` is; nothing if it is absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields `.tmp-<name>-<tag>/<name>` beside `path`, in a directory of its own; on a clean exit
    fsyncs it and renames it over `path`; on any error (disk full, Ctrl-C) removes it and
    re-raises (a full disk as `disk_full_error` naming `path`), leaving `path` as it was. The directory holds whatever the writer makes beside its
    file too (safetensors' save_file writes a randomly named `.tmpXXXXXX` and renames it), so a
    kill leaves one name that `sweep_leftovers` knows."""
    path = Path(path)
    scratch = path.with_name(f".tmp-{path.name}-{_owner_tag()}")
    remove_path(scratch)  # this process's own, from a killed process whose pid it now has
    try:
        scratch.mkdir()
        tmp = scratch / path.name
        try:
            yield tmp
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # what a kill leaves before this is swept later
        fsync_dir(path.parent)
    except Exception as err:  # noqa: BLE001 - a full disk becomes one line, anything else passes as it is
        code = disk_full_errno(err)
        if code is None or getattr(err, "disk_full_errno", None) is not None:
            raise
        raise disk_full_error(path, code) from err


def probe_write(folder: str | os.PathLike) -> None:
    """Create and remove an empty file in `folder`, under a temporary name `sweep_leftovers`
    knows: an OSError (read-only file system, no permission, not a directory) says the folder
    cannot be written before any work is done for it."""
    probe = Path(folder) / f".tmp-write-check-{_owner_tag()}"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    os.unlink(probe)


def append_durably(path: str | os.PathLike, data: bytes, kept: str = "the file is as it was before this write") -> None:
    """Append `data` to `path` and fsync it. A write that fails (a full disk: part of `data` may
    have landed) cuts the file back to its size before, so it never ends in a torn piece; a full
    disk is re-raised as `disk_full_error` naming `path`, saying `kept`."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # unbuffered: nothing is left to be flushed after a cut
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)  # frees what landed, so it cannot fail for room
                os.fsync(fd)
            code = disk_full_errno(err) if isinstance(err, Exception) else None
            if code is None:
                raise
            raise disk_full_error(path, code, kept) from err
    finally:
        os.close(fd)


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


# ----------------------------------------------------------------------------- directories

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 with RENAME_EXCHANGE): no moment
    where either name is missing. False where the system or the file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if os.name == "posix" else None
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP):
        return False  # not supported here (an old kernel, some network file systems)
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the fully written directory `tmp` durable and swap it in as `path`: a reader finds the
    old directory or the new one, never a mix and never neither. The swap is one exchange of the
    two names where the system has it (the old directory then sits under `tmp`, removed last);
    elsewhere the old one is first moved aside to `.old-<name>-<tag>`, which `clear_leftovers`
    moves back should a kill come before the new one is in place."""
    tmp, path = Path(tmp), Path(path)
    fsync_tree(tmp)
    if path.exists() and _exchange(tmp, path):
        fsync_dir(path.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = path.with_name(f".old-{path.name}-{_owner_tag()}")
    remove_path(old)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _owner_tag() -> str:
    """Host and process id: names this process's temporary directories, so two processes (on one
    host or sharing a file system) never write into one, and a later process knows whose it is."""
    return f"{re.sub(r'[^A-Za-z0-9.]', '_', socket.gethostname())}-{os.getpid()}"


def _is_alive_here(tag: str) -> bool:
    """Whether the process that `_owner_tag` named may still be running: another host's or a live
    process here (its own count as alive to the caller that checks before writing)."""
    host, _, pid = tag.rpartition("-")
    if host != _owner_tag().rpartition("-")[0] or not pid.isdigit():
        return True
    if int(pid) == os.getpid():
        return False  # this process's own, from before (a pid reused after a kill)
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def clear_leftovers(path: str | os.PathLike) -> None:
    """Remove what a killed `atomic_dir(path)` of a dead process on this host left beside `path`:
    its `.tmp-<name>-<tag>` (a partial write, or the old directory after an exchange) and its
    `.old-<name>-<tag>` (the old directory moved aside), the latter moved back first where `path`
    itself is missing (a kill between a swap's two renames)."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    for kind in ("old", "tmp"):  # .old first: it may be the only whole copy
        prefix = f".{kind}-{path.name}-"
        for entry in sorted(path.parent.iterdir()):
            if not entry.name.startswith(prefix) or _is_alive_here(entry.name[len(prefix):]):
                continue
            if kind == "old" and not path.exists() and entry.is_dir():
                with contextlib.suppress(FileNotFoundError):  # another sweeper moved it first
                    os.replace(entry, path)
                    fsync_dir(path.parent)
            else:
                remove_path(entry)


# `.tmp-<name>-<host>-<pid>` / `.old-<name>-<host>-<pid>` (`_owner_tag`'s host has no "-")
_LEFTOVER = re.compile(r"\.(?:tmp|old)-(?P<name>.+)-[A-Za-z0-9._]+-\d+")


def sweep_leftovers(folder: str | os.PathLike, depth: int = 2) -> None:
    """`clear_leftovers` for every name under `folder` (and its folders, `depth` levels down) that
    has a temporary or moved-aside copy: where nothing writes a name again (a vocab file found up
    to date, a finished cache), its leftover would otherwise stay."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    names = set()
    for entry in folder.iterdir():
        if match := _LEFTOVER.fullmatch(entry.name):
            names.add(match["name"])
        elif depth > 0 and not entry.name.startswith(".") and entry.is_dir() and not entry.is_symlink():
            sweep_leftovers(entry, depth - 1)
    for name in sorted(names):
        clear_leftovers(folder / name)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty `.tmp-<name>-<tag>` beside `path` (two processes never share one); on a
    clean exit swaps it in (replace_dir); on any error removes it, leaving `path` as it was (a
    full disk is re-raised as `disk_full_error` naming `path`). What
    a killed earlier writer on this host left is cleared first (clear_leftovers)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clear_leftovers(path)
    tmp = path.with_name(f".tmp-{path.name}-{_owner_tag()}")
    try:
        tmp.mkdir()
        try:
            yield tmp
            replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except Exception as err:  # noqa: BLE001 - a full disk becomes one line, anything else passes as it is
        code = disk_full_errno(err)
        if code is None or getattr(err, "disk_full_errno", None) is not None:
            raise
        raise disk_full_error(path, code) from err
